"""Pieces every CuTeDSL kernel of moe_mxfp8 shares: target arch, compile cache, tensor/stream
conversion, the torch -> CuTeDSL dtype map and the device mirror of the packed scale offset.

Imports CuTeDSL (``cutlass``); kernel modules import this, `moe_mxfp8.kernels` does not.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Hashable

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32

from . import compile_cache
from .mx_format import TILE_BLOCKS, TILE_BYTES, TILE_ROWS

# Archs the kernels are built for; CUTE_DSL_ARCH overrides (compile without a GPU).
ARCH_BY_BACKEND = {"sm90": "sm_90a", "sm100": "sm_100a"}
ARCH_ENV = "CUTE_DSL_ARCH"



def target_arch() -> str:
    """The arch string kernels compile for: ``$CUTE_DSL_ARCH``, else the current GPU's."""
    env = os.environ.get(ARCH_ENV)
    if env:
        return env
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"sm_{major}{minor}a"
    return "sm_100a"  # the DSL's own default without a GPU


@cute.jit
def packed_scale_offset(r: Int32, c: Int32, num_blocks: Int32) -> Int32:
    """Device mirror of `mx_format.packed_scale_offset` (the contract's formula)."""
    tiles_per_row_tile = (num_blocks + (TILE_BLOCKS - 1)) // TILE_BLOCKS
    tile = (r // TILE_ROWS) * tiles_per_row_tile + c // TILE_BLOCKS
    return (
        tile * TILE_BYTES
        + (r % 32) * 16
        + ((r % TILE_ROWS) // 32) * 4
        + c % TILE_BLOCKS
    )


class CompileCache:
    """Compiled kernels keyed by one hashable object (dtypes, config, arch, static sizes), kept
    in this process and, through `compile_cache`, on disk for the next process.

    Never key on data values: token counts stay symbolic in the compiled code. ``name`` (the
    kernel family) namespaces the on-disk entries; the key's ``repr`` must describe the compiled
    code completely (frozen dataclasses, dtypes, strings and ints do).
    """

    def __init__(self, name: str = "kernel") -> None:
        self.name = name
        self._fns: dict[Hashable, Callable] = {}
        self._lock = threading.Lock()
        # how each key was obtained in this process: ("compiled" | "loaded", seconds)
        self.events: dict[Hashable, tuple[str, float]] = {}
        _CACHES.append(self)

    def get(self, key: Hashable, build: Callable[[], Callable], *, persist: bool = True):
        """The compiled function for ``key``: from memory, else from the persistent cache, else
        ``build()`` (which is then stored there). ``persist=False``: this process only."""
        fn = self._fns.get(key)
        if fn is None:
            with self._lock:
                fn = self._fns.get(key)
                if fn is None:
                    t0 = time.perf_counter()
                    hook = _progress_hook[0]
                    if hook is not None:
                        hook("start", self.name, key)
                    disk = compile_cache.entry(self.name, key) if persist else None
                    if disk is None:
                        fn, how = build(), "compiled"
                    else:
                        fn, how = disk.get_or_build(build)
                    sec = time.perf_counter() - t0
                    self.events[key] = (how, sec)
                    self._fns[key] = fn
                    if hook is not None:
                        hook(how, self.name, key, sec)
        return fn

    def clear(self) -> None:
        """Forget this process's compiled functions (the on-disk entries stay)."""
        with self._lock:
            self._fns.clear()
            self.events.clear()

    def __len__(self) -> int:
        return len(self._fns)


_CACHES: list[CompileCache] = []
# called as hook("start", name, key) before a kernel is loaded or compiled and as
# hook("compiled" | "loaded", name, key, seconds) after (`moe_mxfp8.precompile`'s progress line)
_progress_hook: list[Callable | None] = [None]


def set_progress_hook(hook: Callable | None) -> Callable | None:
    """Install ``hook`` (None: none); returns the previous one."""
    prev, _progress_hook[0] = _progress_hook[0], hook
    return prev


def compile_events() -> list[tuple[str, Hashable, str, float]]:
    """Every kernel this process obtained: (cache name, key, "compiled" | "loaded", seconds)."""
    return [(c.name, k, how, sec) for c in _CACHES for k, (how, sec) in list(c.events.items())]


TORCH_TO_CUTLASS = {
    torch.bfloat16: cutlass.BFloat16,
    torch.float16: cutlass.Float16,
    torch.float32: cutlass.Float32,
    torch.float8_e4m3fn: cutlass.Float8E4M3FN,
    torch.uint8: cutlass.Uint8,
    torch.int32: cutlass.Int32,
}


def to_cute(t: torch.Tensor, assumed_align: int = 16):
    """A torch CUDA tensor as a CuTe tensor (dynamic layout, 16-byte aligned base)."""
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(t, assumed_align=assumed_align)


def current_stream():
    """The current torch CUDA stream as a CUstream."""
    import cuda.bindings.driver as cuda

    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)
