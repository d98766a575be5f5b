"""CuTeDSL (and Triton) kernels of moe_mxfp8, installed as ``moe_mxfp8.kernels``.

The layer below the API: nothing here imports `moe_mxfp8`. Importing this package is cheap;
CuTeDSL is imported only by the kernel modules, which the launchers import where a kernel is
compiled; a kernel loaded from the compile cache runs without CuTeDSL (`native`).

* `mx_format` -- the format's constants, scale-block vocabulary and packed-layout arithmetic.
* `grouped_gemm` -- the grouped MXFP8 GEMMs (problem, schedule, launcher, one file per arch).
* `quantize` -- the MXFP8 quantizer kernels (one SIMT source for both archs); their
  configuration in `quantize_config`, entry points and compile cache in `quantize_launch`.
* `datapath_triton` -- the MoE data path (dispatch, SwiGLU, combine) in Triton.
* `compile_cache`, `native` -- target arch, compile cache (memory and disk), and the launch of
  a cached kernel through ``ctypes`` without importing CuTeDSL; `common` -- CuTeDSL interop.
"""
