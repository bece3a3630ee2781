"""``amdqb demo``: six balancers on one drifting stream, summary.json, the diagnostics,
``--compare-scales``, determinism and the plots.

The small configuration (E=16, k=2, T=1024, 32 steps, late window 8) keeps each run to a few
seconds on a CPU. 32 steps, not fewer: log_margin QB starts from a bias spread of 0, where its axis
scale is eps_0 = 1e-30 and one step can widen the spread by at most ~14x (the axis reaches 6.55
spreads), so it needs ~20 steps to reach the ~0.1 spread this stream wants; the late window
(steps 24-31) lies after that. On it, over seeds 0-11, "none" ends with a late MaxVio of
1.23-3.44 and every QB variant with 0.19-0.27 (on each seed none is >= 5.6x its worst QB
variant), so "QB below half of none" holds with a wide margin, not by luck.
"""

import importlib.util
import json
import sys

import pytest

from amdqb import demo

METHODS = ("none", "aux_free", "qb_uniform", "qb_log_margin", "qb_exact", "qb_tie_free")
QB = ("qb_uniform", "qb_log_margin", "qb_exact", "qb_tie_free")
BINNED = ("qb_uniform", "qb_log_margin", "qb_tie_free")
STEPS = 32
SMALL = ["--experts", "16", "--topk", "2", "--tokens", "1024", "--steps", str(STEPS)]
SMALL += ["--window", "8"]


def _run(tmp_path, name, device, *extra, filename="summary.json") -> dict:
    out = tmp_path / name
    rc = demo.main([*SMALL, "--device", str(device), "--out", str(out), *extra])
    assert rc == 0
    path = out / filename
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
        assert len(row["tie_at_cutoff"]) == STEPS
        assert row["late_maxvio"] >= 0 and row["late_cv2"] >= 0
        assert 0.0 <= row["late_tie_at_cutoff"] <= 1.0
    # Every method starts from bias 0 and routes s + 0 = s (tie_free: -sigmoid(-z), the same
    # order here: no fp32 ties at logit std 1.5), so step 0 routes identically.
    assert len({methods[name]["maxvio"][0] for name in METHODS}) == 1
    # The bin diagnostic exists for the binned methods only.
    for name in ("none", "aux_free", "qb_exact"):
        assert methods[name]["late_margin_below_bin"] is None
    for name in BINNED:
        assert 0.0 <= methods[name]["late_margin_below_bin"] <= 1.0
    none = methods["none"]["late_maxvio"]
    assert none > 1.0, "the default stream should be clearly unbalanced without a bias"
    for name in QB:
        assert methods[name]["late_maxvio"] < 0.5 * none, (name, methods[name]["late_maxvio"], none)
    assert summary["config"]["experts"] == 16 and summary["config"]["topk"] == 2
    assert set(summary["router_backend"]) == set(METHODS)


def test_fp64_reference_row(tmp_path, device):
    summary = _run(tmp_path, "r", device, "--fp64-reference", "--no-plot")
    methods = summary["methods"]
    assert set(methods) == {*METHODS, demo.REFERENCE}
    ref = methods[demo.REFERENCE]
    assert ref["late_margin_below_bin"] is None
    assert ref["late_maxvio"] < 0.5 * methods["none"]["late_maxvio"]


def test_saturation_diagnostics(tmp_path, device):
    """At logit std 20 most fp32 sigmoid scores at the cutoff are exactly 1 (z > 16.6): the TE
    selection ``s + b`` ties there, the tie-free ``b - sigmoid(-z)`` does not (its fp32 values
    only tie once exp(-z) underflows, z > 87), and uniform bins of width ~2e-3 are far wider than
    any cutoff gap."""
    summary = _run(
        tmp_path, "t", device, "--logit-scale", "20", "--steps", "3", "--window", "3", "--no-plot"
    )
    methods = summary["methods"]
    assert methods["none"]["late_tie_at_cutoff"] > 0.3
    assert methods["qb_tie_free"]["late_tie_at_cutoff"] < 1e-3
    assert methods["qb_uniform"]["late_margin_below_bin"] > 0.9


def test_compare_scales(tmp_path, device):
    summary = _run(
        tmp_path,
        "c",
        device,
        "--compare-scales",
        "--scales",
        "1,20",
        "--steps",
        "3",
        "--window",
        "2",
        "--no-plot",
        filename="compare_scales.json",
    )
    table = summary["maxvio_table"]
    assert set(table) == {*METHODS, demo.REFERENCE}
    for name, row in table.items():
        assert set(row) == {"1", "20"}
        assert all(v >= 0 for v in row.values())
        for scale in ("1", "20"):
            assert summary["scales"][scale][name]["late_maxvio"] == row[scale]
    assert not (tmp_path / "c" / "summary.json").exists()


def test_same_seed_same_summary(tmp_path, device):
    first = _run(tmp_path, "a", device, "--seed", "5", "--no-plot")
    second = _run(tmp_path, "b", device, "--seed", "5", "--no-plot")
    for summary in (first, second):
        summary.pop("wall_s")
    assert first == second
    other = _run(tmp_path, "c", device, "--seed", "6", "--no-plot", "--steps", "2", "--window", "1")
    assert other["methods"]["none"]["maxvio"] != first["methods"]["none"]["maxvio"][:2]


@pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None,
    reason="matplotlib (the 'plot' extra) is not installed",
)
def test_plots_written(tmp_path, device):
    _run(tmp_path, "p", device, "--steps", "6", "--window", "3")
    png = tmp_path / "p" / "qb_demo.png"
    assert png.is_file()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    _run(
        tmp_path,
        "q",
        device,
        "--compare-scales",
        "--scales",
        "1,3",
        "--steps",
        "2",
        "--window",
        "1",
        "--methods",
        "none,qb_log_margin",
        filename="compare_scales.json",
    )
    png = tmp_path / "q" / "qb_compare_scales.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_matplotlib_skips_plot(tmp_path, device, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    _run(tmp_path, "m", device, "--steps", "3", "--window", "2")
    assert not (tmp_path / "m" / "qb_demo.png").exists()
    assert "matplotlib is not installed" in capsys.readouterr().out


def test_bad_arguments_are_rejected(tmp_path, device):
    assert demo.main(["--experts", "8", "--topk", "8", "--out", str(tmp_path), "--no-plot"]) == 2
    with pytest.raises(SystemExit):
        demo.main(["--methods", "qb_nonsense", "--out", str(tmp_path), "--no-plot"])
    with pytest.raises(SystemExit):
        demo.main(["--compare-scales", "--scales", "1,-3", "--out", str(tmp_path)])
