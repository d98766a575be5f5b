"""Instruction mix of the Triton kernels (data path, router, routing layout, EP payload, weight
transpose), from their
sm_90 SASS (CPU only).

``python tools/triton_sass.py [--kernels swiglu_fwd,...] [--keep DIR]`` (needs Triton, whose
wheel ships ``ptxas`` and ``cuobjdump``). Each kernel is compiled for sm_90 at its launch
constants (`kernels.datapath_triton.ROW_TILING`, the payload and transpose tiles) with every
runtime argument specialized 16-byte aligned / divisible by 16 but the row counts, as a launch
at the model shapes is (`tests.triton_sm90.compile_for_sm90`). Printed per kernel: SASS
instructions (static: each once), instructions per element a thread owns, registers, local
stack bytes (spills), and the global / shared memory instructions by width -- the numbers behind
docs/design/datapath.md's instruction counts, and a check that the stores stay 16 bytes wide.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# any count: the EP payload rows (M, the layout extent, is 16-aligned); tokens, pairs, chunks
NOT_ALIGNED = ("R", "T", "M", "NCH", "NP", "NB", "M_PAD")
# the MXFP8 training path's outputs (rowwise + columnwise copies) and the BF16 twin's
MXFP8_OUTS = {"QROW": True, "QCOL": True, "BF16": False}
TWIN_OUTS = {"QROW": False, "QCOL": False, "BF16": True}


def _row_kernel(name: str, fn, ablk: int, outs: dict, extra: dict | None = None):
    from moe_mxfp8.kernels import datapath_triton as K

    meta = K._row_meta(ablk, True, name)
    warps = meta.pop("num_warps")
    meta.pop("maxnreg", None)
    consts = {**meta, **outs, "INTERP": False, **(extra or {})}
    return fn, consts, warps, meta["RB"] * meta["CB"]


def kernels() -> dict:
    """name -> (jit function, constexprs, warps, elements per program)."""
    from moe_mxfp8.kernels import datapath_triton as K
    from moe_mxfp8.kernels import ep_payload_triton as P
    from moe_mxfp8.kernels import router_triton as RK
    from moe_mxfp8.kernels import routing_triton as LK
    from moe_mxfp8.kernels import weights_triton as W

    out = {}
    for ablk in K.ACT_BLOCKS:
        tag = f"1x{ablk}"
        out[f"dispatch {tag}"] = _row_kernel("dispatch", K._dispatch_kernel, ablk, MXFP8_OUTS)
        out[f"swiglu_fwd {tag}"] = _row_kernel("swiglu_fwd", K._swiglu_fwd_kernel, ablk,
                                               MXFP8_OUTS)
        out[f"swiglu_bwd {tag}"] = _row_kernel("swiglu_bwd", K._swiglu_bwd_kernel, ablk,
                                               MXFP8_OUTS, {"JOINT": False})
        out[f"combine_bwd {tag}"] = _row_kernel("combine_bwd", K._combine_bwd_kernel, ablk,
                                                MXFP8_OUTS, {"DW": True})
    out["swiglu_fwd twin"] = _row_kernel("swiglu_fwd", K._swiglu_fwd_kernel, K.BLOCK, TWIN_OUTS)
    out["swiglu_bwd twin"] = _row_kernel("swiglu_bwd", K._swiglu_bwd_kernel, K.BLOCK, TWIN_OUTS,
                                         {"JOINT": False})
    out["ep pack"] = (P._pack_kernel, {"INTERP": False, "RB": P.ROWS, "CB": P.PACK_COLS},
                      P.WARPS, P.ROWS * P.PACK_COLS)
    out["ep unpack"] = (P._unpack_kernel, {"INTERP": False, "RB": P.ROWS, "CB": P.UNPACK_COLS},
                        P.WARPS, P.ROWS * P.UNPACK_COLS)
    out["weights transpose"] = (W._transpose_kernel, {"T": W.TILE}, 4, W.TILE * W.TILE)
    for e, k in ((8, 2), (128, 8)):  # dsv3 / mixtral, qwen3
        ep = RK.expert_width(e)
        tb, tbb = RK.tokens_per_program(ep), RK.tokens_per_program(ep, backward=True)
        flags = {"SIGMOID": False, "RENORM": True, "EP": ep, "K": k, "INTERP": False}
        out[f"router fwd E{e}"] = (RK._route_fwd_kernel, {**flags, "TB": tb}, 4, tb * ep)
        out[f"router bwd E{e}"] = (RK._route_bwd_kernel, {**flags, "TB": tbb, "HAS_DW": True,
                                                          "HAS_DAUX": True}, 4, tbb * ep)
        meta = LK._meta(e)
        warps = meta.pop("num_warps")
        out[f"layout place E{e}"] = (LK._place_kernel, {**meta, "BLK": 32, "TILE": 128,
                                                        "TB": LK.table_rows(meta["EP"])},
                                     warps, LK.CHUNK)
    return out


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def mix(fn, consts: dict, warps: int, elements: int, keep: Path | None, name: str) -> dict:
    from tests.triton_sm90 import compile_for_sm90

    k = compile_for_sm90(fn, consts, warps, aligned_except=NOT_ALIGNED)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(k.asm["cubin"])
        sass = subprocess.run([_tool("cuobjdump"), "-sass", str(cubin)], capture_output=True,
                              text=True, check=True).stdout
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", str(cubin)],
                             capture_output=True, text=True, check=True).stdout
    if keep:
        keep.mkdir(parents=True, exist_ok=True)
        (keep / (name.replace(" ", "_") + ".sass")).write_text(sass)
    ops = re.findall(r"/\*[0-9a-f]{4,6}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    mem = collections.Counter(op for op in ops if re.match(r"(LDG|STG|LDS|STS|LDL|STL)", op))
    regs = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    per_thread = elements / (32 * warps)
    return {"instructions": len(ops), "per_element": len(ops) / per_thread,
            "registers": int(regs.group(1)) if regs else None,
            "stack_bytes": int(stack.group(1)) if stack else None, "memory": dict(mem)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernels", default="", help="comma-separated name prefixes (default all)")
    ap.add_argument("--keep", type=Path, default=None, help="write each kernel's SASS here")
    args = ap.parse_args()
    wanted = [w for w in args.kernels.split(",") if w]
    print(f"{'kernel':20} {'instr':>6} {'/elem':>6} {'regs':>5} {'stack':>6}  memory instructions")
    for name, (fn, consts, warps, elements) in kernels().items():
        if wanted and not any(name.startswith(w) for w in wanted):
            continue
        r = mix(fn, consts, warps, elements, args.keep, name)
        memory = " ".join(f"{k}:{v}" for k, v in sorted(r["memory"].items()))
        print(f"{name:20} {r['instructions']:>6} {r['per_element']:>6.1f} {r['registers']:>5} "
              f"{r['stack_bytes']:>6}  {memory}", flush=True)


if __name__ == "__main__":
    main()
