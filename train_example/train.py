"""Train the MoE byte-level LM on the Python standard library's source, in MXFP8 or BF16.

    python -m train_example.train --precision mxfp8 --steps 200 --device cpu --out runs/mx
    python -m train_example.train --precision mxfp8 --steps 200 --device cpu --out runs/mx --resume

An ``--out`` that already holds a run is refused unless ``--resume`` or ``--overwrite`` is given.
Ctrl-C finishes the current step, saves a checkpoint and prints the command that continues.

Recipe: fp32 master weights, forward under BF16 autocast (see `train_example.model`), AdamW
(betas 0.9/0.95, weight decay on matrices only), linear warm-up then cosine decay to
``min_lr_ratio * lr``, gradient clipping by global norm. The learning rate is a pure function of
the step, and batch ``s`` is a pure function of ``(seed, s)`` (`train_example.data`), so a run
resumed from a checkpoint continues bit-identically on the same machine (on CPU; GPU kernels
such as atomics-based reductions may not be deterministic).

Outputs in ``--out``: ``log.csv`` (one row per step: step, train_loss, val_loss, tokens_per_s,
lr, aux_loss, grad_norm; val_loss empty between evaluations), ``checkpoint/model.safetensors``
(the model, each tensor's SHA-256, and the SHA-256 of ``state.pt``), ``checkpoint/state.pt``
(optimizer, RNG, step, run settings), ``run.json``. A resume verifies both files' checksums.

A step whose loss or gradient norm is not finite stops the run with one line before its
optimizer step (the parameters and the last checkpoint stay as they were).

``--compile`` (default ``auto``: ``reduce-overhead`` on a GPU, ``none`` on the CPU) runs the
model's forward and backward through ``torch.compile`` with CUDA-graph replays (the optimizer,
the gradient clipping and the evaluations stay eager): a small model on a GPU is bound by the
host time of launching its kernels (about 5 ms a step for each eager `MXFP8MoE` layer, more
than its GPU time at the ``gpu`` preset), and a replay removes that cost -- at the ``gpu``
preset 2.2x the eager MXFP8 step's throughput, and MXFP8 then 1.06x BF16's instead of 0.81x
(H100, 2026-11-27, benchmarks/RESULTS.md "Training parity"). ``default`` compiles without
graphs. The resolved mode is a run setting: a resume keeps it.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import importlib.util
import json
import math
import os
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from moe_mxfp8.backend import AUTO, BACKENDS, KERNEL_BACKENDS, resolve_backend
from moe_mxfp8.config import PRECISIONS, WGRAD_MODES
from moe_mxfp8.reference import SCALE_BLOCKS

from . import data as D
from .model import MoETransformer, lm_loss, model_config

CSV_FIELDS = ("step", "train_loss", "val_loss", "tokens_per_s", "lr", "aux_loss", "grad_norm")
CKPT_DIR = "checkpoint"
MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
STATE_SHA256_KEY = "state_sha256"  # model.safetensors metadata: SHA-256 of its state.pt
# What a run writes into --out: an --out holding any of these is an existing run, which only
# --resume (continue it) or --overwrite (delete these, start over) may touch.
RUN_FILES = ("log.csv", "run.json", CKPT_DIR)
# torch.compile modes of --compile ("none": eager; "auto": `resolve_compile`)
COMPILE_MODES = ("auto", "none", "default", "reduce-overhead")
# Settings added after runs were checkpointed without them: an absent one is its value here.
SETTING_DEFAULTS = {"compile": "none"}
EXIT_INTERRUPTED = 130  # the shell's code for a process stopped by SIGINT


@dataclass(frozen=True)
class TrainConfig:
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup_steps: int
    eval_every: int
    eval_batches: int
    max_train_bytes: int
    max_val_bytes: int
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.95
    ckpt_every: int = 0  # 0: at every evaluation


TRAIN_PRESETS: dict[str, TrainConfig] = {
    "micro": TrainConfig(steps=12, batch_size=4, seq_len=32, lr=3e-3, warmup_steps=2,
                         eval_every=4, eval_batches=1, max_train_bytes=200_000,
                         max_val_bytes=20_000),
    # Peak LR 1e-3 (not 2e-3): at 2e-3 the two precisions' final validation losses differed by
    # 0.9-1.3% on seeds 0 and 1 (batch 8 and 16, both signs, run-to-run-sized), at 1e-3 by
    # -0.19% (seed 0) and +0.47% (seed 1). See train_example/README.md, "Measured".
    # 150 steps and 4 validation batches (200 and 8 before): README's main job in a few minutes
    # on 2 cores (measured in train_example/README.md).
    "cpu-tiny": TrainConfig(steps=150, batch_size=16, seq_len=128, lr=1e-3, warmup_steps=20,
                            eval_every=10, eval_batches=4, max_train_bytes=4_000_000,
                            max_val_bytes=400_000),
    "gpu": TrainConfig(steps=1000, batch_size=16, seq_len=1024, lr=6e-4, warmup_steps=100,
                       eval_every=25, eval_batches=8, max_train_bytes=64_000_000,
                       max_val_bytes=2_000_000,
                       # 245M params + AdamW state is ~3 GB a checkpoint: not every evaluation.
                       ckpt_every=500),
}


def lr_at(step: int, tc: TrainConfig) -> float:
    """LR used for optimizer step ``step`` (0-based): linear warm-up, then cosine to the floor."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    span = max(1, tc.steps - tc.warmup_steps)
    progress = min(1.0, (step - tc.warmup_steps) / span)
    floor = tc.lr * tc.min_lr_ratio
    return floor + 0.5 * (tc.lr - floor) * (1.0 + math.cos(math.pi * progress))


def int_at_least(lo: int):
    """argparse ``type=``: an int >= ``lo`` (a bad value is argparse's one-line usage error)."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v

    return parse


def float_in(lo: float, hi: float = math.inf, *, lo_open: bool = True, hi_open: bool = True):
    """argparse ``type=``: a finite float in the interval (``lo``, ``hi``) (ends per flags)."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        below = v <= lo if lo_open else v < lo
        above = v >= hi if hi_open else v > hi
        if not math.isfinite(v) or below or above:
            lb, rb = "(" if lo_open else "[", ")" if hi_open else "]"
            raise argparse.ArgumentTypeError(f"must be in {lb}{lo:g}, {hi:g}{rb}, got {text}")
        return v

    return parse


def device_arg(text: str) -> torch.device:
    """argparse ``type=``: ``cpu`` or ``cuda[:N]`` of a GPU that exists."""
    try:
        dev = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"expected cpu or cuda[:N], got {text!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu or cuda[:N], got {text!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError("no CUDA GPU is visible to torch; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"{text}: only {torch.cuda.device_count()} CUDA device(s)")
    return dev


def out_arg(text: str) -> str:
    """argparse ``type=``: a directory path (an empty one would mean the current directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must name a directory, got an empty path")
    return text


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error (argparse's own repeats the whole usage block first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m train_example.train",
        description="Train the MXFP8MoE byte-level LM on the Python stdlib source.",
    )
    pos, nonneg = int_at_least(1), int_at_least(0)
    p.add_argument("--precision", choices=PRECISIONS, default="mxfp8")
    p.add_argument("--preset", choices=sorted(TRAIN_PRESETS), default="cpu-tiny")
    p.add_argument("--steps", type=pos, default=None, help="default: the preset's")
    p.add_argument("--device", type=device_arg, default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--out", type=out_arg, required=True, help="output directory")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true",
                      help="continue the run in OUT from its checkpoint")
    mode.add_argument("--overwrite", action="store_true",
                      help="delete the run already in OUT (log.csv, run.json, checkpoint/) and "
                           "start over; without --resume or --overwrite an existing run is "
                           "refused")
    p.add_argument("--seed", type=nonneg, default=0)
    p.add_argument("--backend", choices=BACKENDS, default=None,
                   help="MXFP8MoE backend; default 'reference' on CPU, 'auto' on CUDA")
    p.add_argument("--wgrad", choices=WGRAD_MODES, default="mxfp8",
                   help="expert weight-gradient GEMMs in MXFP8 (default) or BF16 (mxfp8 only)")
    p.add_argument("--scale-blocks", "--weight-blocks", dest="scale_blocks",
                   choices=(AUTO, *SCALE_BLOCKS), default=AUTO,
                   help="scale blocks of the MXFP8 expert GEMMs (mxfp8 only): auto (default: "
                        "the device's recipe, moe_mxfp8.backend.auto_scale_blocks), "
                        "1x32 (exact MXFP8), 32x32 (32x32 weight tiles) or 1x128 (the 1x128 "
                        "recipe); --weight-blocks is its older name")
    p.add_argument("--batch-size", type=pos, default=None)
    p.add_argument("--seq-len", type=pos, default=None)
    p.add_argument("--lr", type=float_in(0.0), default=None)
    p.add_argument("--warmup-steps", type=nonneg, default=None)
    p.add_argument("--eval-every", type=pos, default=None)
    p.add_argument("--ckpt-every", type=nonneg, default=None,
                   help="checkpoint interval in steps (default, or 0: at every evaluation)")
    p.add_argument("--log-every", type=pos, default=10, help="progress line interval")
    p.add_argument("--stop-after", type=pos, default=None,
                   help="stop after this many steps (of --steps), as if interrupted; "
                        "the LR schedule still spans --steps")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--deterministic", action="store_true",
                   help="PyTorch's deterministic algorithms, strict (attention's backward "
                        "included), and cuBLAS's fixed workspace: a rerun with the same seed "
                        "gives the same bits on the same GPU")
    p.add_argument("--compile", choices=COMPILE_MODES, default="auto",
                   help="torch.compile the model's forward and backward: reduce-overhead "
                        "replays them as CUDA graphs (no per-step launch cost), default "
                        "compiles without graphs, none runs eagerly; auto (default): "
                        "reduce-overhead on a GPU, none on the CPU")
    return p


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The preset's `TrainConfig` with the command line's overrides (validated by the parser)."""
    tc = TRAIN_PRESETS[args.preset]
    over = {
        "steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
        "lr": args.lr, "warmup_steps": args.warmup_steps, "eval_every": args.eval_every,
        "ckpt_every": args.ckpt_every,
    }
    tc = replace(tc, **{k: v for k, v in over.items() if v is not None})
    if args.steps is not None and args.warmup_steps is None:
        # Keep the preset's warm-up fraction when only the length changes.
        frac = TRAIN_PRESETS[args.preset].warmup_steps / TRAIN_PRESETS[args.preset].steps
        tc = replace(tc, warmup_steps=max(1, round(frac * tc.steps)))
    if tc.warmup_steps > tc.steps:
        raise SystemExit(f"error: --warmup-steps {tc.warmup_steps} is more than the run's "
                         f"{tc.steps} steps (the learning rate would never reach its peak)")
    if tc.seq_len + 1 >= min(tc.max_train_bytes, tc.max_val_bytes):
        raise SystemExit(f"error: --seq-len {tc.seq_len} does not fit the preset's data "
                         f"({min(tc.max_train_bytes, tc.max_val_bytes)} bytes)")
    return tc


def default_backend(device: torch.device) -> str:
    return "reference" if device.type == "cpu" else "auto"


def check_backend(backend: str, device: torch.device) -> None:
    """A kernel backend that cannot run on ``device`` is one line before anything runs (not a
    traceback from the first step)."""
    if backend in KERNEL_BACKENDS:
        try:
            resolve_backend(backend, device)
        except RuntimeError as e:
            raise SystemExit(f"error: --backend {backend} cannot run here: {e}") from None


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        # Matrices and expert weights decay; norms and the (tied) embedding do not.
        (decay if p.dim() >= 2 and not name.startswith("embed.") else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def fmt_duration(seconds: float) -> str:
    """``m:ss`` (``h:mm:ss`` from an hour on)."""
    s = max(0, round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


class Progress:
    """A carriage-return progress line on a terminal, plain periodic lines otherwise.

    Each line shows the step, train loss, latest validation loss, aux loss, LR, tokens/s
    (averaged over the steps since the last line, evaluation excluded) and the time left for
    this invocation's steps (from their average wall time so far, evaluation and checkpoints
    included). A shorter line is padded with spaces over the longer one it replaces.
    """

    def __init__(self, total: int, start: int, end: int, every: int, quiet: bool,
                 label: str = "", tty: bool | None = None):
        self.total, self.start, self.end = total, start, end
        self.every, self.quiet, self.label = max(1, every), quiet, label
        self.tty = sys.stdout.isatty() if tty is None else tty
        self.seconds, self.tokens, self.val = 0.0, 0, None
        self.t0 = time.perf_counter()
        self.width = 0  # length of the carriage-return line on screen (0: none open)

    def update(self, row: dict, tokens: int) -> None:
        self.tokens += tokens
        if row["val_loss"] is not None:
            self.val = row["val_loss"]
        step = row["step"]
        if self.quiet or (step % self.every and step != self.end):
            return
        tps = self.tokens / max(self.seconds, 1e-9)
        self.seconds, self.tokens = 0.0, 0
        elapsed = time.perf_counter() - self.t0
        if step < self.end:
            left = elapsed / (step - self.start) * (self.end - step)
            when = f"ETA {fmt_duration(left)}"
        else:
            when = f"took {fmt_duration(elapsed)}"
        val = "   -   " if self.val is None else f"{self.val:.4f}"
        line = (f"{self.label}step {step:>6}/{self.total}  loss {row['train_loss']:.4f}  "
                f"val {val}  aux {row['aux_loss']:.4f}  lr {row['lr']:.2e}  "
                f"{tps:,.0f} tok/s  {when}")
        if not self.tty:
            print(line, flush=True)
            return
        pad = " " * max(0, self.width - len(line))  # blank what a longer line left behind
        self.width = len(line)
        print("\r" + line + pad, end="", flush=True)
        if step == self.end:
            self.close()

    def close(self) -> None:
        """End an open carriage-return line (before other output, or at the end)."""
        if self.width:
            print(flush=True)
            self.width = 0


class NonFiniteStep(SystemExit):
    """A step whose loss or gradient norm is not finite: the run stops with one line before
    that step's optimizer update (parameters and the last checkpoint unchanged)."""

    def __init__(self, step: int, loss: float, grad_norm: float):
        super().__init__(f"error: step {step}: loss {loss}, gradient norm {grad_norm}: not "
                         "finite; stopped before its optimizer step (the parameters and the "
                         "last checkpoint are unchanged)")


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during training, after the current step finished and was checkpointed."""

    def __init__(self, step: int, total: int):
        super().__init__(f"interrupted after step {step}/{total}")
        self.step, self.total = step, total


class DeferInterrupt:
    """While active (main thread only), a first Ctrl-C only sets `requested`: the training loop
    finishes its step, saves a checkpoint and raises `Interrupted`, so nothing is lost. A
    second Ctrl-C raises `KeyboardInterrupt` at once (the last checkpoint is then kept)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def _handler(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> DeferInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None


def resume_command(module: str, argv: list[str]) -> str:
    """The command line that continues ``argv``'s run: ``--overwrite`` out, ``--resume`` in."""
    args = [a for a in argv if a != "--overwrite"]
    if "--resume" not in args:
        args.append("--resume")
    return f"python -m {module} {shlex.join(args)}"


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def save_model_file(model: torch.nn.Module, path: Path, metadata: dict[str, str]) -> None:
    """The model's parameters as safetensors, with string ``metadata`` and (by
    `moe_mxfp8.checkpoint`) every MXFP8MoE layer's configuration, checked on load."""
    from moe_mxfp8 import checkpoint

    # Like safetensors' save_model, the tied head's duplicate is dropped and recorded, so
    # loading restores the tie.
    checkpoint.save_file(model, path, metadata=metadata)


def load_model_file(model: torch.nn.Module, path: Path) -> None:
    """Load `save_model_file`'s file into ``model`` (strict: every parameter, nothing else, and
    the same MXFP8MoE configuration)."""
    from moe_mxfp8 import checkpoint

    checkpoint.load_file(model, path, strict=True, device=next(model.parameters()).device)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def save_checkpoint(out: Path, model, opt, step: int, settings: dict) -> None:
    """``state.pt`` first, then ``model.safetensors`` recording its SHA-256 (and, through
    `moe_mxfp8.checkpoint`, each tensor's): a resume detects damaged bytes in either file."""
    ckpt = out / CKPT_DIR
    ckpt.mkdir(parents=True, exist_ok=True)
    state = {
        "step": step,
        "optimizer": opt.state_dict(),
        "rng_cpu": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "settings": settings,
    }
    _atomic(ckpt / STATE_FILE, lambda p: torch.save(state, p))
    meta = {"step": str(step), "settings": json.dumps(settings, sort_keys=True),
            STATE_SHA256_KEY: file_sha256(ckpt / STATE_FILE)}
    _atomic(ckpt / MODEL_FILE, lambda p: save_model_file(model, p, meta))


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def settings_diff(saved: dict, now: dict) -> list[str]:
    """The settings that differ, as ``"train.steps (checkpoint 200, now 400)"``. The checkpoint
    interval may change between invocations; nothing else may."""
    a, b = _flatten({**SETTING_DEFAULTS, **saved}), _flatten(now)
    missing = "(absent)"
    return [f"{k} (checkpoint {a.get(k, missing)!r}, now {b.get(k, missing)!r})"
            for k in sorted(a.keys() | b.keys())
            if k != "train.ckpt_every" and a.get(k, missing) != b.get(k, missing)]


class CheckpointError(SystemExit):
    """A checkpoint that cannot be resumed from: one line naming the file and what is wrong."""

    def __init__(self, path: Path, what: str):
        super().__init__(f"error: cannot resume from {path}: {what} (start over with --overwrite "
                         f"instead of --resume)")


def _unreadable(path: Path, e: BaseException, kind: str) -> CheckpointError:
    if path.stat().st_size == 0:
        return CheckpointError(path, "the file is empty (0 bytes)")
    detail = (str(e).strip().splitlines() or [""])[0][:200]
    return CheckpointError(path, f"not a readable {kind} file, truncated or corrupted "
                                 f"({type(e).__name__}: {detail})")


def checkpoint_files(out: Path) -> list[Path]:
    """The checkpoint files present in ``out``."""
    return [p for p in (out / CKPT_DIR / MODEL_FILE, out / CKPT_DIR / STATE_FILE) if p.exists()]


def load_checkpoint(out: Path, model, opt, settings: dict) -> int:
    """Restore model, optimizer and RNG from ``out``'s checkpoint; return its step. Any problem
    (a missing or corrupted file, other settings) is a one-line `SystemExit`."""
    from safetensors import safe_open

    ckpt = out / CKPT_DIR
    model_path, state_path = ckpt / MODEL_FILE, ckpt / STATE_FILE
    for path in (model_path, state_path):
        if not path.exists():
            other = state_path if path == model_path else model_path
            raise CheckpointError(path, f"the file is missing ({other.name} is there)")
    try:
        state = torch.load(state_path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- whatever torch.load raises, one line
        raise _unreadable(state_path, e, "torch.save") from None
    keys = ("step", "optimizer", "rng_cpu", "rng_cuda", "settings")
    if not isinstance(state, dict) or any(k not in state for k in keys):
        raise CheckpointError(state_path, f"not a train_example state (needs keys {keys})")
    diff = settings_diff(state["settings"], settings)
    if diff:
        raise SystemExit(f"error: --resume: {ckpt} was made with other settings: "
                         f"{'; '.join(diff)}. Resume with the same settings, or start over "
                         f"with --overwrite")
    try:
        with safe_open(str(model_path), framework="pt") as f:
            model_meta = f.metadata() or {}
        model_step = int(model_meta.get("step", -1))
    except Exception as e:  # noqa: BLE001 -- safetensors' header errors, one line
        raise _unreadable(model_path, e, "safetensors") from None
    if model_step != state["step"]:
        raise CheckpointError(ckpt, f"{MODEL_FILE} is of step {model_step} but {STATE_FILE} "
                                    f"of step {state['step']}")
    want = model_meta.get(STATE_SHA256_KEY)
    if want is None:
        print(f"warning: {model_path} records no checksum of {STATE_FILE} (an older "
              f"checkpoint); {STATE_FILE} is loaded unverified", file=sys.stderr, flush=True)
    elif file_sha256(state_path) != want:
        raise CheckpointError(state_path, f"corrupted: its SHA-256 differs from the one "
                                          f"{MODEL_FILE} recorded when both were saved")
    try:
        load_model_file(model, model_path)
    except ValueError as e:  # moe_mxfp8.checkpoint: another layer configuration
        what = (str(e).splitlines() or [""])[0].removeprefix(f"checkpoint {model_path}: ")
        raise CheckpointError(model_path, what) from None
    except Exception as e:  # noqa: BLE001 -- missing/unexpected/mis-shaped tensors
        raise _unreadable(model_path, e, "model") from None
    try:
        opt.load_state_dict(state["optimizer"])
    except Exception as e:  # noqa: BLE001
        raise _unreadable(state_path, e, "optimizer state") from None
    torch.set_rng_state(state["rng_cpu"])
    if state["rng_cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng_cuda"])
    return state["step"]


def prepare_out(out: Path, resume: bool, overwrite: bool) -> None:
    """Refuse an ``out`` that already holds a run unless asked to resume or overwrite it, and
    one that cannot be created or written to (one line, before anything in it changes)."""
    present = [name for name in RUN_FILES if (out / name).exists()]
    if present and not (resume or overwrite):
        raise SystemExit(f"error: {out} already holds a run ({', '.join(present)}): pass "
                         f"--resume to continue it or --overwrite to start over")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise SystemExit(f"error: --out {out} is not a writable directory "
                         f"({e.strerror or type(e).__name__})") from None
    if overwrite:
        for name in present:
            path = out / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def _fmt(x: float | None) -> str:
    return "" if x is None else repr(float(x))


def parse_log_row(r: dict) -> dict:
    """A ``log.csv`` row (csv.DictReader's dict) as ``step`` int and floats (``None`` where
    empty); ValueError for a line that is not such a row (a missing, extra or bad field)."""
    if None in r or set(r) != set(CSV_FIELDS) or None in r.values():
        raise ValueError(f"expected the {len(CSV_FIELDS)} fields {', '.join(CSV_FIELDS)}")
    return {k: (int(v) if k == "step" else (float(v) if v != "" else None))
            for k, v in r.items()}


class CsvLog:
    """``log.csv``; on resume, rows past the checkpoint's step are dropped first, and so are
    lines that are not log rows (a line cut short by a crash, say), each with a warning."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        rows = []
        if resume_step is not None and path.exists():
            with path.open(newline="") as f:
                reader = csv.DictReader(f)
                for r in reader:
                    try:
                        step = parse_log_row(r)["step"]
                    except ValueError as e:
                        print(f"warning: {path} line {reader.line_num}: not a log row, dropped "
                              f"({e})", file=sys.stderr, flush=True)
                        continue
                    if step <= resume_step:
                        rows.append(r)
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, CSV_FIELDS)
            w.writeheader()
            w.writerows(rows)

    def append(self, row: dict) -> None:
        with self.path.open("a", newline="") as f:
            csv.DictWriter(f, CSV_FIELDS).writerow({k: _fmt(row.get(k)) if k != "step"
                                                    else row[k] for k in CSV_FIELDS})


def read_log(path: Path) -> list[dict]:
    """``log.csv`` as dicts of floats (``None`` where empty), ``step`` as int."""
    with Path(path).open(newline="") as f:
        return [parse_log_row(r) for r in csv.DictReader(f)]


@torch.no_grad()
def evaluate(model, batches, device, autocast) -> float:
    model.eval()
    total = 0.0
    for x, y in batches:
        with autocast():
            logits = model(x.to(device))
        total += lm_loss(logits, y.to(device)).item()
    model.train()
    return total / len(batches)


def resolve_compile(mode: str, device: torch.device) -> str:
    """``--compile auto``: CUDA-graph replays on a GPU (where an eager step of a small model is
    bound by launching its kernels) when Triton is there for inductor, else eager; eager on
    the CPU (where inductor's compile costs more than a short run gains); any other mode as
    given."""
    if mode != "auto":
        return mode
    if device.type != "cuda":
        return "none"
    if importlib.util.find_spec("triton") is None:  # inductor's GPU code generator
        print("note: --compile auto runs eagerly: Triton is not installed (pip install triton)",
              file=sys.stderr, flush=True)
        return "none"
    return "reduce-overhead"


def compiled(model: torch.nn.Module, mode: str):
    """The callable a training step runs: ``model`` itself (``mode`` "none") or
    ``torch.compile(model, mode=...)`` -- the same module and parameters, so checkpoints, the
    optimizer and the eager evaluations see no difference."""
    if mode == "none":
        return model
    return torch.compile(model, mode=None if mode == "default" else mode)


def set_deterministic() -> None:
    """Same seed, same GPU -> same bits: PyTorch's deterministic algorithms in their strict mode
    and a fixed cuBLAS workspace (set before the first GEMM creates cuBLAS's). Strict, because
    with ``warn_only=True`` flash attention's backward keeps its atomics-based dQ accumulation
    (memory-efficient attention its split-key sums) and only warns: at the GPU preset that left
    two same-seed BF16 runs several percent apart. Strict, both take their deterministic kernels,
    and an op without one stops the run with an error naming it (`tools/determinism_bisect.py`
    compares two runs' losses and gradients step by step). MXFP8MoE's data path and GEMMs are
    deterministic either way."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def run(argv: list[str] | None = None, *, label: str = "") -> list[dict]:
    """Train per the command line ``argv``; returns the log rows of this invocation's steps.

    ``label`` prefixes the progress lines. Ctrl-C finishes the current step, saves a checkpoint
    and raises `Interrupted` (see `DeferInterrupt`); bad arguments, an existing run without
    --resume/--overwrite and unusable checkpoints are one-line `SystemExit` errors, raised
    before anything in ``--out`` changes.
    """
    args = build_parser().parse_args(argv)
    tc = train_config(args)
    device = torch.device(args.device)
    args.compile = resolve_compile(args.compile, device)
    if args.deterministic:
        set_deterministic()
    backend = args.backend or default_backend(device)
    if args.precision == "mxfp8":
        check_backend(backend, device)
    elif args.scale_blocks != build_parser().get_default("scale_blocks"):
        print(f"warning: --scale-blocks {args.scale_blocks} applies to --precision mxfp8 only; "
              "this bf16 run ignores it", file=sys.stderr, flush=True)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise SystemExit(f"error: --out {out} is a file, not a directory")
    mc = model_config(args.preset, max_seq_len=max(tc.seq_len,
                                                   model_config(args.preset).max_seq_len))
    settings = {"precision": args.precision, "preset": args.preset, "seed": args.seed,
                "backend": backend, "wgrad": args.wgrad, "scale_blocks": args.scale_blocks,
                "compile": args.compile, "train": asdict(tc),
                "model": mc.to_dict()}
    log = (lambda s: None) if args.quiet else (lambda s: print(s, flush=True))
    prepare_out(out, args.resume, args.overwrite)

    t_start = time.perf_counter()
    text = D.load_stdlib_text(args.seed, tc.max_train_bytes, tc.max_val_bytes)
    val = D.val_batches(text, tc.eval_batches, tc.batch_size, tc.seq_len, args.seed)
    log(text.describe())

    torch.manual_seed(args.seed)  # same initial weights for both precisions
    model = MoETransformer(mc, precision=args.precision, backend=backend,
                           wgrad=args.wgrad, scale_blocks=args.scale_blocks).to(device)
    total, active = model.num_parameters()
    log(f"model: preset {args.preset}, {total:,} parameters ({active:,} active per token), "
        f"{mc.n_layers} layers, dim {mc.dim}, {mc.num_experts} experts top-{mc.top_k}, "
        f"hidden {mc.hidden_dim}; precision {args.precision}, backend {backend}, "
        f"device {device}, compile {args.compile}")
    step_model = compiled(model, args.compile)
    opt = torch.optim.AdamW(_param_groups(model, tc.weight_decay), lr=tc.lr,
                            betas=(tc.beta1, tc.beta2), eps=1e-8)

    start = 0
    if args.resume and checkpoint_files(out):
        start = load_checkpoint(out, model, opt, settings)
        log(f"resumed from {out / CKPT_DIR} at step {start}")
    elif args.resume:
        log(f"--resume: no checkpoint in {out / CKPT_DIR}; starting from step 0")
    csv_log = CsvLog(out / "log.csv", start if args.resume else None)
    moes = [b.moe for b in model.blocks if args.precision == "mxfp8"]
    (out / "run.json").write_text(json.dumps(
        {**settings, "device": str(device), "parameters": total, "active_parameters": active,
         "scale_blocks_resolved": moes[0].resolved_scale_blocks() if moes else None},
        indent=2))

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16)

    ckpt_every = tc.ckpt_every or tc.eval_every
    end = tc.steps if args.stop_after is None else min(tc.steps, args.stop_after)
    prog = Progress(tc.steps, start, end, args.log_every, args.quiet, label)
    rows = []
    with DeferInterrupt() as stop:
        try:
            for step in range(start + 1, end + 1):  # `step`: optimizer steps done after it
                t0 = time.perf_counter()
                lr = lr_at(step - 1, tc)
                for g in opt.param_groups:
                    g["lr"] = lr
                x, y = D.train_batch(text, step - 1, tc.batch_size, tc.seq_len, args.seed)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                if args.compile == "reduce-overhead":
                    # a new training step: the previous replay's outputs may be overwritten
                    torch.compiler.cudagraph_mark_step_begin()
                with autocast():
                    logits = step_model(x)
                loss = lm_loss(logits, y)
                aux = model.aux_loss
                (loss + aux).backward()
                gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
                loss_v, aux_v, gnorm_v = loss.item(), aux.item(), gnorm.item()
                if not (math.isfinite(loss_v) and math.isfinite(gnorm_v)):
                    raise NonFiniteStep(step, loss_v, gnorm_v)
                opt.step()
                opt.zero_grad(set_to_none=True)
                tokens, seconds = x.numel(), time.perf_counter() - t0
                prog.seconds += seconds
                row = {"step": step, "train_loss": loss_v, "val_loss": None,
                       "tokens_per_s": tokens / seconds, "lr": lr, "aux_loss": aux_v,
                       "grad_norm": gnorm_v}
                if step % tc.eval_every == 0 or step == tc.steps:
                    row["val_loss"] = evaluate(model, val, device, autocast)
                prog.update(row, tokens)
                csv_log.append(row)
                rows.append(row)
                if step % ckpt_every == 0 or step == end or stop.requested:
                    save_checkpoint(out, model, opt, step, settings)
                if stop.requested:
                    raise Interrupted(step, tc.steps)
        finally:
            prog.close()
    log(f"done: {max(0, end - start)} steps in {time.perf_counter() - t_start:.1f} s; "
        f"log {out}/log.csv")
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        run(argv)
    except KeyboardInterrupt as e:
        what = (f"interrupted after step {e.step}/{e.total}, checkpoint saved"
                if isinstance(e, Interrupted) else "interrupted; the last checkpoint is kept")
        print(f"{what}; continue with: {resume_command('train_example.train', argv)}",
              file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
