"""Train the MoE byte-level LM on the Python standard library's source, in MXFP8 or BF16.

    python -m train_example.train --precision mxfp8 --steps 200 --device cpu --out runs/mx
    python -m train_example.train --precision mxfp8 --steps 200 --device cpu --out runs/mx --resume

Recipe: fp32 master weights, forward under BF16 autocast (see `train_example.model`), AdamW
(betas 0.9/0.95, weight decay on matrices only), linear warm-up then cosine decay to
``min_lr_ratio * lr``, gradient clipping by global norm. The learning rate is a pure function of
the step, and batch ``s`` is a pure function of ``(seed, s)`` (`train_example.data`), so a run
resumed from a checkpoint continues bit-identically on the same machine (on CPU; GPU kernels
such as atomics-based reductions may not be deterministic).

Outputs in ``--out``: ``log.csv`` (one row per step: step, train_loss, val_loss, tokens_per_s,
lr, aux_loss, grad_norm; val_loss empty between evaluations), ``checkpoint/model.safetensors``
(the model), ``checkpoint/state.pt`` (optimizer, RNG, step, run settings), ``run.json``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from . import data as D
from .model import MoETransformer, lm_loss, model_config

CSV_FIELDS = ("step", "train_loss", "val_loss", "tokens_per_s", "lr", "aux_loss", "grad_norm")
CKPT_DIR = "checkpoint"
MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"


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
    "cpu-tiny": TrainConfig(steps=200, batch_size=16, seq_len=128, lr=1e-3, warmup_steps=30,
                            eval_every=10, eval_batches=8, max_train_bytes=4_000_000,
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m train_example.train",
        description="Train the MXFP8MoE byte-level LM on the Python stdlib source.",
    )
    p.add_argument("--precision", choices=("mxfp8", "bf16"), default="mxfp8")
    p.add_argument("--preset", choices=sorted(TRAIN_PRESETS), default="cpu-tiny")
    p.add_argument("--steps", type=int, default=None, help="default: the preset's")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default=None,
                   help="MXFP8MoE backend; default 'reference' on CPU, 'auto' on CUDA")
    p.add_argument("--wgrad", choices=("mxfp8", "bf16"), default="mxfp8",
                   help="expert weight-gradient GEMMs in MXFP8 (default) or BF16 (mxfp8 only)")
    p.add_argument("--weight-blocks", choices=("1x32", "32x32"), default="1x32",
                   help="expert weight scale blocks of the MXFP8 GEMMs (mxfp8 only)")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--warmup-steps", type=int, default=None)
    p.add_argument("--eval-every", type=int, default=None)
    p.add_argument("--ckpt-every", type=int, default=None,
                   help="checkpoint interval in steps (default: at every evaluation)")
    p.add_argument("--log-every", type=int, default=10, help="progress line interval")
    p.add_argument("--stop-after", type=int, default=None,
                   help="stop after this many steps (of --steps), as if interrupted; "
                        "the LR schedule still spans --steps")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def train_config(args: argparse.Namespace) -> TrainConfig:
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
    if tc.steps < 1 or tc.eval_every < 1:
        raise SystemExit("--steps and --eval-every must be >= 1")
    return tc


def default_backend(device: torch.device) -> str:
    return "reference" if device.type == "cpu" else "auto"


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        # Matrices and expert weights decay; norms and the (tied) embedding do not.
        (decay if p.dim() >= 2 and not name.startswith("embed.") else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


class Progress:
    """A carriage-return progress line on a terminal, plain periodic lines otherwise."""

    def __init__(self, total: int, every: int, quiet: bool):
        self.total, self.every, self.quiet = total, max(1, every), quiet
        self.tty = sys.stdout.isatty()
        self.seconds, self.tokens, self.val = 0.0, 0, None

    def update(self, row: dict, tokens: int) -> None:
        """Show step, train loss, latest validation loss, aux loss, LR, tokens/s (averaged over
        the steps since the last line, evaluation time excluded)."""
        self.tokens += tokens
        if row["val_loss"] is not None:
            self.val = row["val_loss"]
        step = row["step"]
        if self.quiet or (step % self.every and step != self.total):
            return
        tps = self.tokens / max(self.seconds, 1e-9)
        self.seconds, self.tokens = 0.0, 0
        val = "   -   " if self.val is None else f"{self.val:.4f}"
        line = (f"step {step:>6}/{self.total}  loss {row['train_loss']:.4f}  val {val}  "
                f"aux {row['aux_loss']:.4f}  lr {row['lr']:.2e}  {tps:,.0f} tok/s")
        end = "\n" if not self.tty or step == self.total else ""
        print(("\r" + line) if self.tty else line, end=end, flush=True)


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def save_checkpoint(out: Path, model, opt, step: int, settings: dict) -> None:
    from safetensors.torch import save_model

    ckpt = out / CKPT_DIR
    ckpt.mkdir(parents=True, exist_ok=True)
    # save_model drops the tied head's duplicate and records it, so load_model restores the tie.
    _atomic(ckpt / MODEL_FILE,
            lambda p: save_model(model, str(p), metadata={"step": str(step)}))
    state = {
        "step": step,
        "optimizer": opt.state_dict(),
        "rng_cpu": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "settings": settings,
    }
    _atomic(ckpt / STATE_FILE, lambda p: torch.save(state, p))


def _comparable(settings: dict) -> dict:
    train = {k: v for k, v in settings["train"].items() if k != "ckpt_every"}
    return {**settings, "train": train}


def load_checkpoint(out: Path, model, opt, settings: dict) -> int:
    from safetensors import safe_open
    from safetensors.torch import load_model

    ckpt = out / CKPT_DIR
    state = torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=True)
    # The checkpoint interval may change between invocations; nothing else may.
    saved, settings = _comparable(state["settings"]), _comparable(settings)
    diff = {k: (saved.get(k), v) for k, v in settings.items() if saved.get(k) != v}
    if diff:
        raise SystemExit(f"--resume: the checkpoint was made with other settings: {diff}")
    with safe_open(str(ckpt / MODEL_FILE), framework="pt") as f:
        model_step = int(f.metadata()["step"])
    if model_step != state["step"]:
        raise SystemExit(f"--resume: {ckpt} is inconsistent (model step {model_step}, "
                         f"optimizer step {state['step']})")
    missing, unexpected = load_model(model, str(ckpt / MODEL_FILE), strict=True,
                                     device=str(next(model.parameters()).device))
    opt.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng_cpu"])
    if state["rng_cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng_cuda"])
    return state["step"]


def _fmt(x: float | None) -> str:
    return "" if x is None else repr(float(x))


class CsvLog:
    """``log.csv``; on resume, rows past the checkpoint's step are dropped first."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        rows = []
        if resume_step is not None and path.exists():
            with path.open(newline="") as f:
                rows = [r for r in csv.DictReader(f) if int(r["step"]) <= resume_step]
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
        return [{k: (int(v) if k == "step" else (float(v) if v != "" else None))
                 for k, v in r.items()} for r in csv.DictReader(f)]


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


def run(argv: list[str] | None = None) -> list[dict]:
    """Train per the command line ``argv``; returns the log rows of this invocation's steps."""
    args = build_parser().parse_args(argv)
    tc = train_config(args)
    device = torch.device(args.device)
    backend = args.backend or default_backend(device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mc = model_config(args.preset, max_seq_len=max(tc.seq_len,
                                                   model_config(args.preset).max_seq_len))
    settings = {"precision": args.precision, "preset": args.preset, "seed": args.seed,
                "backend": backend, "wgrad": args.wgrad, "weight_blocks": args.weight_blocks,
                "train": asdict(tc),
                "model": mc.to_dict()}
    log = (lambda s: None) if args.quiet else (lambda s: print(s, flush=True))

    t_start = time.perf_counter()
    text = D.load_stdlib_text(args.seed, tc.max_train_bytes, tc.max_val_bytes)
    val = D.val_batches(text, tc.eval_batches, tc.batch_size, tc.seq_len, args.seed)
    log(text.describe())

    torch.manual_seed(args.seed)  # same initial weights for both precisions
    model = MoETransformer(mc, precision=args.precision, backend=backend,
                           wgrad=args.wgrad, weight_blocks=args.weight_blocks).to(device)
    total, active = model.num_parameters()
    log(f"model: preset {args.preset}, {total:,} parameters ({active:,} active per token), "
        f"{mc.n_layers} layers, dim {mc.dim}, {mc.num_experts} experts top-{mc.top_k}, "
        f"hidden {mc.hidden_dim}; precision {args.precision}, backend {backend}, "
        f"device {device}")
    opt = torch.optim.AdamW(_param_groups(model, tc.weight_decay), lr=tc.lr,
                            betas=(tc.beta1, tc.beta2), eps=1e-8)

    start = 0
    if args.resume and (out / CKPT_DIR / STATE_FILE).exists():
        start = load_checkpoint(out, model, opt, settings)
        log(f"resumed from {out / CKPT_DIR} at step {start}")
    elif args.resume:
        log(f"--resume: no checkpoint in {out / CKPT_DIR}; starting from step 0")
    csv_log = CsvLog(out / "log.csv", start if args.resume else None)
    (out / "run.json").write_text(json.dumps(
        {**settings, "device": str(device), "parameters": total, "active_parameters": active},
        indent=2))

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16)

    ckpt_every = tc.ckpt_every or tc.eval_every
    end = tc.steps if args.stop_after is None else min(tc.steps, args.stop_after)
    prog = Progress(tc.steps, args.log_every, args.quiet)
    rows = []
    for step in range(start + 1, end + 1):  # `step` = optimizer steps done after this one
        t0 = time.perf_counter()
        lr = lr_at(step - 1, tc)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = D.train_batch(text, step - 1, tc.batch_size, tc.seq_len, args.seed)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast():
            logits = model(x)
        loss = lm_loss(logits, y)
        aux = model.aux_loss
        (loss + aux).backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_v, aux_v, gnorm_v = loss.item(), aux.item(), gnorm.item()
        if not math.isfinite(loss_v):
            raise FloatingPointError(f"non-finite loss {loss_v} at step {step}")
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
        if step % ckpt_every == 0 or step == end:
            save_checkpoint(out, model, opt, step, settings)
    log(f"done: {end - start} steps in {time.perf_counter() - t_start:.1f} s; log {out}/log.csv")
    return rows


def main(argv: list[str] | None = None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
