"""CuTeDSL (and Triton) kernels of moe_mxfp8, installed as ``moe_mxfp8.kernels``.

The layer below the API: nothing here imports `moe_mxfp8`. Importing this package is cheap;
CuTeDSL is imported only by the kernel modules, which the API imports explicitly where a
kernel runs (e.g. ``from .kernels.grouped_gemm.sm90 import GroupedGemmSm90``).

* `mx_format` -- the format's constants, scale-block vocabulary and packed-layout arithmetic.
* `grouped_gemm` -- the grouped MXFP8 GEMMs (problem, schedule, launcher, one file per arch).
* `quantize` -- the MXFP8 quantizers (one SIMT source for both archs).
* `datapath_triton` -- the MoE data path (dispatch, SwiGLU, combine) in Triton.
* `common`, `compile_cache` -- target arch, compile cache (memory and disk), torch interop.
"""
