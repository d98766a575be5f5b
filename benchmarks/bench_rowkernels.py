"""Time the 1x128 row-block data-path kernels alone at other tilings (`RowTiling`: rows per
step, warps, registers per thread) than `kernels.datapath_triton.ROW_TILING`'s (device; prints
ms, GB/s over the bytes each must move and that rate as a share of the clone's), next to two
ceilings measured in the same process: a copy of the kernel's input (``torch.clone``) and the
BF16 twin's kernel.

    python -m benchmarks.bench_rowkernels [--shapes mixtral,dsv3]
        [--kernels swiglu,dispatch,combine] [--variants all|NAME,...]
        [--module moe_mxfp8.kernels.datapath_triton] [--parts] [--once]
        [--quantizer-tunings "load_batch=4,ctas_per_sm=3 load_ahead=0"] [--align 128]

``--variants``: the named tilings of `VARIANTS` to time (those a kernel cannot take are
skipped); ``--module``: a copy of the kernel module to time instead (a diagnostic variant);
``--quantizer-tunings``: the quantizer tile at these `QuantConfig` tuning fields too (over
`quantize_launch.SOURCE_TUNING`'s); ``--align``: the rows every expert group is padded to (128:
the 1x128 layer's layout, 16: the 1x32 layer's).
"""

from __future__ import annotations

import argparse
import importlib

import torch

from moe_mxfp8 import routing as RT
from moe_mxfp8 import stages as ST

SHAPES = {"mixtral": (16384, 2, 8, 4096, 14336), "dsv3": (65536, 2, 8, 7168, 2048),
          "qwen3": (16384, 8, 128, 2048, 768)}  # T k E D H


# Named tilings of a 128-row block, as `RowTiling` arguments (rows, warps, maxnreg). "tile":
# one 128 x 128 tile (the shipped SwiGLU and dispatch); "recompute": 32-row chunks recomputed
# from L2 for the columnwise copy (the shipped combine backward); "rows64": 64-row chunks.
VARIANTS = {
    "tile": (128, 8), "tile-16w": (128, 16), "tile-r168": (128, 8, 168),
    "recompute": (32, 4), "recompute-r128": (32, 4, 128), "rows64": (64, 8),
    "rows64w4": (64, 4),
}
KIND_VARIANTS = {  # what each kind's sweep takes ("all")
    "swiglu": ["tile", "tile-16w", "tile-r168", "recompute", "recompute-r128"],
    "dispatch": ["tile", "recompute", "rows64"],
    "combine": ["recompute", "rows64w4", "tile"],
}


def _settings(K, kind: str, names: list[str] | None) -> dict:
    """The named `RowTiling`s of ``kind``'s sweep: ``names`` (None: all of `KIND_VARIANTS`)."""
    take = KIND_VARIANTS[kind] if names is None else [n for n in names
                                                      if n in KIND_VARIANTS[kind]]
    return {n: K.RowTiling(*VARIANTS[n]) for n in take}


def _ms(fn) -> float:
    import triton.testing  # here: the tests read `VARIANTS` where Triton is not installed

    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


_CLONE_GBS = {}  # shape -> the clone's GB/s measured in this process


def _line(name, kern, what, ms, nbytes):
    gbs = nbytes / ms / 1e6
    share = f"{100 * gbs / _CLONE_GBS[name]:4.0f} % of clone" if name in _CLONE_GBS else ""
    print(f"{name:8s} {kern:12s} {what:52s} {ms:7.3f} ms {gbs:6.0f} GB/s {share}", flush=True)


def make_inputs(name: str, align: int = 128) -> dict:
    """Routing and the row kernels' inputs and 1x128 outputs at shape ``name`` (random data,
    every group padded to ``align`` rows)."""
    t, k, e, d, hh = SHAPES[name]
    bf = torch.bfloat16
    ids = torch.rand(t, e, device="cuda").argsort(1)[:, :k]
    counts = torch.bincount(ids.reshape(-1), minlength=e)
    _, src, offs = RT.route_layout(ids, counts, align)
    m = src.numel()
    x = torch.randn(t, d, device="cuda", dtype=bf)
    h = torch.randn(m, 2 * hh, device="cuda", dtype=bf) * 3
    return {"t": t, "k": k, "e": e, "d": d, "hh": hh, "m": m, "src": src, "offs": offs,
            "tbl": RT.block_table(offs, m, 128), "x": x, "h": h,
            "da": torch.randn(m, hh, device="cuda", dtype=bf),
            "o_d": ST._outputs(m, d, e, True, True, False, x),
            "o_h": ST._outputs(m, hh, e, True, True, False, h),
            "o_2h": ST._outputs(m, 2 * hh, e, True, True, False, h)}


def _quantizer_lines(name: str, kern: str, z: dict, nbytes: int, tunings=()) -> None:
    """Kernel ``kern`` (SwiGLU forward or backward, dispatch, combine backward) on the CuTeDSL
    quantizer tile (`kernels.quantize`'s computed sources), 1x128 and 1x32 blocks, both copies,
    into preallocated outputs; ``tunings``: `QuantConfig` tuning fields over
    `quantize_launch.SOURCE_TUNING`'s to time too (1x128)."""
    from moe_mxfp8.kernels import quantize_launch as QL

    h, da, src, offs, m, hh, e = (z[n] for n in ("h", "da", "src", "offs", "m", "hh", "e"))
    src = src.to(torch.int32)
    f = {"swiglu_fwd": hh, "swiglu_bwd": 2 * hh}.get(kern, z["d"])
    o = ST._outputs(m, f, e, True, True, False, h)
    out = {"q_row": o["qrow"].view(torch.float8_e4m3fn), "s_row": o["srow"],
           "q_col": o["qcol"].view(torch.float8_e4m3fn), "s_col": o["scol"]}
    for ablk, tuning in [(128, None), (32, None)] + [(128, t) for t in tunings]:
        if kern == "dispatch":
            def fn(ablk=ablk, tuning=tuning):
                QL.quantize_gather(z["x"], src, offs, z["k"], act_block=ablk,
                                   aligned_groups=True, out=out, tuning=tuning,
                                   col_tile=ablk == 128)
        elif kern == "combine_bwd":
            def fn(ablk=ablk, tuning=tuning):
                QL.quantize_combine_grad(z["dout"], z["y"], src, z["w"], offs, z["k"],
                                         act_block=ablk, aligned_groups=True, out=out,
                                         part=z["part"], tuning=tuning)
        elif kern == "swiglu_fwd":
            def fn(ablk=ablk, tuning=tuning):
                QL.quantize_swiglu(h, src, offs, act_block=ablk, aligned_groups=True, out=out,
                                   tuning=tuning, col_tile=ablk == 128)
        else:
            def fn(ablk=ablk, tuning=tuning):
                QL.quantize_swiglu_grad(da, h, src, offs, act_block=ablk, aligned_groups=True,
                                        out=out, tuning=tuning)
        fn()  # compile outside the timing
        what = ("shipped" if tuning is None
                else " ".join(f"{f}={v}" for f, v in tuning.items()))
        _line(name, kern, f"quantizer tile (CuTeDSL), 1x{ablk}, {what}", _ms(fn), nbytes)
    if kern not in ("swiglu_fwd", "swiglu_bwd"):
        return
    # the Triton kernel of the 1x32 blocks (its 32-row blocks), same outputs
    tbl32 = RT.block_table(offs, m, 32)
    K = ST._triton_kernels()
    if kern == "swiglu_fwd":
        def triton32():
            K.swiglu_fwd(h, src, tbl32, o, 32, True)
    else:
        def triton32():
            K.swiglu_bwd(da, h, src, tbl32, o, 32, True)
    _line(name, kern, "Triton kernel, 1x32 (32-row blocks)", _ms(triton32), nbytes)


def sweep(K, name: str, kinds: list[str], parts: bool = False, once: bool = False,
          names: list[str] | None = None, tunings=(), align: int = 128) -> None:
    """Every setting of ``kinds`` at shape ``name`` (``names``: only these `VARIANTS`), the
    shipped setting restored after (``once``: instead, each kernel of ``kinds`` and its BF16
    twin launched once, for profilers)."""
    z = make_inputs(name, align)
    k, d, hh, m, src, tbl = z["k"], z["d"], z["hh"], z["m"], z["src"], z["tbl"]
    x, h, da, o_d, o_h, o_2h = z["x"], z["h"], z["da"], z["o_d"], z["o_h"], z["o_2h"]
    bf = torch.bfloat16
    tbl32 = RT.block_table(z["offs"], m, 32)
    dout = torch.randn(z["t"], d, device="cuda", dtype=bf)
    y = torch.randn(m, d, device="cuda", dtype=bf)
    w = torch.rand(z["t"], k, device="cuda")
    part = torch.empty(-(-d // K.COL_TILE), m, device="cuda")
    b_h = {"bf16": torch.empty(m, hh, device="cuda", dtype=bf)}
    b_2h = {"bf16": torch.empty(m, 2 * hh, device="cuda", dtype=bf)}
    cases = {  # kernel key, fn, bytes moved; the BF16 twin's kernel (1x32 tables), its bytes
        "swiglu": [
            ("swiglu_fwd", lambda: K.swiglu_fwd(h, src, tbl, o_h, 128, True, col_tile=True),
             m * hh * 6,
             lambda: K.swiglu_fwd(h, src, tbl32, b_h, 32, True), m * hh * 6, h),
            ("swiglu_bwd", lambda: K.swiglu_bwd(da, h, src, tbl, o_2h, 128, True), m * hh * 10,
             lambda: K.swiglu_bwd(da, h, src, tbl32, b_2h, 32, True), m * hh * 10, h)],
        "dispatch": [("dispatch", lambda: K.dispatch(x, src, tbl, k, o_d, 128, True, col_tile=True),
                      m * d * 4,
                      None, 0, y)],
        "combine": [("combine_bwd",
                     lambda: K.combine_bwd(dout, y, w, src, tbl, k, o_d, part, 128, True),
                     m * d * 6, None, 0, y)],
    }
    if once:
        for kind in kinds:
            for _, fn, _, twin, _, _ in cases[kind]:
                fn()
                if twin is not None:
                    twin()
        torch.cuda.synchronize()
        return
    clone_ms = _ms(h.clone)  # the rate every line is shared against
    _CLONE_GBS[name] = h.numel() * 4 / clone_ms / 1e6
    if parts and "swiglu" in kinds:  # the shipped 1x128 tiling with a subset of the outputs
        def only(outs, keys):
            return {kk: outs[kk] for kk in keys}
        for what, oh, o2 in (("outputs: BF16 only", b_h, b_2h),
                             ("outputs: rowwise only", only(o_h, ("qrow", "srow")),
                              only(o_2h, ("qrow", "srow"))),
                             ("outputs: columnwise only", only(o_h, ("qcol", "scol")),
                              only(o_2h, ("qcol", "scol")))):
            _line(name, "swiglu_fwd", what,
                  _ms(lambda oh=oh: K.swiglu_fwd(h, src, tbl, oh, 128, True, col_tile=True)),
                  m * hh * 6)
            _line(name, "swiglu_bwd", what,
                  _ms(lambda o2=o2: K.swiglu_bwd(da, h, src, tbl, o2, 128, True)), m * hh * 10)
    for kind in kinds:
        for kern, fn, nbytes, twin, twin_bytes, src_t in cases[kind]:
            _line(name, kern, f"ceiling: clone {tuple(src_t.shape)}", _ms(src_t.clone),
                  src_t.numel() * 4)
            if twin is not None:
                _line(name, kern, "BF16 twin's kernel", _ms(twin), twin_bytes)
            _quantizer_lines(name, kern, {**z, "dout": dout, "y": y, "w": w, "part": part},
                             nbytes, tunings)
            table = K.ROW_TILING[kern]
            shipped = table[128]
            try:
                for vname, t in _settings(K, kind, names).items():
                    table[128] = t
                    what = f"{vname}: rows {t.rows} warps {t.warps} maxnreg {t.maxnreg or '-'}"
                    _line(name, kern, what, _ms(fn), nbytes)
            finally:
                table[128] = shipped


def parse_tuning(text: str) -> dict:
    """``"load_batch=2,load_ahead=1"`` -> {"load_batch": 2, "load_ahead": 1}."""
    return {f: int(v) for f, v in (kv.split("=") for kv in text.split(","))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="mixtral,dsv3")
    ap.add_argument("--kernels", default="swiglu,dispatch,combine")
    ap.add_argument("--variants", default="all",
                    help=f"'all' or names of {list(VARIANTS)} (comma-separated)")
    ap.add_argument("--module", default="moe_mxfp8.kernels.datapath_triton")
    ap.add_argument("--parts", action="store_true",
                    help="also the shipped SwiGLU tiling with one kind of output at a time")
    ap.add_argument("--once", action="store_true", help="one launch of each kernel (profilers)")
    ap.add_argument("--quantizer-tunings", default="",
                    help="the quantizer tile at these tunings too: space-separated, each "
                         "'field=int,...' of QuantConfig's tuning fields")
    ap.add_argument("--align", type=int, default=128,
                    help="rows every expert group is padded to (128: the 1x128 layout)")
    args = ap.parse_args()
    names = None if args.variants == "all" else args.variants.split(",")
    if names and (bad := [n for n in names if n not in VARIANTS]):
        ap.error(f"unknown variants {bad}; known: {list(VARIANTS)}")
    K = importlib.import_module(args.module)
    torch.manual_seed(0)
    for name in args.shapes.split(","):
        sweep(K, name, args.kernels.split(","), args.parts, args.once, names,
              [parse_tuning(p) for p in args.quantizer_tunings.split()], args.align)


if __name__ == "__main__":
    main()
