"""CPU tests of train_example's edges: existing --out, resume with other settings, damaged
checkpoints, argument validation, Ctrl-C (deferred to a checkpoint, then a one-line hint and a
lossless --resume), the progress line, the plot and its missing-matplotlib hint."""

from __future__ import annotations

import json
import re
import shutil
import signal
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
MICRO = ["--preset", "micro", "--device", "cpu", "--steps", str(STEPS), "--quiet"]
EXACT_FIELDS = ("train_loss", "val_loss", "lr", "aux_loss", "grad_norm")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _exit_line(excinfo) -> str:
    msg = str(excinfo.value.code)
    assert "\n" not in msg, msg
    return msg


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A micro mxfp8 run stopped after step 4 (checkpoint at 4), to copy per test."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    T.run([*MICRO, "--out", str(out), "--stop-after", "4"])
    return out


@pytest.fixture
def run_copy(stopped_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(stopped_run, out)
    return out


# --- an existing --out ----------------------------------------------------------------------


def test_train_refuses_existing_out_without_resume_or_overwrite(run_copy):
    before = (run_copy / "log.csv").read_bytes()
    with pytest.raises(SystemExit) as e:
        T.run([*MICRO, "--out", str(run_copy)])
    msg = _exit_line(e)
    assert str(run_copy) in msg and "--resume" in msg and "--overwrite" in msg
    assert (run_copy / "log.csv").read_bytes() == before  # nothing touched


def test_train_overwrite_starts_over(run_copy):
    rows = T.run([*MICRO, "--out", str(run_copy), "--overwrite", "--stop-after", "2"])
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["step"] for r in T.read_log(run_copy / "log.csv")] == [1, 2]


def test_resume_and_overwrite_exclude_each_other(run_copy, capsys):
    with pytest.raises(SystemExit) as e:
        T.build_parser().parse_args([*MICRO, "--out", str(run_copy), "--resume", "--overwrite"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not allowed with" in err


# --- resume with other settings, damaged checkpoints -----------------------------------------


def test_resume_with_other_settings_names_only_the_differing_fields(run_copy):
    with pytest.raises(SystemExit) as e:
        T.run([*MICRO, "--out", str(run_copy), "--resume", "--steps", "20"])
    msg = _exit_line(e)
    assert "train.steps (checkpoint 12, now 20)" in msg
    # The warm-up follows the length (same fraction), so it differs too; nothing else does.
    fields = re.findall(r"([\w.]+) \(checkpoint ", msg)
    assert fields == ["train.steps", "train.warmup_steps"], msg


def test_resume_with_other_precision(run_copy):
    with pytest.raises(SystemExit) as e:
        T.run([*MICRO, "--out", str(run_copy), "--resume", "--precision", "bf16"])
    assert re.findall(r"([\w.]+) \(checkpoint ", _exit_line(e)) == ["precision"]


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize(
    "damage, name, what",
    [
        (lambda p: p.write_bytes(b""), T.STATE_FILE, "empty (0 bytes)"),
        (_truncate, T.STATE_FILE, "truncated or corrupted"),
        (lambda p: p.write_bytes(b""), T.MODEL_FILE, "empty (0 bytes)"),
        (_truncate, T.MODEL_FILE, "truncated or corrupted"),
        (lambda p: p.write_bytes(b"\x08" + bytes(7) + b"{}garbage"), T.MODEL_FILE,
         "truncated or corrupted"),
        (Path.unlink, T.MODEL_FILE, "missing"),
        (Path.unlink, T.STATE_FILE, "missing"),
    ],
    ids=["state-empty", "state-truncated", "model-empty", "model-truncated", "model-garbage",
         "model-missing", "state-missing"],
)
def test_damaged_checkpoint_is_one_line_naming_the_file(run_copy, damage, name, what):
    path = run_copy / T.CKPT_DIR / name
    damage(path)
    with pytest.raises(SystemExit) as e:
        T.run([*MICRO, "--out", str(run_copy), "--resume"])
    msg = _exit_line(e)
    assert str(path) in msg and what in msg, msg


def test_model_file_records_the_moe_configuration(run_copy):
    from moe_mxfp8 import checkpoint

    path = run_copy / T.CKPT_DIR / T.MODEL_FILE
    configs = checkpoint.read_layer_configs(path)
    assert set(configs) == {"blocks.0.moe"} and configs["blocks.0.moe"]["top_k"] == 2
    assert checkpoint.read_metadata(path)["step"] == "4"


def test_model_file_of_another_moe_configuration_is_refused(run_copy, tmp_path):
    """A model.safetensors swapped for one of another layer configuration (same tensor shapes:
    top_k 1 instead of 2), with a state.pt that agrees with the command line."""
    from moe_mxfp8 import checkpoint
    from train_example.model import MoETransformer, model_config

    other = MoETransformer(model_config("micro", top_k=1), precision="mxfp8",
                           backend="reference")
    path = run_copy / T.CKPT_DIR / T.MODEL_FILE
    checkpoint.save_file(other, path, metadata={"step": "4"})
    with pytest.raises(SystemExit) as e:
        T.run([*MICRO, "--out", str(run_copy), "--resume"])
    msg = _exit_line(e)
    assert str(path) in msg and "top_k=2" in msg and "top_k=1" in msg, msg


def test_checkpoint_of_another_step_pairing_is_refused(run_copy, tmp_path):
    """model.safetensors and state.pt of different steps (a crash between the two writes)."""
    other = tmp_path / "other"
    T.run([*MICRO, "--out", str(other), "--stop-after", "2"])
    shutil.copy(other / T.CKPT_DIR / T.MODEL_FILE, run_copy / T.CKPT_DIR / T.MODEL_FILE)
    with pytest.raises(SystemExit) as e:
        T.run([*MICRO, "--out", str(run_copy), "--resume"])
    assert "of step 2 but state.pt of step 4" in _exit_line(e)


def _corrupt(path: Path, where: int, n: int = 100) -> None:
    """Overwrite ``n`` bytes at ``where`` with 0xFF (NaN in float32 and BF16)."""
    data = bytearray(path.read_bytes())
    data[where:where + n] = b"\xff" * n
    path.write_bytes(bytes(data))


def test_corrupted_model_tensor_data_is_refused(run_copy):
    """100 bytes overwritten inside a parameter's data: a plain load takes NaN parameters
    without a word; the checksum names the file and the tensor."""
    from moe_mxfp8 import checkpoint

    path = run_copy / T.CKPT_DIR / T.MODEL_FILE
    start, end = checkpoint._tensor_ranges(str(path))["blocks.0.moe.w_gate_up"]
    _corrupt(path, (start + end) // 2)
    with pytest.raises(SystemExit) as e:
        T.run([*MICRO, "--out", str(run_copy), "--resume"])
    msg = _exit_line(e)
    assert str(path) in msg and "tensor 'blocks.0.moe.w_gate_up' is corrupted" in msg, msg


def test_corrupted_optimizer_state_is_refused(run_copy):
    """100 bytes overwritten inside the largest tensor of state.pt (torch.load itself reads
    them as they are): its SHA-256, recorded in model.safetensors, tells."""
    import zipfile

    path = run_copy / T.CKPT_DIR / T.STATE_FILE
    with zipfile.ZipFile(path) as z:
        big = max(z.infolist(), key=lambda i: i.file_size)
        member = z.read(big.filename)
    at = path.read_bytes().find(member)
    assert at > 0 and big.file_size > 400
    _corrupt(path, at + big.file_size // 2)
    with pytest.raises(SystemExit) as e:
        T.run([*MICRO, "--out", str(run_copy), "--resume"])
    msg = _exit_line(e)
    assert str(path) in msg and "corrupted: its SHA-256 differs" in msg, msg


def test_checkpoint_without_checksums_still_resumes(run_copy, capsys):
    """A checkpoint written before checksums were recorded resumes, with one warning line per
    unverified file, and the run continues as an uninterrupted one."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from moe_mxfp8 import checkpoint

    path = run_copy / T.CKPT_DIR / T.MODEL_FILE
    with safe_open(str(path), framework="pt") as f:
        meta = {k: v for k, v in f.metadata().items()
                if k not in (checkpoint.CHECKSUMS_KEY, T.STATE_SHA256_KEY)}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(path), metadata=meta)
    with pytest.warns(RuntimeWarning, match="records no tensor checksums"):
        rows = T.run([*MICRO, "--out", str(run_copy), "--resume"])
    assert [r["step"] for r in rows] == list(range(5, STEPS + 1))
    assert f"records no checksum of {T.STATE_FILE}" in capsys.readouterr().err


def test_nonfinite_grad_norm_stops_before_the_optimizer_step(run_copy, monkeypatch):
    """A finite loss with an infinite gradient norm (as a corrupted checkpoint gave: losses of
    1e27-1e35) stops the run with one line, before the optimizer step; the last checkpoint and
    the log stay those of step 4."""
    clip = torch.nn.utils.clip_grad_norm_

    def inf_norm(params, max_norm):
        clip(params, max_norm)
        return torch.tensor(float("inf"))

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", inf_norm)
    steps = []
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a: steps.append(1))
    with pytest.raises(SystemExit) as e:
        T.run([*MICRO, "--out", str(run_copy), "--resume"])
    msg = _exit_line(e)
    assert msg.startswith("error: step 5:") and "gradient norm inf: not finite" in msg, msg
    assert steps == []
    assert [r["step"] for r in T.read_log(run_copy / "log.csv")] == [1, 2, 3, 4]
    from moe_mxfp8 import checkpoint

    assert checkpoint.read_metadata(run_copy / T.CKPT_DIR / T.MODEL_FILE)["step"] == "4"


def test_garbage_lines_in_the_log_are_dropped_on_resume(run_copy, capsys):
    """A line that is not a log row (a crash cut it short, say) is dropped with a warning naming
    the file and the line; the resumed log holds every step once."""
    log = run_copy / "log.csv"
    with log.open("a") as f:
        f.write("garbage,line\n")
        f.write("5,2.5,,1000.0\n")  # cut short
    rows = T.run([*MICRO, "--out", str(run_copy), "--resume"])
    assert [r["step"] for r in rows] == list(range(5, STEPS + 1))
    assert [r["step"] for r in T.read_log(log)] == list(range(1, STEPS + 1))
    err = capsys.readouterr().err
    assert f"{log} line 6: not a log row, dropped" in err and f"{log} line 7" in err, err


# --- argument validation ---------------------------------------------------------------------

BAD_TRAIN_ARGS = [
    (["--batch-size", "0"], "--batch-size: must be >= 1, got 0"),
    (["--batch-size", "x"], "--batch-size: expected an integer"),
    (["--seq-len", "0"], "--seq-len: must be >= 1"),
    (["--steps", "0"], "--steps: must be >= 1"),
    (["--eval-every", "0"], "--eval-every: must be >= 1"),
    (["--log-every", "0"], "--log-every: must be >= 1"),
    (["--stop-after", "0"], "--stop-after: must be >= 1"),
    (["--warmup-steps", "-1"], "--warmup-steps: must be >= 0"),
    (["--ckpt-every", "-1"], "--ckpt-every: must be >= 0"),
    (["--seed", "-1"], "--seed: must be >= 0"),
    (["--lr", "0"], "--lr: must be in (0, inf)"),
    (["--lr", "nan"], "--lr: must be in (0, inf)"),
    (["--device", "tpu"], "--device: expected cpu or cuda[:N]"),
    (["--device", "cuda:x"], "--device: expected cpu or cuda[:N]"),
    (["--backend", "bogus"], "--backend: invalid choice"),
    (["--out", ""], "--out: must name a directory, got an empty path"),
    (["--out", "  "], "--out: must name a directory"),
]


@pytest.mark.parametrize("extra, expected", BAD_TRAIN_ARGS, ids=lambda v: " ".join(v)
                         if isinstance(v, list) else None)
def test_bad_train_argument_is_one_usage_line(tmp_path, capsys, extra, expected):
    out = tmp_path / "never"
    with pytest.raises(SystemExit) as e:
        T.run([*MICRO, "--out", str(out), *extra])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err
    assert not out.exists()  # refused before anything was written


def test_warmup_longer_than_the_run_is_refused(tmp_path):
    for extra, steps in ((["--warmup-steps", "13"], STEPS), (["--steps", "3", "--warmup-steps",
                                                              "4"], 3)):
        with pytest.raises(SystemExit) as e:
            T.run([*MICRO, "--out", str(tmp_path / "x"), *extra])
        msg = _exit_line(e)
        assert f"is more than the run's {steps} steps" in msg, msg
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("where", ["/proc/moe_mxfp8_run", "below-a-file"])
def test_unwritable_out_is_one_line(tmp_path, where):
    if where == "below-a-file":
        (tmp_path / "f").write_text("")
        where = str(tmp_path / "f" / "run")
    with pytest.raises(SystemExit) as e:
        T.run([*MICRO, "--out", where])
    msg = _exit_line(e)
    assert msg.startswith(f"error: --out {where} is not a writable directory"), msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("backend", ["sm90", "sm100"])
def test_kernel_backend_without_a_gpu_is_one_line_up_front(tmp_path, backend):
    out = tmp_path / "x"
    with pytest.raises(SystemExit) as e:
        T.run([*MICRO, "--out", str(out), "--backend", backend])
    msg = _exit_line(e)
    assert f"--backend {backend} cannot run here" in msg and "needs CUDA" in msg, msg
    assert not out.exists()


def test_scale_blocks_with_bf16_warns_once(tmp_path, capsys):
    T.run([*MICRO, "--out", str(tmp_path / "x"), "--precision", "bf16", "--scale-blocks",
           "1x128", "--stop-after", "1"])
    err = capsys.readouterr().err
    assert err.count("--scale-blocks 1x128 applies to --precision mxfp8 only") == 1, err


def test_seq_len_longer_than_the_data_is_refused(tmp_path):
    with pytest.raises(SystemExit) as e:
        T.run([*MICRO, "--out", str(tmp_path / "x"), "--seq-len", "100000"])
    assert "--seq-len 100000 does not fit" in _exit_line(e)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_a_gpu_is_one_usage_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        T.run([*MICRO, "--out", str(tmp_path / "x"), "--device", "cuda"])
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no CUDA GPU" in err and "--device cpu" in err


@pytest.mark.parametrize("extra, expected", [
    (["--final-tol", "0"], "--final-tol: must be in (0, inf)"),
    (["--curve-tol", "-1"], "--curve-tol: must be in (0, inf)"),
    (["--ema-beta", "1"], "--ema-beta: must be in [0, 1)"),
    (["--bf16-repeat", "-1"], "--bf16-repeat: must be >= 0"),
    (["--batch-size", "0"], "unrecognized arguments"),  # parity has no --batch-size
    (["--steps", "0"], "--steps: must be >= 1"),
])
def test_bad_parity_argument_is_one_usage_line(tmp_path, capsys, extra, expected):
    with pytest.raises(SystemExit) as e:
        parity.main([*MICRO, "--out", str(tmp_path / "never"), *extra])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err


# --- the progress line -----------------------------------------------------------------------


def _screen(text: str) -> list[str]:
    """What a terminal shows for ``text``: ``\\r`` returns to column 0 and overwrites."""
    lines, cur, col = [], [], 0
    for ch in text:
        if ch == "\n":
            lines.append("".join(cur))
            cur, col = [], 0
        elif ch == "\r":
            col = 0
        else:
            if col < len(cur):
                cur[col] = ch
            else:
                cur.append(ch)
            col += 1
    return lines + (["".join(cur)] if cur else [])


def test_progress_line_clears_stale_characters_and_shows_eta(capsys):
    prog = T.Progress(total=3, start=0, end=3, every=1, quiet=False, tty=True)
    rows = [{"step": s, "train_loss": 1.0, "val_loss": None, "aux_loss": 0.01, "lr": 1e-3}
            for s in (1, 2, 3)]
    prog.seconds = 1.0
    prog.update(rows[0], tokens=12_345_678)  # a long tok/s figure
    first = capsys.readouterr().out
    assert first.startswith("\r") and "ETA " in first and "\n" not in first
    prog.seconds = 1.0
    prog.update(rows[1], tokens=1)  # a shorter line over the longer one
    second = capsys.readouterr().out
    assert second.startswith("\r") and len(second) == len(first)  # padded over the first
    assert _screen(first + second) == [second[1:]]
    assert re.search(r"  1 tok/s  ETA \d+:\d\d$", _screen(first + second)[0].rstrip())
    prog.seconds = 1.0
    prog.update(rows[2], tokens=1)
    third = capsys.readouterr().out
    assert third.endswith("\n") and "took " in third  # the last line ends the \r line
    assert [ln.rstrip() for ln in _screen(first + second + third)] == [third[1:-1].rstrip()]


def test_progress_eta_counts_only_this_invocations_steps(capsys):
    prog = T.Progress(total=20, start=10, end=20, every=1, quiet=False, tty=False)
    prog.t0 -= 10.0  # steps 11 and 12 took 10 s in all: 5 s a step, 8 steps left
    prog.seconds = 1.0
    prog.update({"step": 12, "train_loss": 1.0, "val_loss": 2.0, "aux_loss": 0.0, "lr": 1e-3},
                tokens=10)
    assert capsys.readouterr().out.rstrip().endswith("ETA 0:40")


def test_fmt_duration():
    assert [T.fmt_duration(s) for s in (0, 59.6, 61, 3599, 3600, 7322)] == [
        "0:00", "1:00", "1:01", "59:59", "1:00:00", "2:02:02"]


# --- parity: existing --out, Ctrl-C and --resume, plot ---------------------------------------


@pytest.fixture(scope="module")
def parity_done(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity") / "p"
    rc = parity.main([*MICRO, "--out", str(out)])
    assert rc in (0, 1)
    return out


def _logs(out: Path) -> dict[str, list[dict]]:
    return {p: [{k: r[k] for k in ("step", *EXACT_FIELDS)} for r in T.read_log(out / p / "log.csv")]
            for p in parity.PRECISIONS}


def test_parity_refuses_existing_out(parity_done, capsys):
    before = (parity_done / "summary.json").read_bytes()
    with pytest.raises(SystemExit) as e:
        parity.main([*MICRO, "--out", str(parity_done)])
    msg = _exit_line(e)
    assert "already holds a comparison" in msg and "--resume" in msg and "--overwrite" in msg
    assert (parity_done / "summary.json").read_bytes() == before


def test_parity_resume_with_other_settings_names_the_fields(parity_done):
    before = (parity_done / "bf16" / "log.csv").read_bytes()
    with pytest.raises(SystemExit) as e:
        parity.main([*MICRO, "--out", str(parity_done), "--resume", "--seed", "3"])
    assert re.findall(r"([\w.]+) \(checkpoint ", _exit_line(e)) == ["seed"]
    assert (parity_done / "bf16" / "log.csv").read_bytes() == before


def test_parity_ctrl_c_gives_one_line_hint_and_resume_loses_nothing(parity_done, tmp_path,
                                                                     monkeypatch, capsys):
    """A real SIGINT in the middle of the MXFP8 run (step 5: not a checkpoint step, those are
    every 4): the step finishes, is checkpointed, one line says how to continue; --resume then
    ends with exactly the logs of an uninterrupted comparison."""
    calls = {"n": 0}
    real_batch = T.D.train_batch

    def batch_then_ctrl_c(*a, **k):
        calls["n"] += 1
        if calls["n"] == STEPS + 5:  # BF16 did STEPS batches; this is MXFP8's 5th
            signal.raise_signal(signal.SIGINT)
        return real_batch(*a, **k)

    monkeypatch.setattr(T.D, "train_batch", batch_then_ctrl_c)
    handler = signal.getsignal(signal.SIGINT)
    out = tmp_path / "p"
    argv = [*MICRO, "--out", str(out)]
    assert parity.main(argv) == T.EXIT_INTERRUPTED
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "after step 5/12 of the mxfp8" in err
    assert err.endswith("python -m train_example.parity " + " ".join(argv) + " --resume"), err
    assert signal.getsignal(signal.SIGINT) is handler  # restored
    assert [r["step"] for r in T.read_log(out / "mxfp8" / "log.csv")] == [1, 2, 3, 4, 5]

    monkeypatch.setattr(T.D, "train_batch", real_batch)
    rc = parity.main([*argv, "--resume"])
    assert rc in (0, 1)
    assert _logs(out) == _logs(parity_done)
    done = json.loads((parity_done / "summary.json").read_text())
    resumed = json.loads((out / "summary.json").read_text())
    assert resumed["final"] == done["final"] and resumed["curve"] == done["curve"]
    assert resumed["resumed"] is True


def test_train_ctrl_c_hint(tmp_path, monkeypatch, capsys):
    real_batch = T.D.train_batch

    def batch(data, step, *a, **k):
        if step == 2:  # the third step
            signal.raise_signal(signal.SIGINT)
        return real_batch(data, step, *a, **k)

    monkeypatch.setattr(T.D, "train_batch", batch)
    argv = [*MICRO, "--out", str(tmp_path / "r")]
    assert T.main(argv) == T.EXIT_INTERRUPTED
    err = capsys.readouterr().err.strip()
    assert err == ("interrupted after step 3/12, checkpoint saved; continue with: "
                   "python -m train_example.train " + " ".join(argv) + " --resume")
    assert T.resume_command("train_example.train", ["--out", "o", "--overwrite"]) == (
        "python -m train_example.train --out o --resume")


def test_parity_overwrite_and_missing_matplotlib_hint(parity_done, tmp_path, monkeypatch,
                                                      capsys):
    out = tmp_path / "p"
    shutil.copytree(parity_done, out)
    (out / "loss.png").unlink()
    (out / "summary.json").unlink()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    # --resume of two finished runs trains nothing; the comparison is redone from the logs.
    assert parity.main([*MICRO, "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install '.[plot]'" in err, err
    assert (out / "summary.json").exists() and (out / "loss.csv").exists()
    assert not (out / "loss.png").exists()
    monkeypatch.undo()  # matplotlib back
    rows = T.run([*MICRO, "--out", str(out / "bf16"), "--resume", "--precision", "bf16"])
    assert rows == []  # the finished run stays finished

    (out / "bf16_repeat1").mkdir()  # left by an earlier --bf16-repeat comparison
    assert parity.main([*MICRO, "--out", str(out), "--overwrite", "--steps", "2"]) in (0, 1)
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    assert [r["step"] for r in T.read_log(out / "mxfp8" / "log.csv")] == [1, 2]
    assert not (out / "bf16_repeat1").exists()


def test_loss_plot_shows_the_verdict_the_exit_code_follows(parity_done):
    """With BF16 repeats the title leads with the within-noise verdict (the exit code's), then
    the single-run one; the repeats are drawn in the validation and difference panels, and a
    widened tolerance as its own lines."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    logs = {p: T.read_log(parity_done / p / "log.csv") for p in parity.PRECISIONS}
    args = parity.build_parser().parse_args([*MICRO, "--out", "x"])
    rows, verdict = parity.compare(logs, STEPS, 2, args)
    assert parity.headline(verdict) in ("PASS", "FAIL")  # no repeats: the single-run verdict
    # the MXFP8 run standing in for a BF16 repeat: its noise is the MXFP8-vs-BF16 difference,
    # so the within-noise verdict passes whatever the single-run one says
    noise, reps = parity.noise_verdict(logs["bf16"], [logs["mxfp8"]], STEPS, 2, args, verdict)
    verdict.update(noise)
    line = parity.headline(verdict)
    assert line.startswith("within BF16 run-to-run noise (1 repeat): PASS"), line
    assert f"(single-run criteria: {'PASS' if verdict['pass'] else 'FAIL'})" in line
    fig = parity.figure(rows, verdict, line, reps)
    try:
        _, ax_val, ax_diff = fig.axes
        assert "bf16 repeats" in [ln.get_label() for ln in ax_val.get_lines()]
        assert any(ln.get_label().startswith("bf16 repeat") for ln in ax_diff.get_lines())
    finally:
        plt.close(fig)


def test_loss_plot_keeps_both_curves_visible(parity_done):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    logs = {p: T.read_log(parity_done / p / "log.csv") for p in parity.PRECISIONS}
    args = parity.build_parser().parse_args([*MICRO, "--out", "x"])
    rows, verdict = parity.compare(logs, STEPS, 2, args)
    fig = parity.figure(rows, verdict, "t")
    try:
        ax_train, ax_val, _ = fig.axes
        for ax in (ax_train, ax_val):
            lines = {ln.get_label(): ln for ln in ax.get_lines()}
            bf = next(v for k, v in lines.items() if k.startswith("bf16"))
            mx = next(v for k, v in lines.items() if k.startswith("mxfp8"))
            # BF16 drawn above MXFP8, dashed and narrower: MXFP8 shows through its gaps.
            assert bf.get_zorder() > mx.get_zorder()
            assert bf.get_linestyle() == "--" and mx.get_linestyle() == "-"
            assert bf.get_linewidth() < mx.get_linewidth()
            assert bf.get_color() != mx.get_color()
    finally:
        plt.close(fig)
    png = parity_done / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_real_ctrl_c_of_the_command(tmp_path):
    """The command itself, in a subprocess, gets a real SIGINT mid-run: exit code 130, one line
    on stderr (no traceback), and the log ends at the checkpointed step."""
    import os
    import subprocess

    out = tmp_path / "r"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "train_example.train", "--preset", "micro", "--steps", "1000",
         "--log-every", "1", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        for line in proc.stdout:  # wait until training runs
            if line.startswith("step"):
                break
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == T.EXIT_INTERRUPTED, err
    err_lines = [ln for ln in err.splitlines() if "RuntimeWarning" not in ln and ln.strip()
                 and not ln.startswith("  ")]  # (a backend fallback warning may come first)
    assert len(err_lines) == 1 and err_lines[0].startswith("interrupted after step"), err
    assert "Traceback" not in err and err_lines[0].endswith(" --resume")
    step = int(re.search(r"after step (\d+)/1000", err_lines[0]).group(1))
    assert T.read_log(out / "log.csv")[-1]["step"] == step
    from moe_mxfp8 import checkpoint

    assert checkpoint.read_metadata(out / T.CKPT_DIR / T.MODEL_FILE)["step"] == str(step)
