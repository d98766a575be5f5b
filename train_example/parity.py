"""MXFP8 vs BF16 loss parity: train both from the same seed on the same batches, compare.

    python -m train_example.parity --device cpu --out runs/parity          # cpu-tiny preset
    python -m train_example.parity --device cuda --preset gpu --out runs/parity-gpu

Writes to ``--out``: ``bf16/`` and ``mxfp8/`` (each run's log.csv, checkpoint), ``loss.csv``
(both curves side by side), ``loss.png`` (train and validation curves and their relative
difference, the BF16 repeats' too; its title leads with the verdict the exit code follows),
``summary.json``; prints one verdict line. Exit code 0 on PASS, 1 on FAIL, 2 when the
plot cannot be drawn (matplotlib missing; the CSV and summary are written first), 130 on Ctrl-C.

An ``--out`` holding an earlier comparison is refused unless ``--resume`` (continue it: finished
runs are kept, an interrupted one continues from its checkpoint) or ``--overwrite`` (delete it).
Ctrl-C finishes the current step, checkpoints it and prints the command that continues.

Criteria (relative difference ``r = (mxfp8 - bf16) / bf16``):

1. **final**: the mean validation loss over the evaluations in the last 10% of steps, MXFP8 within
   ``--final-tol`` (1%) of BF16.
2. **curve**: after warm-up, ``|r| <= --curve-tol`` (3%) at every step, for the smoothed train
   curves and for the validation curves. The train curves are smoothed with a bias-corrected
   exponential moving average, ``m_t = b m_{t-1} + (1 - b) loss_t``, ``ema_t = m_t / (1 - b^t)``,
   ``b = --ema-beta`` (0.9: about a 10-step window), per precision, before ``r`` is taken.
   Both precisions see identical batches, so batch-to-batch noise is common to the two curves;
   the EMA removes the remaining step-level jitter.

``--bf16-repeat N`` also trains BF16 N more times with the same seed and batches and measures
how far BF16 lands from itself (GPU kernels with atomics -- index_put/index_add in the MoE's
permutation backward, cuBLAS -- are not bit-reproducible, and the difference grows over a
run). Measured on an H100 at the ``gpu`` preset (2026-11-22): two BF16 runs 5.9% apart in
final validation loss (0.8016 vs 0.8491), separating after step ~550 -- more than the 1%
criterion. The summary's ``within_bf16_noise`` verdict then widens both tolerances to the
measured BF16-vs-BF16 differences, and the exit code follows it.

**The protocol** (``--seeds N``, N >= 2): BF16 and each MXFP8 recipe of ``--recipes`` (e.g.
``1x32,1x128``; default: ``--scale-blocks``' value) are trained with seeds ``--seed`` ...
``--seed + N - 1`` (each seed its own data order and initial weights, the same for every
precision), into ``seed<S>/bf16/`` and ``seed<S>/mxfp8-<recipe>/``. Per recipe it reports the
mean, standard deviation and range over the seeds of the final validation loss (as in criterion
1) and of the EMA train loss averaged over the steps after warm-up; the paired relative
differences to BF16 (per seed, ``(mxfp8 - bf16) / bf16``), their mean and its 95% t-interval
(Student's t over the N paired differences). Verdict per recipe: the MXFP8 mean final loss
within ``--final-tol`` (1%) of BF16's mean, **and** the interval includes 0 or lies within
``+---ci-tol`` (0.5%). ``loss.png`` shows each precision's mean curve with its seeds' min-max
band; ``loss.csv`` the bands per step; ``summary.json`` the numbers under ``protocol``. Exit code
0 when every recipe passes. ``--only-seed S`` trains one seed's runs and stops (several processes,
e.g. one per GPU; a later ``--resume`` without it keeps the finished runs and compares).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

from moe_mxfp8.backend import AUTO, BACKENDS
from moe_mxfp8.config import PRECISIONS as LAYER_PRECISIONS
from moe_mxfp8.config import WGRAD_MODES
from moe_mxfp8.reference import SCALE_BLOCKS

from . import train as T

PRECISIONS = tuple(reversed(LAYER_PRECISIONS))  # the runs, in order: the BF16 baseline first
LOSS_FIELDS = (
    "step", "lr",
    "bf16_train", "mxfp8_train", "bf16_train_ema", "mxfp8_train_ema", "train_ema_rel_diff",
    "bf16_val", "mxfp8_val", "val_rel_diff",
)


def build_parser() -> argparse.ArgumentParser:
    p = T.Parser(
        prog="python -m train_example.parity",
        description="Train BF16 and MXFP8 from the same seed and data; compare loss curves.",
    )
    pos, nonneg = T.int_at_least(1), T.int_at_least(0)
    p.add_argument("--preset", choices=sorted(T.TRAIN_PRESETS), default="cpu-tiny")
    p.add_argument("--steps", type=pos, default=None, help="default: the preset's")
    p.add_argument("--device", type=T.device_arg, default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--out", required=True)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true",
                      help="continue an interrupted comparison in OUT (runs already finished "
                           "are kept)")
    mode.add_argument("--overwrite", action="store_true",
                      help="delete the comparison already in OUT and start over; without "
                           "--resume or --overwrite an existing one is refused")
    p.add_argument("--seed", type=nonneg, default=0)
    p.add_argument("--wgrad", choices=WGRAD_MODES, default=None,
                   help="MXFP8 run's weight-gradient GEMMs (default mxfp8)")
    p.add_argument("--scale-blocks", "--weight-blocks", dest="scale_blocks",
                   choices=(AUTO, *SCALE_BLOCKS), default=None,
                   help="MXFP8 run's scale blocks: auto (default: the device's recipe, "
                        "moe_mxfp8.backend.auto_scale_blocks), 1x32 (exact MXFP8), 32x32 or "
                        "1x128 (--weight-blocks is its older name)")
    p.add_argument("--seeds", type=T.int_at_least(2), default=None,
                   help="the protocol: train every precision with this many seeds (from --seed) "
                        "and judge the mean and the paired differences' confidence interval")
    p.add_argument("--recipes", type=recipe_list, default=None,
                   help="with --seeds: comma-separated MXFP8 recipes to compare with BF16, e.g. "
                        "1x32,1x128 (default: --scale-blocks)")
    p.add_argument("--ci-tol", type=T.float_in(0.0), default=0.005,
                   help="with --seeds: a 95%% interval of the paired differences that excludes "
                        "0 must lie within +-this (default 0.005)")
    p.add_argument("--only-seed", type=nonneg, default=None,
                   help="with --seeds: train only this seed's runs and stop (parallel processes; "
                        "--resume without it then compares)")
    p.add_argument("--backend", choices=BACKENDS, default=None,
                   help="MXFP8MoE backend; default 'reference' on CPU, 'auto' on CUDA")
    p.add_argument("--eval-every", type=pos, default=None)
    p.add_argument("--final-tol", type=T.float_in(0.0), default=0.01)
    p.add_argument("--curve-tol", type=T.float_in(0.0), default=0.03)
    p.add_argument("--ema-beta", type=T.float_in(0.0, 1.0, lo_open=False), default=0.9)
    p.add_argument("--log-every", type=pos, default=20)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--deterministic", action="store_true",
                   help="every run with PyTorch's deterministic algorithms (a BF16 repeat then "
                        "measures 0 run-to-run spread where the GPU allows it)")
    p.add_argument("--compile", choices=T.COMPILE_MODES, default="auto",
                   help="torch.compile mode of every run (train_example.train --compile; "
                        "auto: CUDA-graph replays on a GPU, eager on the CPU)")
    p.add_argument("--bf16-repeat", type=nonneg, default=0,
                   help="train BF16 this many more times (same seed) to measure its run-to-run "
                        "noise; the verdict then allows that much difference")
    return p


def recipe_list(text: str) -> list[str]:
    """argparse ``type=``: comma-separated scale-block recipes, each once."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    allowed = (AUTO, *SCALE_BLOCKS)
    bad = [n for n in names if n not in allowed]
    if not names or bad or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"expected distinct recipes of {allowed} separated by commas, got {text!r}")
    return names


def existing_outputs(out: Path) -> list[Path]:
    """What an earlier comparison left in ``out``."""
    if not out.is_dir():
        return []
    fixed = [out / n for n in (*PRECISIONS, "loss.csv", "loss.png", "summary.json")]
    return ([p for p in fixed if p.exists()] + sorted(out.glob("bf16_repeat*"))
            + sorted(p for p in out.glob("seed*") if p.is_dir()))


def ema(values: list[float], beta: float) -> list[float]:
    """Bias-corrected exponential moving average (the first value is not damped toward 0)."""
    out, m = [], 0.0
    for t, v in enumerate(values, start=1):
        m = beta * m + (1.0 - beta) * v
        out.append(m / (1.0 - beta**t))
    return out


def val_tail(log: list[dict], steps: int) -> list[dict]:
    """The rows of ``log`` holding the evaluations in the last 10% of the ``steps``."""
    tail_from = steps - max(1, math.ceil(0.1 * steps))
    return [r for r in log if r["step"] > tail_from and r["val_loss"] is not None]


def final_val(log: list[dict], steps: int) -> float:
    """Criterion 1's final loss: the mean validation loss over the last 10% of steps."""
    tail = val_tail(log, steps)
    return sum(r["val_loss"] for r in tail) / len(tail)


def rel(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else (a - b) / b


def compare(logs: dict[str, list[dict]], steps: int, warmup: int, args) -> tuple[list[dict], dict]:
    """Merge the two runs' logs into loss.csv rows and evaluate the criteria."""
    b, m = logs["bf16"], logs["mxfp8"]
    if [r["step"] for r in b] != [r["step"] for r in m] or len(b) != steps:
        raise RuntimeError("the two runs did not log the same steps")
    ema_b = ema([r["train_loss"] for r in b], args.ema_beta)
    ema_m = ema([r["train_loss"] for r in m], args.ema_beta)
    rows = []
    for i, (rb, rm) in enumerate(zip(b, m, strict=True)):
        rows.append({
            "step": rb["step"], "lr": rb["lr"],
            "bf16_train": rb["train_loss"], "mxfp8_train": rm["train_loss"],
            "bf16_train_ema": ema_b[i], "mxfp8_train_ema": ema_m[i],
            "train_ema_rel_diff": rel(ema_m[i], ema_b[i]),
            "bf16_val": rb["val_loss"], "mxfp8_val": rm["val_loss"],
            "val_rel_diff": rel(rm["val_loss"], rb["val_loss"]),
        })

    final_b, final_m = final_val(b, steps), final_val(m, steps)
    final_rel = rel(final_m, final_b)

    after = [r for r in rows if r["step"] > warmup]
    train_max = max(abs(r["train_ema_rel_diff"]) for r in after)
    val_diffs = [abs(r["val_rel_diff"]) for r in after if r["val_rel_diff"] is not None]
    val_max = max(val_diffs) if val_diffs else 0.0
    final_ok = abs(final_rel) <= args.final_tol
    curve_ok = max(train_max, val_max) <= args.curve_tol
    verdict = {
        "pass": final_ok and curve_ok,
        "final": {
            "pass": final_ok, "tolerance": args.final_tol, "rel_diff": final_rel,
            "bf16_mean_val_loss": final_b, "mxfp8_mean_val_loss": final_m,
            "steps": [r["step"] for r in val_tail(b, steps)],
        },
        "curve": {
            "pass": curve_ok, "tolerance": args.curve_tol, "after_step": warmup,
            "max_abs_rel_diff_train_ema": train_max, "max_abs_rel_diff_val": val_max,
            "ema_beta": args.ema_beta,
        },
    }
    return rows, verdict


def write_loss_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, LOSS_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r[k] is None else r[k]) for k in LOSS_FIELDS})


PLOT_HINT = ("the parity plot needs matplotlib, which is not installed: pip install '.[plot]' "
             "in the repository (or pip install matplotlib)")
# Both curves must stay visible where they overlap (they mostly do): MXFP8 is drawn first, solid
# and wide; BF16 on top of it, dashed and narrower, so MXFP8 shows through BF16's gaps.
CURVE_STYLE = {
    "mxfp8": {"color": "tab:red", "ls": "-", "lw": 2.2, "alpha": 0.85, "zorder": 2},
    "bf16": {"color": "tab:blue", "ls": "--", "lw": 1.3, "alpha": 1.0, "zorder": 3},
}
MARKERS = {"mxfp8": "o", "bf16": "x"}
DRAW_ORDER = tuple(reversed(PRECISIONS))  # the BF16 baseline last: drawn on top


def figure(rows: list[dict], verdict: dict, title: str, repeats: list[list[dict]] = ()):
    """The parity figure: train curves (raw and EMA), validation curves, relative difference.
    ``repeats``: `compare` rows of each BF16 repeat against the first BF16 run (their ``mxfp8_*``
    fields hold the repeat), drawn thin and gray with the tolerance the repeats widened."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    vrows = [r for r in rows if r["bf16_val"] is not None]
    vsteps = [r["step"] for r in vrows]
    fig, (ax_t, ax_v, ax_d) = plt.subplots(3, 1, figsize=(9, 11), sharex=True)
    for p in DRAW_ORDER:
        st = CURVE_STYLE[p]
        ax_t.plot(steps, [r[f"{p}_train"] for r in rows], color=st["color"], alpha=0.2, lw=0.7,
                  zorder=1)
        ax_t.plot(steps, [r[f"{p}_train_ema"] for r in rows], **st,
                  label=f"{p} (EMA {verdict['curve']['ema_beta']})")
        ax_v.plot(vsteps, [r[f"{p}_val"] for r in vrows], **st, marker=MARKERS[p], ms=4,
                  label=p)
    for i, rep in enumerate(repeats, start=1):
        rv = [r for r in rep if r["mxfp8_val"] is not None]
        kw = {"color": "gray", "lw": 0.9, "alpha": 0.8, "zorder": 1}
        ax_v.plot([r["step"] for r in rv], [r["mxfp8_val"] for r in rv], ls=":", **kw,
                  label="bf16 repeats" if i == 1 else None)
        ax_d.plot([r["step"] for r in rv], [100 * r["val_rel_diff"] for r in rv], ls=":", **kw,
                  label="bf16 repeat - bf16 (validation)" if i == 1 else None)
    ax_t.set_ylabel("train loss (nats/byte)")
    ax_t.set_title(title)
    ax_v.set_ylabel("validation loss (nats/byte)")
    ax_d.plot(steps, [100 * r["train_ema_rel_diff"] for r in rows], color="tab:purple",
              label="train (EMA)")
    ax_d.plot(vsteps, [100 * r["val_rel_diff"] for r in vrows], color="tab:green",
              marker=".", label="validation")
    tol = 100 * verdict["curve"]["tolerance"]
    for y in (-tol, tol):
        ax_d.axhline(y, color="gray", ls="--", lw=0.8)
    if "within_bf16_noise" in verdict:
        wide = 100 * verdict["within_bf16_noise"]["curve_tolerance"]
        if wide > tol:
            for y in (-wide, wide):
                ax_d.axhline(y, color="tab:orange", ls="--", lw=0.8)
    ax_d.axhline(0, color="black", lw=0.5)
    ax_d.set_ylabel("(mxfp8 - bf16) / bf16  [%]")
    ax_d.set_xlabel("step")
    warm = verdict["curve"]["after_step"]
    for ax in (ax_t, ax_v, ax_d):
        ax.axvline(warm, color="gray", ls=":", lw=0.8)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    return fig


def plot(path: Path, rows: list[dict], verdict: dict, title: str,
         repeats: list[list[dict]] = ()) -> None:
    """Write `figure` to ``path``; RuntimeError (`PLOT_HINT`) without matplotlib."""
    plot_figure(path, lambda: figure(rows, verdict, title, repeats))


def plot_figure(path: Path, make) -> None:
    """Write the figure ``make()`` draws to ``path``; RuntimeError (`PLOT_HINT`) without
    matplotlib."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise RuntimeError(PLOT_HINT) from e
    import matplotlib.pyplot as plt

    fig = make()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def headline(v: dict) -> str:
    """The plot's verdict line: the one the exit code follows first (within BF16's run-to-run
    noise when BF16 was repeated), then the single-run criteria."""
    single = "PASS" if v["pass"] else "FAIL"
    if "within_bf16_noise" not in v:
        return single
    w, n = v["within_bf16_noise"], v["bf16_noise"]["repeats"]
    return (f"within BF16 run-to-run noise ({n} repeat{'s' if n > 1 else ''}): "
            f"{'PASS' if w['pass'] else 'FAIL'}   (single-run criteria: {single})")


def verdict_line(v: dict) -> str:
    f, c = v["final"], v["curve"]
    return (
        f"PARITY {'PASS' if v['pass'] else 'FAIL'}: "
        f"final val loss mxfp8 {f['mxfp8_mean_val_loss']:.4f} vs bf16 "
        f"{f['bf16_mean_val_loss']:.4f} ({100 * f['rel_diff']:+.2f}%, limit "
        f"{100 * f['tolerance']:.0f}%: {'PASS' if f['pass'] else 'FAIL'}); "
        f"max |rel diff| after warm-up train-EMA {100 * c['max_abs_rel_diff_train_ema']:.2f}% "
        f"val {100 * c['max_abs_rel_diff_val']:.2f}% (limit {100 * c['tolerance']:.0f}%: "
        f"{'PASS' if c['pass'] else 'FAIL'})"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return _main(argv)
    except KeyboardInterrupt as e:
        what = (f"interrupted after step {e.step}/{e.total} of {_current_run}, checkpoint saved"
                if isinstance(e, T.Interrupted) else f"interrupted during {_current_run}")
        print(f"{what}; continue with: {T.resume_command('train_example.parity', argv)}",
              file=sys.stderr, flush=True)
        return T.EXIT_INTERRUPTED


_current_run = "setup"  # the run under way, for the Ctrl-C line


def _train(common: list[str], precision: str, run_dir: Path, args, label: str) -> float:
    """One training run of the comparison (continued with --resume); returns its wall time."""
    global _current_run
    _current_run = f"the {label.strip()} run"
    if not args.quiet:
        print(f"=== {label.strip()} -> {run_dir} ===", flush=True)
    t = time.perf_counter()
    T.run(common + ["--precision", precision, "--out", str(run_dir)]
          + (["--resume"] if args.resume else []), label=label)
    return time.perf_counter() - t


def steps_seconds(rows: list[dict], tc) -> float:
    """Seconds of a run's logged training steps after the first (each row's tokens over its
    tokens/s; evaluations and checkpoints are not in them)."""
    tokens = tc.batch_size * tc.seq_len
    return sum(tokens / r["tokens_per_s"] for r in rows[1:] if r["tokens_per_s"] > 0)


def check_protocol_args(args) -> None:
    """The protocol's options only with ``--seeds``, and not with ``--bf16-repeat``."""
    if args.seeds is None:
        given = [o for o, v in (("--recipes", args.recipes), ("--only-seed", args.only_seed))
                 if v is not None]
        if given:
            raise SystemExit(f"error: {given[0]} needs --seeds N (the multi-seed protocol)")
        return
    if args.bf16_repeat:
        raise SystemExit("error: --bf16-repeat measures one seed's noise; the protocol (--seeds) "
                         "measures it across seeds instead: pass one of them")
    if args.recipes is not None and args.scale_blocks is not None:
        raise SystemExit("error: pass --recipes or --scale-blocks with --seeds, not both")
    if args.only_seed is not None and not args.seed <= args.only_seed < args.seed + args.seeds:
        raise SystemExit(f"error: --only-seed {args.only_seed} is not one of the protocol's seeds "
                         f"{args.seed}..{args.seed + args.seeds - 1}")
    args.recipes = args.recipes or [args.scale_blocks or AUTO]


def _main(argv: list[str]) -> int:
    global _current_run
    _current_run = "setup"
    args = build_parser().parse_args(argv)
    check_protocol_args(args)
    out = Path(args.out)
    old = existing_outputs(out)
    if old and not (args.resume or args.overwrite):
        names = ", ".join(p.name for p in old)
        raise SystemExit(f"error: {out} already holds a comparison ({names}): pass --resume "
                         f"to continue it or --overwrite to start over")
    if args.overwrite:
        for path in old:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    out.mkdir(parents=True, exist_ok=True)
    common = ["--preset", args.preset, "--device", str(args.device), "--seed", str(args.seed),
              "--log-every", str(args.log_every)]
    for opt, val in (("--steps", args.steps), ("--backend", args.backend),
                     ("--eval-every", args.eval_every), ("--wgrad", args.wgrad),
                     ("--compile", args.compile)):
        if val is not None:
            common += [opt, str(val)]
    if args.quiet:
        common.append("--quiet")
    if args.deterministic:
        common.append("--deterministic")
    tc = T.train_config(T.build_parser().parse_args(common + ["--out", str(out)]))
    if args.seeds is not None:
        from . import protocol

        return protocol.run(args, common, out, tc, _train)
    if args.scale_blocks is not None:
        common += ["--scale-blocks", args.scale_blocks]

    t0 = time.perf_counter()
    logs, wall = {}, {}
    n_runs = len(PRECISIONS) + args.bf16_repeat
    for i, p in enumerate(PRECISIONS, start=1):
        wall[p] = _train(common, p, out / p, args, f"{p} ({i}/{n_runs}) ")
        logs[p] = T.read_log(out / p / "log.csv")
    rows, verdict = compare(logs, tc.steps, tc.warmup_steps, args)
    repeats = []
    if args.bf16_repeat > 0:
        noise, repeats = bf16_noise(common, out, logs["bf16"], tc, args, verdict)
        verdict.update(noise)
    _current_run = "the comparison (both runs are complete)"

    dev = args.device
    device_name = (torch.cuda.get_device_name(dev) if dev.type == "cuda"
                   else f"cpu ({platform.processor() or platform.machine()}, "
                        f"{torch.get_num_threads()} torch thread(s))")
    run_info = json.loads((out / "mxfp8" / "run.json").read_text())
    summary = {
        **verdict,
        "preset": args.preset, "steps": tc.steps, "warmup_steps": tc.warmup_steps,
        "seed": args.seed, "device": str(dev), "device_name": device_name,
        "backend": run_info["backend"], "wgrad": args.wgrad or "mxfp8",
        "scale_blocks": args.scale_blocks or AUTO, "compile": run_info.get("compile"),
        "scale_blocks_resolved": run_info.get("scale_blocks_resolved"),
        "parameters": run_info["parameters"],
        "active_parameters": run_info["active_parameters"],
        "final_train_loss": {p: logs[p][-1]["train_loss"] for p in PRECISIONS},
        "final_val_loss": {p: logs[p][-1]["val_loss"] for p in PRECISIONS},
        # With --resume, the time of this invocation only.
        "wall_time_s": {**wall, "total": time.perf_counter() - t0},
        # The training steps alone, from the logs, the first step left out (it holds the
        # one-time compilation: kernels, and the model's own under --compile).
        "step_time_s": {p: steps_seconds(logs[p], tc) for p in PRECISIONS},
        "resumed": bool(args.resume),
        "torch": torch.__version__, "python": platform.python_version(),
    }
    write_loss_csv(out / "loss.csv", rows)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    line = verdict_line(verdict)
    print(line, flush=True)
    if "bf16_noise" in verdict:
        print(noise_line(verdict), flush=True)
    title = (f"MXFP8 vs BF16 MoE LM, preset {args.preset}, {tc.steps} steps, {device_name}\n"
             f"{headline(verdict)}")
    try:
        plot(out / "loss.png", rows, verdict, title, repeats)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    st = summary["step_time_s"]
    if st["mxfp8"] > 0:
        print(f"training steps after the first: mxfp8 {st['mxfp8']:.1f} s, bf16 "
              f"{st['bf16']:.1f} s (bf16 / mxfp8 = {st['bf16'] / st['mxfp8']:.2f}x)", flush=True)
    print(f"wrote {out / 'loss.csv'}, {out / 'loss.png'}, {out / 'summary.json'} "
          f"({summary['wall_time_s']['total']:.0f} s)", flush=True)
    ok = verdict["within_bf16_noise"]["pass"] if "bf16_noise" in verdict else verdict["pass"]
    return 0 if ok else 1


def bf16_noise(common: list[str], out: Path, bf16_log: list[dict], tc, args,
               verdict: dict) -> tuple[dict, list[list[dict]]]:
    """Train BF16 ``args.bf16_repeat`` more times, then `noise_verdict` of their logs."""
    n_runs = len(PRECISIONS) + args.bf16_repeat
    rep_logs = []
    for i in range(1, args.bf16_repeat + 1):
        run_dir = out / f"bf16_repeat{i}"
        _train(common, "bf16", run_dir, args,
               f"bf16 repeat {i} ({len(PRECISIONS) + i}/{n_runs}) ")
        rep_logs.append(T.read_log(run_dir / "log.csv"))
    return noise_verdict(bf16_log, rep_logs, tc.steps, tc.warmup_steps, args, verdict)


def noise_verdict(bf16_log: list[dict], rep_logs: list[list[dict]], steps: int, warmup: int,
                  args, verdict: dict) -> tuple[dict, list[list[dict]]]:
    """The same criteria of each BF16 repeat against the first BF16 run are the noise floor.
    Returns ``bf16_noise`` and ``within_bf16_noise``, and each repeat's `compare` rows (for the
    plot)."""
    finals, curves, reps = [], [], []
    for rep_log in rep_logs:
        rep_rows, v = compare({"bf16": bf16_log, "mxfp8": rep_log}, steps, warmup, args)
        reps.append(rep_rows)
        finals.append(v["final"]["rel_diff"])
        curves.append(max(v["curve"]["max_abs_rel_diff_train_ema"],
                          v["curve"]["max_abs_rel_diff_val"]))
    final_tol = max(args.final_tol, max(abs(f) for f in finals))
    curve_tol = max(args.curve_tol, max(curves))
    mx_curve = max(verdict["curve"]["max_abs_rel_diff_train_ema"],
                   verdict["curve"]["max_abs_rel_diff_val"])
    final_ok = abs(verdict["final"]["rel_diff"]) <= final_tol
    curve_ok = mx_curve <= curve_tol
    return {
        "bf16_noise": {"repeats": len(rep_logs), "final_rel_diff": finals,
                       "max_abs_rel_diff_curve": curves},
        "within_bf16_noise": {"pass": final_ok and curve_ok, "final_tolerance": final_tol,
                              "curve_tolerance": curve_tol, "final_pass": final_ok,
                              "curve_pass": curve_ok},
    }, reps


def noise_line(v: dict) -> str:
    n, w = v["bf16_noise"], v["within_bf16_noise"]
    finals = ", ".join(f"{100 * f:+.2f}%" for f in n["final_rel_diff"])
    curves = ", ".join(f"{100 * c:.2f}%" for c in n["max_abs_rel_diff_curve"])
    return (f"BF16 vs BF16 (same seed, {n['repeats']} repeat(s)): final {finals}, max curve "
            f"{curves} -> MXFP8 within BF16 run-to-run noise (tolerances "
            f"{100 * w['final_tolerance']:.2f}% / {100 * w['curve_tolerance']:.2f}%): "
            f"{'PASS' if w['pass'] else 'FAIL'}")


if __name__ == "__main__":
    sys.exit(main())
