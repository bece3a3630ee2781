"""The command line: ``amdqb --help`` lists every command and bench suite, unknown commands and
out-of-range options are named in an error (exit 2), and ``amdqb bench`` writes tables with the
device / versions / shape header and p20 / p50 / p80, JSON rows with a ``backend``, pinned CPU
threads, and H200 targets only on an H200 (CPU runs, small shapes)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from amdqb import cli

ROOT = Path(__file__).resolve().parent.parent


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_top_level_help_lists_every_command_and_suite(capsys):
    from amdqb.bench import cli as bench_cli

    for argv in ([], ["--help"], ["-h"]):
        rc, out, _ = run(capsys, *argv)
        assert rc == 0
        for name, (short, _) in cli.COMMAND_HELP.items():
            assert name in out and short in out
        for suite, text in bench_cli.SUITE_HELP.items():
            assert f"    {suite:8s} {text}" in out
    # every suite bench runs has its description, and every description a suite
    assert set(bench_cli.SUITE_HELP) == {*bench_cli.SUITES, "all"}
    rc, out, _ = run(capsys, "bench", "--help")
    assert rc == 0 and all(f"  {suite:8s} " in out for suite in bench_cli.SUITES)


def test_bench_runs_from_the_installed_package(tmp_path):
    """``amdqb bench`` imports its library from the package (a wheel holds amdqb.bench): run from
    a folder that is not the checkout, with the package alone on the path."""
    import subprocess

    from setuptools import find_packages

    assert "amdqb.bench" in find_packages(str(ROOT), include=["amdqb*"])  # pyproject's rule
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the package's folder; cwd is elsewhere
    for argv in (["bench", "--help"], ["bench", "balance", "--help"]):
        res = subprocess.run(
            [sys.executable, "-m", "amdqb", *argv],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert res.returncode == 0, res.stderr[-2000:]
        assert "usage: amdqb bench" in res.stdout


@pytest.mark.parametrize("command", ["info", "demo", "bench"])
def test_every_command_has_help(capsys, command):
    rc, out, _ = run(capsys, command, "--help")
    assert rc == 0 and f"usage: amdqb {command}" in out and len(out.splitlines()) > 5


def test_version(capsys):
    import amdqb

    rc, out, _ = run(capsys, "--version")
    assert rc == 0 and amdqb.__version__ in out


@pytest.mark.parametrize("argv", [["bogus"], ["route"], ["--frobnicate"], ["bench", "bogus"]])
def test_unknown_command_is_named(capsys, argv):
    rc, _, err = run(capsys, *argv)
    assert rc == 2 and argv[-1] in err and "Traceback" not in err


DEMO_BAD = [
    (["--bins", "1"], "--bins"),
    (["--bins", "two"], "--bins"),
    (["--logit-scale", "-1"], "--logit-scale"),
    (["--logit-scale", "0"], "--logit-scale"),
    (["--logit-scale", "nan"], "--logit-scale"),
    (["--logit-scale", "inf"], "--logit-scale"),
    (["--steps", "0"], "--steps"),
    (["--tokens", "-4"], "--tokens"),
    (["--experts", "1"], "--experts"),
    (["--topk", "0"], "--topk"),
    (["--dim", "0"], "--dim"),
    (["--window", "0"], "--window"),
    (["--hot", "-1"], "--hot"),
    (["--drift", "-0.5"], "--drift"),
    (["--aux-rate", "nan"], "--aux-rate"),
    (["--hot-offset", "inf"], "--hot-offset"),
    (["--threads", "-2"], "--threads"),
    (["--print-every", "-1"], "--print-every"),
    (["--seed", "-1"], "--seed"),
    (["--unknown"], "--unknown"),
]


@pytest.mark.parametrize("argv,option", DEMO_BAD, ids=[" ".join(a) for a, _ in DEMO_BAD])
def test_demo_rejects_out_of_range_options(capsys, tmp_path, argv, option):
    rc, _, err = run(capsys, "demo", "--out", str(tmp_path), "--no-plot", *argv)
    assert rc == 2 and option in err and "Traceback" not in err
    assert not (tmp_path / "summary.json").exists()


def test_info_rejects_a_bad_device(capsys):
    rc, _, err = run(capsys, "info", "--device", "tpu:0")
    assert rc == 2 and "--device" in err


# Every command parses --device with the package's one parser: the same one-line error (exit 2,
# no traceback) for a device type amdqb does not run on and for a GPU this machine lacks.
COMMANDS_WITH_DEVICE = [
    ["info"],
    ["demo", "--steps", "1", "--tokens", "8", "--experts", "8", "--topk", "2"],
    ["bench", "balance"],
]
NOT_A_DEVICE = ["mps", "meta", "xpu", "tpu:0", "cuda:x"]


@pytest.mark.parametrize("command", COMMANDS_WITH_DEVICE, ids=lambda c: c[0])
@pytest.mark.parametrize(
    "device", NOT_A_DEVICE + ([] if torch.cuda.is_available() else ["cuda", "gpu", "hip", "cuda:1"])
)
def test_every_command_rejects_a_device_it_cannot_use_in_one_line(capsys, command, device):
    rc, out, err = run(capsys, *command, "--device", device)
    lines = [line for line in err.splitlines() if "error" in line]  # argparse adds its usage
    assert rc == 2 and "Traceback" not in err + out, err
    assert len(lines) == 1 and "--device" in lines[0] and repr(device) in lines[0], err


BENCH_BAD = [
    (["router", "--tokens", "0"], "--tokens"),
    (["router", "--tokens", "abc"], "--tokens"),
    (["router", "--tokens", ","], "--tokens"),
    (["router", "--experts", "0"], "--experts"),
    (["router", "--topk", "-1"], "--topk"),
    (["router", "--experts", "8", "--topk", "8"], "--topk"),
    (["route", "--topk", "5000"], "topk"),  # above every default expert count (896 on a GPU)
    (["balance", "--samples", "0"], "--samples"),
    (["chunks", "--threads", "0"], "--threads"),
    (["router", "--device", "tpu:0"], "--device"),
    (["everything"], "everything"),
]


@pytest.mark.parametrize("argv,option", BENCH_BAD, ids=[" ".join(a) for a, _ in BENCH_BAD])
def test_bench_rejects_bad_options(capsys, argv, option):
    rc, _, err = run(capsys, "bench", *argv)
    assert rc == 2 and option in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU defaults (pinned threads)")
def test_bench_balance_json_header_percentiles_and_threads(capsys, tmp_path):
    path = tmp_path / "out.json"
    before = torch.get_num_threads()
    argv = ["bench", "balance", "--experts", "16", "--topk", "2", "--samples", "3", "--calls", "1"]
    rc, out, _ = run(capsys, *argv, "--json", str(path))
    assert rc == 0 and torch.get_num_threads() == before, "threads restored after the run"
    assert "### balancer_step" in out and "device: cpu" in out and "shape: E=16, k=2" in out
    assert "| p20_us | p50_us | p80_us |" in out and "torch threads 1" in out
    data = json.loads(path.read_text())["balancer_step"]
    env = data["env"]
    for key in ("device", "arch", "torch", "triton", "amdqb", "git", "date", "shape", "timing"):
        assert key in env, key
    assert env["threads"] == 1
    assert {r["binning"] for r in data["rows"]} == {"uniform", "log_margin"}
    for row in data["rows"]:
        assert row["backend"] in ("hip", "triton", "torch")
        assert row["p20_us"] <= row["us"] <= row["p80_us"]
        assert row["E"] == 16 and row["k"] == 2
        assert "target_us" not in row, "the H200 target only applies on an H200"
    rc, _, _ = run(capsys, *argv, "--threads", "2", "--json", str(tmp_path / "two.json"))
    assert rc == 0
    assert json.loads((tmp_path / "two.json").read_text())["balancer_step"]["env"]["threads"] == 2


def test_bench_router_and_chunks_show_amdqb_rows(capsys, tmp_path):
    path = tmp_path / "r.json"
    common = ["--samples", "2", "--calls", "1", "--json", str(path)]
    rc, out, _ = run(
        capsys, "bench", "router", "--tokens", "8", "--experts", "16", "--topk", "4", *common
    )
    assert rc == 0 and "### router" in out and "### biased_topk" in out
    assert "| T | E | k | dtype | backend | mode |" in out
    rc, out, _ = run(capsys, "bench", "chunks", "--tokens", "64", *common)
    assert rc == 0
    data = json.loads(path.read_text())
    router_rows = data["router"]["rows"]
    modes = {(r["backend"], r["mode"]) for r in router_rows}
    assert {m for _, m in modes} >= {"noqb", "two_kernel", "fused_atomic", "te_style_qb"}
    assert any(m != "te_style_qb" for _, m in modes), "amdqb's own rows on every device"
    for r in router_rows + data["biased_topk"]["rows"]:
        assert (r["E"], r["k"], r["dtype"]) == (16, 4, "fp32") and "backend" in r
        assert not any(k.startswith("x_vs") or k == "target_us" for k in r)
    chunk_rows = data["chunks"]["rows"]
    assert {r["impl"] for r in chunk_rows} == {"fused", "split_cat"}
    assert all(r["backend"] in ("hip", "triton", "torch") for r in chunk_rows)


def test_rows_print_floors_measured_in_the_run_and_no_peer_constant(capsys, tmp_path):
    """No typed-in peer figure or target reaches a row, on any device: the router's rows carry the
    copy floor of their own bytes and biased_topk's the launch floor, both timed in the run."""
    from amdqb.bench import cli as bench_cli

    path = tmp_path / "out.json"
    argv = ["router", "--quick", "--experts", "16", "--topk", "4", "--json", str(path)]
    argv += ["--tokens", "8"]
    assert bench_cli.main(argv) == 0
    data = json.loads(path.read_text())
    rows = data["router"]["rows"] + data["biased_topk"]["rows"]
    assert rows and all(r["floor_us"] > 0 and r["x_floor"] > 0 for r in rows)
    assert not any(k.startswith("x_vs") or k in ("target_us", "meets") for r in rows for k in r)
