"""Does a memory-bound weight quantization overlap the 1x128 data-path kernels when the two run
on two CUDA streams? (device; docs/NOTES.md "Where the 1x128 SwiGLU kernels' time goes": it
does not, so the layer keeps one stream)

For each shape and pair (data-path kernel A, the weight quantization the layer needs next, B):
A alone, B alone, and both launched together -- A first on the current stream and B on a side
stream, and the other order -- each the median of ``--reps`` timed rounds (CUDA events).

    python tools/overlap_probe.py [--shapes mixtral,dsv3,qwen3] [--reps 7]
"""

from __future__ import annotations

import argparse

import torch
from moe_mxfp8.kernels import datapath_triton as K
from rowkernel_sweep import SHAPES, make_inputs

from benchmarks.timing import bench_us
from moe_mxfp8.quantize import quantize_weights


def _time(fn, reps: int) -> float:
    """Median ms of ``fn`` over ``reps`` rounds of one call (no graph: two streams)."""
    return bench_us(fn, warmup=1, reps=1, rounds=reps, use_graph=False) / 1e3


def _together(first, second, side: torch.cuda.Stream):
    """``first`` on the current stream, ``second`` on ``side`` forked from it, joined after."""
    def run():
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        first()
        with torch.cuda.stream(side):
            second()
        main.wait_stream(side)
    return run


def probe(name: str, reps: int) -> None:
    z = make_inputs(name, align=128)
    k, e, d, hh, src, tbl = z["k"], z["e"], z["d"], z["hh"], z["src"], z["tbl"]
    x, h, da, o_d, o_h, o_2h = z["x"], z["h"], z["da"], z["o_d"], z["o_h"], z["o_2h"]
    w_gu = torch.randn(e, 2 * hh, d, device="cuda", dtype=torch.bfloat16) * 0.02
    w_dn = torch.randn(e, d, hh, device="cuda", dtype=torch.bfloat16) * 0.02
    side = torch.cuda.Stream()
    pairs = [
        ("dispatch", lambda: K.dispatch(x, src, tbl, k, o_d, 128, True),
         "w_gate_up K", lambda: quantize_weights(w_gu, axis="K", block_rows=128)),
        ("swiglu_fwd", lambda: K.swiglu_fwd(h, src, tbl, o_h, 128, True),
         "w_down K", lambda: quantize_weights(w_dn, axis="K", block_rows=128)),
        ("swiglu_bwd", lambda: K.swiglu_bwd(da, h, src, tbl, o_2h, 128, True),
         "w_gate_up N", lambda: quantize_weights(w_gu, axis="N", block_rows=128)),
    ]
    for an, a, bn, b in pairs:
        ta, tb = _time(a, reps), _time(b, reps)
        tab = _time(_together(a, b, side), reps)
        tba = _time(_together(b, a, side), reps)
        print(f"{name:8s} {an:11s} {ta:7.3f} ms | {bn:12s} {tb:7.3f} ms | sum {ta + tb:7.3f} | "
              f"together: kernel first {tab:7.3f}, quantizer first {tba:7.3f} ms "
              f"(saves {ta + tb - min(tab, tba):6.3f})", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    torch.manual_seed(0)
    for name in args.shapes.split(","):
        probe(name, args.reps)


if __name__ == "__main__":
    main()
