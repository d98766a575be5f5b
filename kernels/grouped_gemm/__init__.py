"""Grouped MXFP8 GEMMs, one package for every arch.

* `problem` -- the vocabulary (M-/K-grouped, scale-block choice), the problem description and
  the only operand checks, output allocation, K-grouped group alignment and the packed
  scale-tile address (`problem.scale_tile_index`). Pure PyTorch: importing it imports neither
  CuTeDSL nor the API above this package.
* `schedule` -- the device tile walk over ``offs`` (`GroupedTileSchedule`) used by every arch.
* `base` -- what the arch kernels share on the host side of their ``@cute.jit`` (launch
  signature, GEMM views, shape checks).
* `host` -- the host-side decisions every arch shares (checks, cluster shape, grid bound),
  without CuTeDSL.
* `launcher` -- describe -> align -> config -> compile (cached) -> launch, given an arch's host
  class; no CuTeDSL (a cached kernel launches through `native`).
* `sm90_config` / `sm100_config` -- per arch: the config dataclass and its heuristics (the
  host class), no CuTeDSL; `sm90` / `sm100` -- the kernel classes (CuTeDSL).

Nothing here imports `moe_mxfp8` (the API imports this package, never the reverse).
"""
