"""CPU smoke test of train_example: both precisions learn, resume is bit-identical, the parity
script writes its files. Uses the "micro" preset (a few seconds per run)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # from a checkout without `pip install`
    sys.path.insert(0, str(ROOT))

from train_example import parity  # noqa: E402
from train_example import train as T  # noqa: E402

STEPS = 12
# Compared exactly between an uninterrupted and a resumed run (tokens_per_s is a timing).
EXACT_FIELDS = ("train_loss", "val_loss", "lr", "aux_loss", "grad_norm")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _train(out: Path, *extra: str) -> list[dict]:
    T.run(["--preset", "micro", "--device", "cpu", "--steps", str(STEPS), "--out", str(out),
           "--quiet", *extra])
    return T.read_log(out / "log.csv")


@pytest.fixture(scope="module")
def parity_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity")
    rc = parity.main(["--preset", "micro", "--steps", str(STEPS), "--device", "cpu",
                      "--out", str(out), "--quiet"])
    return out, rc


def test_parity_writes_files(parity_run):
    out, rc = parity_run
    assert rc in (0, 1)  # PASS/FAIL is not asserted for a 12-step toy run
    for name in ("loss.csv", "loss.png", "summary.json"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["pass"] == (rc == 0)
    assert summary["preset"] == "micro" and summary["steps"] == STEPS
    assert set(summary["final_val_loss"]) == {"bf16", "mxfp8"}
    assert set(summary["step_time_s"]) == {"bf16", "mxfp8"}
    assert all(0 < v < summary["wall_time_s"][p] for p, v in summary["step_time_s"].items())
    lines = (out / "loss.csv").read_text().splitlines()
    assert lines[0].split(",") == list(parity.LOSS_FIELDS)
    assert len(lines) == 1 + STEPS


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_loss_falls(parity_run, precision):
    rows = T.read_log(parity_run[0] / precision / "log.csv")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    first = sum(r["train_loss"] for r in rows[:3]) / 3
    last = sum(r["train_loss"] for r in rows[-3:]) / 3
    assert last < first - 0.2, (first, last)
    vals = [r["val_loss"] for r in rows if r["val_loss"] is not None]
    assert len(vals) >= 2 and vals[-1] < vals[0], vals
    assert all(r["aux_loss"] > 0 for r in rows)


def test_same_batches_and_schedule_for_both_precisions(parity_run):
    b, m = (T.read_log(parity_run[0] / p / "log.csv") for p in ("bf16", "mxfp8"))
    assert [r["lr"] for r in b] == [r["lr"] for r in m]
    # Same initial weights and batch: the first losses differ only by the GEMM precision.
    assert abs(b[0]["train_loss"] - m[0]["train_loss"]) < 0.01


def test_resume_is_bit_identical(tmp_path):
    full = _train(tmp_path / "full", "--precision", "mxfp8")

    # Interrupted after step 4 (checkpoint at 4), then after step 6, then a crash that loses
    # the step-6 checkpoint: resuming from step 4 must drop logged steps 5-6 and redo them.
    part = tmp_path / "part"
    _train(part, "--precision", "mxfp8", "--stop-after", "4")
    saved = tmp_path / "ckpt4"
    shutil.copytree(part / T.CKPT_DIR, saved)
    _train(part, "--precision", "mxfp8", "--resume", "--stop-after", "6")
    assert T.read_log(part / "log.csv")[-1]["step"] == 6
    shutil.rmtree(part / T.CKPT_DIR)
    shutil.copytree(saved, part / T.CKPT_DIR)
    resumed = _train(part, "--precision", "mxfp8", "--resume")

    assert [r["step"] for r in resumed] == [r["step"] for r in full]
    for a, b in zip(full, resumed, strict=True):
        for k in EXACT_FIELDS:
            assert a[k] == b[k], (a["step"], k, a[k], b[k])


def test_resume_refuses_other_settings(tmp_path):
    _train(tmp_path, "--precision", "bf16", "--stop-after", "2")
    with pytest.raises(SystemExit, match="other settings"):
        _train(tmp_path, "--precision", "mxfp8", "--resume")


def test_compile_option_trains_and_is_a_run_setting(tmp_path):
    """``--compile default`` trains through torch.compile (inductor on the CPU; the GPU runs
    replay CUDA graphs with ``reduce-overhead``), compiling once: the loss falls as eagerly; the
    mode is a setting of the run, so a resume with another mode is refused and one with the
    same mode continues."""
    torch._dynamo.reset()
    # compiled once: no step (nor the eager evaluations between steps) makes Dynamo recompile
    with torch._dynamo.config.patch(error_on_recompile=True):
        rows = _train(tmp_path, "--precision", "mxfp8", "--compile", "default",
                      "--stop-after", "6")
    assert all(torch.isfinite(torch.tensor(r["train_loss"])) for r in rows)
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    assert json.loads((tmp_path / "run.json").read_text())["compile"] == "default"
    with pytest.raises(SystemExit, match="other settings.*compile"):
        _train(tmp_path, "--precision", "mxfp8", "--resume")
    resumed = _train(tmp_path, "--precision", "mxfp8", "--compile", "default", "--resume")
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))  # the whole log


def test_checkpoints_without_the_compile_setting_resume_eagerly():
    """Runs checkpointed before ``--compile`` existed hold no such setting: it reads as "none"."""
    saved = {"precision": "mxfp8", "train": {"steps": 10}}
    assert T.settings_diff(saved, {**saved, "compile": "none"}) == []
    assert T.settings_diff(saved, {**saved, "compile": "reduce-overhead"}) == [
        "compile (checkpoint 'none', now 'reduce-overhead')"]


def test_compile_auto_resolves_per_device(monkeypatch, capsys):
    """auto: graphs on a GPU with Triton, eager on the CPU and on a GPU without Triton (one
    note, not an inductor error at the first step); an explicit mode is kept as given."""
    import importlib.util

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert T.resolve_compile("auto", cpu) == "none"
    assert T.resolve_compile("default", cpu) == "default"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "triton" else real(name, *a))
    assert T.resolve_compile("auto", cuda) == "reduce-overhead"
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else real(name, *a))
    assert T.resolve_compile("auto", cuda) == "none"
    assert "Triton is not installed" in capsys.readouterr().err
    assert T.resolve_compile("none", cuda) == "none"


def test_parity_passes_the_compile_mode_to_every_run(tmp_path, monkeypatch):
    seen = []

    def fake_run(argv, label=""):
        seen.append(argv)
        raise KeyboardInterrupt  # stop after the first run's command line

    monkeypatch.setattr(T, "run", fake_run)
    parity.main(["--preset", "micro", "--device", "cpu", "--out", str(tmp_path / "p"),
                 "--compile", "reduce-overhead", "--quiet"])
    assert seen and seen[0][seen[0].index("--compile") + 1] == "reduce-overhead"


def test_wgrad_option_reaches_every_moe_layer():
    from train_example.model import MoETransformer, model_config

    cfg = model_config("micro")
    m = MoETransformer(cfg, precision="mxfp8", backend="reference", wgrad="bf16")
    assert [b.moe.wgrad for b in m.blocks] == ["bf16"] * cfg.n_layers
    twin = MoETransformer(cfg, precision="bf16", backend="reference", wgrad="bf16")
    assert set(twin.state_dict()) == set(m.state_dict())


@pytest.mark.parametrize("flag, value", [("--scale-blocks", "1x128"),
                                         ("--weight-blocks", "32x32")])
def test_scale_blocks_option_reaches_every_moe_layer(flag, value):
    """``--scale-blocks`` (``--weight-blocks``, its older name) picks the recipe of every
    MXFP8 layer; the checkpoint names stay those of the BF16 twin."""
    from train_example.model import MoETransformer, model_config
    from train_example.train import build_parser

    args = build_parser().parse_args(["--out", "x", flag, value])
    cfg = model_config("micro")
    m = MoETransformer(cfg, precision="mxfp8", backend="reference",
                       scale_blocks=args.scale_blocks)
    assert [b.moe.scale_blocks for b in m.blocks] == [value] * cfg.n_layers
    twin = MoETransformer(cfg, precision="bf16", backend="reference")
    assert set(twin.state_dict()) == set(m.state_dict())


def test_deterministic_flag(tmp_path, monkeypatch):
    """--deterministic switches PyTorch's deterministic algorithms on in their strict mode (with
    warn_only, flash attention's backward keeps its atomics on the GPU) and cuBLAS's fixed
    workspace; two same-seed runs give the same bits: every logged value and every parameter and
    optimizer state of the final checkpoint (the GPU check is tools/determinism_bisect.py)."""
    from safetensors.torch import load_file

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        a = _train(tmp_path / "a", "--precision", "bf16", "--deterministic")
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        b = _train(tmp_path / "b", "--precision", "bf16", "--deterministic")
    finally:
        torch.use_deterministic_algorithms(False)
    assert [{f: r[f] for f in EXACT_FIELDS} for r in a] == [{f: r[f] for f in EXACT_FIELDS}
                                                             for r in b]
    ckpt = [tmp_path / d / T.CKPT_DIR for d in ("a", "b")]
    wa, wb = (load_file(str(c / T.MODEL_FILE)) for c in ckpt)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    sa, sb = (torch.load(c / T.STATE_FILE, weights_only=True)["optimizer"]["state"] for c in ckpt)
    assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


def test_lm_loss_is_cross_entropy():
    from train_example.model import lm_loss

    logits = torch.randn(2, 5, 256, dtype=torch.bfloat16)
    t = torch.randint(256, (2, 5))
    ref = torch.nn.functional.cross_entropy(logits.float().view(-1, 256), t.view(-1))
    torch.testing.assert_close(lm_loss(logits, t), ref, rtol=1e-6, atol=1e-6)


def test_train_1x128_recipe_steps(tmp_path):
    """The 1x128 recipe trains end to end (reference backend on the CPU) and its loss falls."""
    rows = _train(tmp_path, "--precision", "mxfp8", "--scale-blocks", "1x128")
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]


def test_parity_bf16_repeat_measures_run_to_run_noise(tmp_path):
    """--bf16-repeat trains BF16 again with the same seed; on the CPU that is bit-reproducible,
    so the measured noise is exactly 0 and the widened tolerances equal the given ones."""
    out = tmp_path / "p"
    rc = parity.main(["--preset", "micro", "--steps", str(STEPS), "--device", "cpu",
                      "--out", str(out), "--quiet", "--bf16-repeat", "1"])
    summary = json.loads((out / "summary.json").read_text())
    noise = summary["bf16_noise"]
    assert noise["repeats"] == 1 and noise["final_rel_diff"] == [0.0]
    assert noise["max_abs_rel_diff_curve"] == [0.0]
    w = summary["within_bf16_noise"]
    assert w["final_tolerance"] == 0.01 and w["curve_tolerance"] == 0.03
    assert w["pass"] == summary["pass"] and rc == (0 if w["pass"] else 1)
    def losses(d):  # (tokens_per_s is wall-clock and differs)
        return [{k: v for k, v in r.items() if k != "tokens_per_s"}
                for r in T.read_log(out / d / "log.csv")]

    assert losses("bf16_repeat1") == losses("bf16")
