"""Tuning sweep for the Hopper grouped GEMM: the same problem under several kernel configs.

    python -m benchmarks.tune_grouped_gemm_sm90 [--cases fprop:dsv3:32768,...] [--json out.json]

Each case is ``op:shape[:rows]`` (op fprop, dgrad or wgrad16; shape as in bench_grouped_gemm;
rows overrides T). Every config in ``CONFIGS`` (overrides of `GroupedGemmSm90Config`'s tuning
fields, see ``kernels/grouped_gemm/sm90.py``) runs every case in both weight scale modes
(1x32, 32x32; wgrad 1x32 only); ``torch._grouped_mm`` bf16 runs in the same process as the
baseline. Configs with ``diag`` compute wrong results on purpose (they remove one cost to
measure it); the others are checked against a bf16 GEMM of the dequantized operands.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from benchmarks.bench_grouped_gemm import SHAPES, _offs, _rel, group_sizes
from benchmarks.timing import Rotating, bench_us, device_info
from moe_mxfp8 import reference as R

CONFIGS = {
    "default": {},
    "two-CTA clusters": {"cluster_n": 2},
    "no products": {"scale_products": False},
    "v0": {"scale_lookahead": 1, "hoist_scales": False},
    "la2": {"scale_lookahead": 2, "hoist_scales": False},
    "hoist": {"scale_lookahead": 1, "hoist_scales": True},
    "la2+hoist": {"scale_lookahead": 2, "hoist_scales": True},
    "la3+hoist": {"scale_lookahead": 3, "hoist_scales": True},
    "diag no_scale_wait": {"diag": "no_scale_wait", "hoist_scales": True},
    "single tmp": {"double_tmp": False},
    "diag no_promote": {"diag": "no_promote"},
    "diag promote_only": {"diag": "promote_only"},
    "cluster2": {"cluster_n": 2},
    "cluster2 diag no_promote": {"cluster_n": 2, "diag": "no_promote"},
}



def _sm90(mode: str):
    """The Hopper kernel through the shared launcher, for ``mode`` "m" or "k"."""
    from moe_mxfp8.kernels.grouped_gemm import launcher
    from moe_mxfp8.kernels.grouped_gemm.sm90 import GroupedGemmSm90

    return functools.partial(launcher.grouped_mm, GroupedGemmSm90, mode)

def make_case(op: str, shape: str, rows: int | None, dev="cuda"):
    e, t, d, f = SHAPES[shape]
    t = rows or t
    n2 = 2 * f
    sizes = group_sizes(e, t, align=16 if op == "wgrad16" else 1)
    offs = _offs(sizes, dev)
    torch.manual_seed(1)
    w = torch.randn(e, n2, d, device=dev, dtype=torch.bfloat16) * 0.02
    if op in ("fprop", "dgrad"):
        axis = "K" if op == "fprop" else "N"
        x = torch.randn(t, d if op == "fprop" else n2, device=dev, dtype=torch.bfloat16)
        a = R.quantize_rowwise_ref(x, offs=offs)
        bs = {br: R.quantize_weights_ref(w, axis=axis, block_rows=br) for br in (1, 32)}
        refs = {br: torch._grouped_mm(a.dequantize(torch.bfloat16),
                                      b.dequantize(torch.bfloat16).transpose(-2, -1), offs=offs)
                for br, b in bs.items()}
        bf16 = (x, w.transpose(-2, -1) if op == "fprop" else w)
    else:
        dy = torch.randn(t, n2, device=dev, dtype=torch.bfloat16)
        x = torch.randn(t, d, device=dev, dtype=torch.bfloat16)
        a = R.quantize_colwise_ref(dy, offs=offs)
        bs = {1: R.quantize_colwise_ref(x, offs=offs)}
        refs = {1: torch._grouped_mm(a.dequantize(torch.bfloat16),
                                     bs[1].dequantize(torch.bfloat16).t(), offs=offs)}
        bf16 = (dy.t(), x)
    return {"a": a, "bs": bs, "refs": refs, "offs": offs, "bf16": bf16,
            "flops": 2.0 * t * n2 * d, "m_grouped": op != "wgrad16"}


def run_case(case, name: str, configs: dict, once: bool = False) -> list[dict]:
    # wgrad16 cases have 16-aligned groups (as MXFP8MoE gives them): no re-layout gather
    fn = _sm90("m") if case["m_grouped"] else functools.partial(_sm90("k"),
                                                                    aligned_groups=True)
    offs, a = case["offs"], case["a"]
    rows = []
    rot = Rotating([case["bf16"], tuple(t.clone() for t in case["bf16"])])
    bf16_us = 1.0 if once else bench_us(lambda: torch._grouped_mm(*rot.next(), offs=offs),
                                        warmup=3, reps=10, rounds=3)
    rows.append({"case": name, "config": "bf16 torch._grouped_mm", "mode": "-", "us": bf16_us})
    for br, b in case["bs"].items():
        b2 = type(b)(b.data.clone(), b.scale.clone(), b.scale_layout, b.offs, b.group_axis,
                     b.block_rows)
        for cname, tuning in configs.items():
            row = {"case": name, "config": cname, "mode": f"{br}x32" if br == 1 else "32x32"}
            try:
                out = fn(a, b, offs, torch.bfloat16, tuning=tuning)
                torch.cuda.synchronize()
                if not tuning.get("diag"):
                    row["rel_err"] = _rel(out, case["refs"][br])
                del out
                if once:  # (under a profiler: one launch per config and mode)
                    continue
                brot = Rotating([b, b2])
                row["us"] = bench_us(lambda brot=brot, tuning=tuning: fn(
                    a, brot.next(), offs, torch.bfloat16, tuning=tuning),
                    warmup=3, reps=10, rounds=3)
            except Exception as err:  # noqa: BLE001  (report and go on with the sweep)
                row["error"] = repr(err)[:300]
            rows.append(row)
            if not once:
                print(_fmt(row, case["flops"], bf16_us), flush=True)
    for r in rows:
        r["tflops"] = case["flops"] / r["us"] / 1e6 if "us" in r else None
        r["x_bf16"] = bf16_us / r["us"] if "us" in r else None
    return rows


def _fmt(r: dict, flops: float, bf16_us: float) -> str:
    if "us" not in r:
        return f"| {r['case']} | {r['config']} | {r['mode']} | ERROR {r.get('error')} |"
    err = f"{r['rel_err']:.1e}" if "rel_err" in r else "-"
    return (f"| {r['case']} | {r['config']} | {r['mode']} | {r['us']:.0f} | "
            f"{flops / r['us'] / 1e6:.0f} | {bf16_us / r['us']:.2f} | {err} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="fprop:dsv3:32768,fprop:qwen3,wgrad16:dsv3:32768")
    ap.add_argument("--configs", default="", help="comma list of CONFIGS names (default all)")
    ap.add_argument("--json", default="")
    ap.add_argument("--once", action="store_true", help="one untimed launch each (profilers)")
    ap.add_argument("--modes", default="1,32", help="weight block rows to run: 1, 32 or both")
    args = ap.parse_args()
    configs = CONFIGS
    if args.configs:
        configs = {k: CONFIGS[k] for k in args.configs.split(",")}
    print(device_info())
    print("| case | config | mode | us | TFLOP/s | x bf16 | rel err |")
    print("|---|---|---|---|---|---|---|")
    allrows = []
    for spec in args.cases.split(","):
        parts = spec.split(":")
        op, shape = parts[0], parts[1]
        rows = int(parts[2]) if len(parts) > 2 else None
        case = make_case(op, shape, rows)
        name = f"{op} {shape} T={rows or SHAPES[shape][1]}"
        modes = {int(m) for m in args.modes.split(",")}
        case["bs"] = {br: b for br, b in case["bs"].items() if br in modes}
        case_rows = run_case(case, name, configs, args.once)
        allrows += case_rows
        if not args.once:
            bf = case_rows[0]  # the bf16 baseline row
            print(_fmt(bf, case["flops"], bf["us"]), flush=True)
        del case
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": device_info(), "rows": allrows}, fh, indent=1)


if __name__ == "__main__":
    main()
