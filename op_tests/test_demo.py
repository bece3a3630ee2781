"""``amdqb demo``: four balancers on one drifting stream, summary.json, determinism and the plot.

The small configuration (E=16, k=2, T=1024, 20 steps, late window 8) keeps each run under a second
on a CPU. On it, over seeds 0-11, "none" ends with a late MaxVio of 1.28-3.31 (one hot expert plus
the drifting router) and both QB variants with 0.19-0.28 (near the sampling floor of 128 tokens per
expert), so "QB below half of none" holds with a wide margin (>= 4.5x), not by luck.
"""

import importlib.util
import json
import sys

import pytest

from amdqb import demo

METHODS = ("none", "aux_free", "qb_hist", "qb_exact")
STEPS = 20
SMALL = [
    "--experts",
    "16",
    "--topk",
    "2",
    "--tokens",
    "1024",
    "--steps",
    str(STEPS),
    "--window",
    "8",
]


def _run(tmp_path, name, device, *extra) -> dict:
    out = tmp_path / name
    rc = demo.main([*SMALL, "--device", str(device), "--out", str(out), *extra])
    assert rc == 0
    path = out / "summary.json"
    assert path.is_file()
    return json.loads(path.read_text())


@pytest.mark.parametrize("seed", [0, 3])
def test_summary_has_all_methods_and_qb_balances(tmp_path, device, seed):
    summary = _run(tmp_path, f"s{seed}", device, "--seed", str(seed), "--no-plot")
    methods = summary["methods"]
    assert set(methods) == set(METHODS)
    for name in METHODS:
        row = methods[name]
        assert len(row["maxvio"]) == STEPS and len(row["cv2"]) == STEPS
        assert row["late_maxvio"] >= 0 and row["late_cv2"] >= 0
    # Every method starts from bias 0, so step 0 routes identically.
    assert len({methods[name]["maxvio"][0] for name in METHODS}) == 1
    # The resolution diagnostic exists for the QB methods only.
    assert methods["none"]["late_margin_below_bin"] is None
    for name in ("qb_hist", "qb_exact"):
        assert 0.0 <= methods[name]["late_margin_below_bin"] <= 1.0
    none = methods["none"]["late_maxvio"]
    assert none > 1.0, "the default stream should be clearly unbalanced without a bias"
    for name in ("qb_hist", "qb_exact"):
        assert methods[name]["late_maxvio"] < 0.5 * none, (name, methods[name]["late_maxvio"], none)
    assert summary["config"]["experts"] == 16 and summary["config"]["topk"] == 2


def test_same_seed_same_summary(tmp_path, device):
    first = _run(tmp_path, "a", device, "--seed", "5", "--no-plot")
    second = _run(tmp_path, "b", device, "--seed", "5", "--no-plot")
    assert first == second
    other = _run(tmp_path, "c", device, "--seed", "6", "--no-plot", "--steps", "2", "--window", "1")
    assert other["methods"]["none"]["maxvio"] != first["methods"]["none"]["maxvio"][:2]


@pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None,
    reason="matplotlib (the 'plot' extra) is not installed",
)
def test_plot_written(tmp_path, device):
    _run(tmp_path, "p", device, "--steps", "6", "--window", "3")
    png = tmp_path / "p" / "qb_demo.png"
    assert png.is_file()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_matplotlib_skips_plot(tmp_path, device, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    _run(tmp_path, "m", device, "--steps", "3", "--window", "2")
    assert not (tmp_path / "m" / "qb_demo.png").exists()
    assert "matplotlib is not installed" in capsys.readouterr().out


def test_bad_topk_is_rejected(tmp_path, device):
    assert demo.main(["--experts", "8", "--topk", "8", "--out", str(tmp_path), "--no-plot"]) == 2
