"""The multi-seed parity protocol (`train_example.parity --seeds N`, `train_example.protocol`):
its statistics on hand-worked numbers, and one end-to-end run of the "micro" preset on the CPU
(two seeds trained by separate ``--only-seed`` invocations, then compared with ``--resume``)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from train_example import parity
from train_example import protocol as PR
from train_example import train as T

STEPS = 4
MICRO = ["--preset", "micro", "--steps", str(STEPS), "--device", "cpu", "--quiet"]
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def test_t_quantiles():
    assert PR.t_quantile(1) == 12.706 and PR.t_quantile(2) == 4.303
    assert abs(PR.t_quantile(31) - 2.040) < 1e-3  # the expansion meets the table
    assert abs(PR.T975[-1] - PR.t_quantile(31)) < 3e-3
    assert abs(PR.t_quantile(10_000) - PR.Z975) < 1e-3
    with pytest.raises(ValueError, match="at least 2 samples"):
        PR.t_quantile(0)


def test_paired_interval_by_hand():
    d = PR.paired([0.002, 0.003, 0.0025])
    half = 4.303 * 0.0005 / math.sqrt(3)
    assert d["mean"] == pytest.approx(0.0025) and d["sd"] == pytest.approx(0.0005)
    assert d["ci95"] == pytest.approx([0.0025 - half, 0.0025 + half])


@pytest.mark.parametrize("diffs, ok, why", [
    ([0.002, 0.003, 0.0025], True, "within"),      # a resolved bias, but below 0.5%
    ([-0.02, 0.03, 0.001], True, "zero"),          # noisy: no bias resolved, mean within 1%
    ([0.0055, 0.0065, 0.006], False, "ci"),        # mean 0.6% < 1%, but a resolved bias > 0.5%
    ([0.012, 0.011, 0.013], False, "mean"),        # mean beyond 1%
])
def test_verdict_rules(diffs, ok, why):
    bf16 = PR.spread([1.0, 1.0, 1.0])
    mx = PR.spread([1.0 + x for x in diffs])
    v = PR.verdict(bf16, mx, PR.paired(diffs), final_tol=0.01, ci_tol=0.005)
    assert v["pass"] is ok
    assert v["ci_within_tolerance"] is (why == "within")
    assert v["ci_includes_zero"] is (why == "zero")
    assert v["mean_pass"] is (why != "mean")


@pytest.mark.parametrize("extra, expected", [
    (["--recipes", "1x128"], "--recipes needs --seeds"),
    (["--only-seed", "0"], "--only-seed needs --seeds"),
    (["--seeds", "2", "--bf16-repeat", "1"], "pass one of them"),
    (["--seeds", "2", "--recipes", "1x32", "--scale-blocks", "1x128"], "not both"),
    (["--seeds", "2", "--only-seed", "5"], "not one of the protocol's seeds 0..1"),
])
def test_protocol_argument_errors(tmp_path, extra, expected):
    with pytest.raises(SystemExit, match=expected):
        parity.main([*MICRO, "--out", str(tmp_path / "p"), *extra])
    assert not (tmp_path / "p").exists() or not any((tmp_path / "p").iterdir())


@pytest.mark.parametrize("extra", [["--seeds", "1"], ["--seeds", "2", "--recipes", "1x64"],
                                   ["--seeds", "2", "--recipes", "1x32,1x32"]])
def test_protocol_usage_errors(tmp_path, capsys, extra):
    with pytest.raises(SystemExit) as e:
        parity.main([*MICRO, "--out", str(tmp_path / "p"), *extra])
    assert e.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1


def test_protocol_end_to_end(tmp_path, capsys):
    out = tmp_path / "p"
    argv = [*MICRO, "--out", str(out), "--seeds", "2", "--recipes", "1x128"]
    for seed in (0, 1):  # as parallel processes would
        assert parity.main([*argv, "--only-seed", str(seed)] + (["--resume"] if seed else [])) == 0
    assert not (out / "summary.json").exists()
    logs = {s: {n: T.read_log(out / f"seed{s}" / n / "log.csv") for n in ("bf16", "mxfp8-1x128")}
            for s in (0, 1)}
    capsys.readouterr()
    rc = parity.main([*argv, "--resume"])  # every run finished: nothing trains, it compares
    assert {s: {n: T.read_log(out / f"seed{s}" / n / "log.csv") for n in logs[s]}
            for s in (0, 1)} == logs
    printed = capsys.readouterr().out
    assert "PARITY 1x128" in printed and "over 2 seeds" in printed

    summary = json.loads((out / "summary.json").read_text())
    proto = summary["protocol"]
    st = proto["recipes"]["1x128"]
    assert summary["seeds"] == [0, 1] and proto["seeds"] == [0, 1]
    assert summary["compile"] == "none"  # the mode the runs resolved (--compile auto, CPU)
    assert summary["pass"] == st["verdict"]["pass"] == (rc == 0) and rc in (0, 1)
    assert st["resolved"] == "1x128"
    # the paired differences are the per-seed final losses' (criterion 1 of the single run)
    bf = [parity.final_val(logs[s]["bf16"], STEPS) for s in (0, 1)]
    mx = [parity.final_val(logs[s]["mxfp8-1x128"], STEPS) for s in (0, 1)]
    assert proto["bf16"]["final_val_loss"]["per_seed"] == bf
    assert st["paired_rel_diff_final_val"]["per_seed"] == [(m - b) / b for m, b in
                                                           zip(mx, bf, strict=True)]
    lo, hi = st["paired_rel_diff_final_val"]["ci95"]
    assert lo <= st["paired_rel_diff_final_val"]["mean"] <= hi
    # seeds differ (data order, initial weights); precisions of one seed share the first batch
    assert logs[0]["bf16"][0]["train_loss"] != logs[1]["bf16"][0]["train_loss"]
    for s in (0, 1):
        first = [logs[s][n][0]["train_loss"] for n in ("bf16", "mxfp8-1x128")]
        assert abs(first[0] - first[1]) < 0.01

    header = (out / "loss.csv").read_text().splitlines()[0].split(",")
    for key in ("bf16_train_ema_min", "bf16_val_max", "mxfp8-1x128_val_rel_mean"):
        assert key in header
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_band_figure_shades_each_precision(tmp_path):
    """The plot's seed bands: one filled band per precision and panel (train EMA, validation)
    plus one per recipe for the paired difference."""
    def log(seed, shift):
        return [{"step": i, "train_loss": 5.0 - 0.1 * i + shift + 0.01 * seed,
                 "val_loss": (5.0 - 0.1 * i + shift) if i % 2 == 0 else None}
                for i in range(1, 7)]

    logs = {s: {"bf16": log(s, 0.0), "mxfp8-1x32": log(s, 0.001)} for s in (0, 1, 2)}
    args = SimpleNamespace(ema_beta=0.9, final_tol=0.01, ci_tol=0.005)
    result, rows = PR.evaluate(logs, ["1x32"], 6, 1, args)
    assert result["recipes"]["1x32"]["verdict"]["pass"]
    fig = PR.figure(rows, result, "t")
    ax_t, ax_v, ax_d = fig.axes
    assert len(ax_t.collections) == 2 and len(ax_v.collections) == 2
    assert len(ax_d.collections) == 1
