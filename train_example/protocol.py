"""The multi-seed loss-parity protocol of `train_example.parity` (``--seeds N``).

One seed's MXFP8-vs-BF16 difference is one sample of a noisy quantity: at the GPU preset two
same-seed BF16 runs used to land several percent apart, and different seeds (other data order,
other initial weights) spread further. The protocol trains BF16 and each MXFP8 recipe with N
seeds and judges the *paired* differences (same seed, same batches, same initial weights): their
mean, and a 95% Student-t interval around it, which says whether a bias is resolved.

Verdict per recipe: ``|mean_mxfp8 / mean_bf16 - 1| <= final_tol`` (the means of the final
validation loss over the seeds) **and** the interval of the paired relative differences either
includes 0 (no bias resolved) or lies within ``+-ci_tol`` (a bias, but a small one).
"""

from __future__ import annotations

import csv
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from . import train as T

CONFIDENCE = 0.95
# Two-sided 95% quantiles of Student's t, t_{0.975, df} for df = 1..30 (standard tables); above
# 30 the Cornish-Fisher expansion in 1/df (`t_quantile`) is within 1e-3 of them.
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
Z975 = 1.959964  # the normal quantile, the limit for df -> inf
BF16 = "bf16"


def t_quantile(df: int) -> float:
    """``t_{0.975, df}``: the table up to 30 degrees of freedom, the expansion above."""
    if df < 1:
        raise ValueError(f"a t-interval needs at least 2 samples (df >= 1), got df={df}")
    if df <= len(T975):
        return T975[df - 1]
    z = Z975
    return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3))


def spread(values: list[float]) -> dict:
    """Mean, sample standard deviation, min and max of ``values`` (per seed)."""
    return {"per_seed": values, "mean": statistics.fmean(values),
            "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}


def paired(diffs: list[float]) -> dict:
    """`spread` of the paired differences plus the 95% t-interval of their mean."""
    out = spread(diffs)
    half = t_quantile(len(diffs) - 1) * out["sd"] / math.sqrt(len(diffs))
    out["ci95"] = [out["mean"] - half, out["mean"] + half]
    return out


def run_name(recipe: str) -> str:
    return f"mxfp8-{recipe}"


def ema_after_warmup(ema: list[float], log: list[dict], warmup: int) -> float:
    """The EMA train curve averaged over the steps after warm-up."""
    after = [e for e, r in zip(ema, log, strict=True) if r["step"] > warmup]
    return sum(after) / len(after)


def verdict(bf16: dict, mx: dict, diff: dict, final_tol: float, ci_tol: float) -> dict:
    """The protocol's verdict for one recipe (see the module doc)."""
    mean_rel = (mx["mean"] - bf16["mean"]) / bf16["mean"]
    lo, hi = diff["ci95"]
    includes_zero = lo <= 0.0 <= hi
    within = -ci_tol <= lo and hi <= ci_tol
    mean_ok = abs(mean_rel) <= final_tol
    return {"pass": mean_ok and (includes_zero or within), "mean_rel_diff": mean_rel,
            "mean_pass": mean_ok, "final_tolerance": final_tol,
            "ci_includes_zero": includes_zero, "ci_within_tolerance": within,
            "ci_tolerance": ci_tol}


def evaluate(logs: dict[int, dict[str, list[dict]]], recipes: list[str], steps: int,
             warmup: int, args) -> tuple[dict, list[dict]]:
    """``logs[seed][run name]`` -> (the protocol's numbers, the per-step band rows)."""
    from .parity import ema, final_val  # noqa: PLC0415  (parity imports this module lazily)

    seeds = sorted(logs)
    names = [BF16, *map(run_name, recipes)]
    emas = {s: {n: ema([r["train_loss"] for r in logs[s][n]], args.ema_beta) for n in names}
            for s in seeds}
    finals = {n: [final_val(logs[s][n], steps) for s in seeds] for n in names}
    ema_means = {n: [ema_after_warmup(emas[s][n], logs[s][n], warmup) for s in seeds]
                 for n in names}
    result = {
        "seeds": seeds, "confidence": CONFIDENCE, "after_step": warmup, "ema_beta": args.ema_beta,
        BF16: {"final_val_loss": spread(finals[BF16]),
               "train_ema_after_warmup": spread(ema_means[BF16])},
        "recipes": {},
    }
    for recipe, name in zip(recipes, names[1:], strict=True):
        rel_final = [(m - b) / b for m, b in zip(finals[name], finals[BF16], strict=True)]
        rel_ema = [(m - b) / b for m, b in zip(ema_means[name], ema_means[BF16], strict=True)]
        stats = {"final_val_loss": spread(finals[name]),
                 "train_ema_after_warmup": spread(ema_means[name]),
                 "paired_rel_diff_final_val": paired(rel_final),
                 "paired_rel_diff_train_ema": paired(rel_ema)}
        stats["verdict"] = verdict(result[BF16]["final_val_loss"], stats["final_val_loss"],
                                   stats["paired_rel_diff_final_val"], args.final_tol,
                                   args.ci_tol)
        result["recipes"][recipe] = stats
    result["pass"] = all(v["verdict"]["pass"] for v in result["recipes"].values())
    return result, band_rows(logs, emas, names, seeds)


def _band(row: dict, key: str, values: list[float] | None) -> None:
    """``row[key_mean/_min/_max]`` over the seeds' ``values`` (None: no value at this step)."""
    stats = (None,) * 3 if values is None else (statistics.fmean(values), min(values),
                                                 max(values))
    for suffix, v in zip(("mean", "min", "max"), stats, strict=True):
        row[f"{key}_{suffix}"] = v


def band_rows(logs, emas, names, seeds) -> list[dict]:
    """Per step: each run's EMA train loss and validation loss over the seeds (mean, min, max),
    and each recipe's paired relative differences to BF16 (mean, min, max)."""
    rows = []
    for i, r0 in enumerate(logs[seeds[0]][BF16]):
        row = {"step": r0["step"]}
        has_val = all(logs[s][n][i]["val_loss"] is not None for s in seeds for n in names)
        for n in names:
            _band(row, f"{n}_train_ema", [emas[s][n][i] for s in seeds])
            _band(row, f"{n}_val", [logs[s][n][i]["val_loss"] for s in seeds] if has_val
                  else None)
            if n == BF16:
                continue
            _band(row, f"{n}_train_ema_rel",
                  [(emas[s][n][i] - emas[s][BF16][i]) / emas[s][BF16][i] for s in seeds])
            _band(row, f"{n}_val_rel",
                  [(logs[s][n][i]["val_loss"] - logs[s][BF16][i]["val_loss"])
                   / logs[s][BF16][i]["val_loss"] for s in seeds] if has_val else None)
        rows.append(row)
    return rows


def write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if v is None else v) for k, v in r.items()})


def verdict_lines(result: dict) -> list[str]:
    n = len(result["seeds"])
    b = result[BF16]["final_val_loss"]
    lines = []
    for recipe, st in result["recipes"].items():
        v, m, d = st["verdict"], st["final_val_loss"], st["paired_rel_diff_final_val"]
        lo, hi = d["ci95"]
        ci_what = ("includes 0" if v["ci_includes_zero"] else
                   f"within +-{100 * v['ci_tolerance']:.1f}%" if v["ci_within_tolerance"] else
                   f"excludes 0 and exceeds +-{100 * v['ci_tolerance']:.1f}%")
        lines.append(
            f"PARITY {recipe} {'PASS' if v['pass'] else 'FAIL'} over {n} seeds: final val loss "
            f"mean mxfp8 {m['mean']:.4f} (sd {m['sd']:.4f}) vs bf16 {b['mean']:.4f} "
            f"(sd {b['sd']:.4f}): {100 * v['mean_rel_diff']:+.2f}% (limit "
            f"{100 * v['final_tolerance']:.0f}%: {'PASS' if v['mean_pass'] else 'FAIL'}); "
            f"paired difference {100 * d['mean']:+.2f}% (sd {100 * d['sd']:.2f}%), 95% interval "
            f"[{100 * lo:+.2f}%, {100 * hi:+.2f}%] {ci_what}; train EMA after warm-up "
            f"{100 * st['paired_rel_diff_train_ema']['mean']:+.2f}%")
    return lines


STYLE = {BF16: {"color": "tab:blue", "ls": "--"}}
RECIPE_COLORS = ("tab:red", "tab:green", "tab:purple", "tab:orange")


def _style(name: str, i: int) -> dict:
    return STYLE.get(name, {"color": RECIPE_COLORS[i % len(RECIPE_COLORS)], "ls": "-"})


def figure(rows: list[dict], result: dict, title: str):
    """Mean curves with their seeds' min-max bands: EMA train loss, validation loss, and each
    recipe's paired relative difference to BF16."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [BF16, *map(run_name, result["recipes"])]
    steps = [r["step"] for r in rows]
    vrows = [r for r in rows if r[f"{BF16}_val_mean"] is not None]
    vsteps = [r["step"] for r in vrows]
    fig, (ax_t, ax_v, ax_d) = plt.subplots(3, 1, figsize=(9, 11), sharex=True)
    n = len(result["seeds"])
    for i, name in enumerate(names):
        st = _style(name, i - 1)
        label = f"{name} (mean of {n} seeds; band min-max)"
        for ax, rs, xs, key in ((ax_t, rows, steps, "train_ema"), (ax_v, vrows, vsteps, "val")):
            ax.fill_between(xs, [r[f"{name}_{key}_min"] for r in rs],
                            [r[f"{name}_{key}_max"] for r in rs], color=st["color"], alpha=0.18,
                            lw=0)
            ax.plot(xs, [r[f"{name}_{key}_mean"] for r in rs], color=st["color"], ls=st["ls"],
                    lw=1.5, label=label, marker="." if key == "val" else None)
        if name == BF16:
            continue
        ax_d.fill_between(vsteps, [100 * r[f"{name}_val_rel_min"] for r in vrows],
                          [100 * r[f"{name}_val_rel_max"] for r in vrows], color=st["color"],
                          alpha=0.18, lw=0)
        ax_d.plot(vsteps, [100 * r[f"{name}_val_rel_mean"] for r in vrows], color=st["color"],
                  marker=".", label=f"{name} - bf16, validation (paired, per seed)")
        ax_d.plot(steps, [100 * r[f"{name}_train_ema_rel_mean"] for r in rows],
                  color=st["color"], ls=":", lw=1, label=f"{name} - bf16, train EMA")
    tol = 100 * next(iter(result["recipes"].values()))["verdict"]["final_tolerance"]
    for y in (-tol, tol):
        ax_d.axhline(y, color="gray", ls="--", lw=0.8)
    ax_d.axhline(0, color="black", lw=0.5)
    ax_t.set_ylabel(f"train loss, EMA {result['ema_beta']} (nats/byte)")
    ax_t.set_title(title)
    ax_v.set_ylabel("validation loss (nats/byte)")
    ax_d.set_ylabel("(mxfp8 - bf16) / bf16  [%]")
    ax_d.set_xlabel("step")
    for ax in (ax_t, ax_v, ax_d):
        ax.axvline(result["after_step"], color="gray", ls=":", lw=0.8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def headline(result: dict) -> str:
    return "   ".join(f"{r}: {'PASS' if st['verdict']['pass'] else 'FAIL'} "
                      f"({100 * st['verdict']['mean_rel_diff']:+.2f}%, 95% CI "
                      f"[{100 * st['paired_rel_diff_final_val']['ci95'][0]:+.2f}, "
                      f"{100 * st['paired_rel_diff_final_val']['ci95'][1]:+.2f}]%)"
                      for r, st in result["recipes"].items())


def _with_seed(common: list[str], seed: int) -> list[str]:
    out = list(common)
    out[out.index("--seed") + 1] = str(seed)
    return out


def run(args, common: list[str], out: Path, tc, train) -> int:
    """Train every (seed, precision) run not yet finished, then compare (see the module doc).
    ``train``: `parity._train`."""
    from . import parity as P  # noqa: PLC0415

    seeds = list(range(args.seed, args.seed + args.seeds))
    todo = [args.only_seed] if args.only_seed is not None else seeds
    names = [(BF16, BF16, None), *((run_name(r), "mxfp8", r) for r in args.recipes)]
    t0 = time.perf_counter()
    k, total = 0, len(todo) * len(names)
    for seed in todo:
        for name, precision, recipe in names:
            k += 1
            extra = ["--scale-blocks", recipe] if recipe else []
            train(_with_seed(common, seed) + extra, precision, out / f"seed{seed}" / name, args,
                  f"seed {seed} {name} ({k}/{total}) ")
    if args.only_seed is not None:
        print(f"seed {args.only_seed}: {len(names)} runs done in {out}/seed{args.only_seed}; "
              f"compare with the same command, --resume instead of --only-seed", flush=True)
        return 0
    P._current_run = "the comparison (every run is complete)"
    logs = {s: {n: T.read_log(out / f"seed{s}" / n / "log.csv") for n, _, _ in names}
            for s in seeds}
    for s in seeds:
        for n, _, _ in names:
            if [r["step"] for r in logs[s][n]] != list(range(1, tc.steps + 1)):
                raise SystemExit(f"error: {out}/seed{s}/{n}/log.csv does not hold steps 1.."
                                 f"{tc.steps}: finish it with --resume")
    result, rows = evaluate(logs, args.recipes, tc.steps, tc.warmup_steps, args)
    resolved = {}
    for r in args.recipes:
        info = json.loads((out / f"seed{seeds[0]}" / run_name(r) / "run.json").read_text())
        resolved[r] = info.get("scale_blocks_resolved")
        result["recipes"][r]["resolved"] = resolved[r]
    dev = args.device
    device_name = (torch.cuda.get_device_name(dev) if dev.type == "cuda"
                   else f"cpu ({platform.processor() or platform.machine()})")
    summary = {
        "pass": result["pass"], "protocol": result,
        "preset": args.preset, "steps": tc.steps, "warmup_steps": tc.warmup_steps,
        "seeds": seeds, "recipes": args.recipes, "device": str(dev),
        "device_name": device_name, "deterministic": bool(args.deterministic),
        "wgrad": args.wgrad or "mxfp8", "compile": info.get("compile"),  # as the runs resolved it
        "wall_time_s": time.perf_counter() - t0,
        "resumed": bool(args.resume), "torch": torch.__version__,
        "python": platform.python_version(),
    }
    write_csv(out / "loss.csv", rows)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    for line in verdict_lines(result):
        print(line, flush=True)
    title = (f"MXFP8 vs BF16 MoE LM, preset {args.preset}, {tc.steps} steps, {len(seeds)} seeds, "
             f"{device_name}\n{headline(result)}")
    try:
        P.plot_figure(out / "loss.png", lambda: figure(rows, result, title))
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out / 'loss.csv'}, {out / 'loss.png'}, {out / 'summary.json'}", flush=True)
    return 0 if result["pass"] else 1
