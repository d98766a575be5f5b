"""Calling a cached compiled kernel without importing CuTeDSL.

A kernel compiled by CuTeDSL and exported with ``dump_to_object`` is a relocatable object: the
host launch function with the cubin embedded, whose only undefined symbols are CUDA runtime
entry points that CuTeDSL's ``libcute_dsl_runtime.so`` exports. `link_shared` turns it into a
shared library once (with the C compiler Triton also needs); `NativeKernel` loads that library
with ``ctypes`` and calls it directly -- no ``import cutlass`` (about a second of a new
process's first step; docs/design/compile_cache.md).

Calling convention (the one CuTeDSL's C-header generator writes, for the prefix ``P`` given at
export): ``_mlir_P_cuda_init(void **{&library_ptr, &err})`` once, then
``_mlir_P_cuda_load_to_device(void **{&library_ptr, &device, &err})`` for every device, then
per launch ``_mlir_P__mlir_ciface_<function>(void **args, int32 n)`` with ``args`` the addresses
of each argument's C value -- a pointer argument: a ``void *``; ``Int32``: an ``int32_t``; the
stream: a ``cudaStream_t`` -- followed by the address of the ``int32_t`` CUDA result.

Launch arguments, for `NativeKernel` and for `CuteKernel` (a function compiled or loaded by
CuTeDSL in this process) alike: `Ptr` (dtype name, address, alignment), a Python ``int`` (an
``Int32``) and `Stream`.
This module imports neither CuTeDSL nor ``moe_mxfp8``.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import NamedTuple

RUNTIME_LIB = "libcute_dsl_runtime.so"
# dtype names of `Ptr` (torch's names) -> CuTeDSL's numeric types (`common.TORCH_TO_CUTLASS`)
CUTLASS_TYPE_NAMES = {
    "bfloat16": "BFloat16", "float16": "Float16", "float32": "Float32",
    "float8_e4m3fn": "Float8E4M3FN", "uint8": "Uint8", "int32": "Int32",
}
ELF_MAGIC = b"\x7fELF"


# Launch arguments are named tuples: made per argument of every launch, a frozen dataclass's
# field-by-field ``__init__`` cost twice the time (measured)


class Ptr(NamedTuple):
    """A device pointer argument: element dtype name (``"float8_e4m3fn"``, ``"uint8"``,
    ``"int32"``, ``"bfloat16"``, ...), address, assumed byte alignment."""

    dtype: str
    addr: int
    align: int = 16


class Stream(NamedTuple):
    """The CUDA stream argument (a ``cudaStream_t`` handle as an int)."""

    handle: int


def cu_stream(stream: Stream):
    """``stream`` as CuTeDSL's stream argument (a ``cuda.bindings`` CUstream; imports it)."""
    import cuda.bindings.driver as cuda

    return cuda.CUstream(stream.handle)


def current_stream(device) -> Stream:
    """torch's current CUDA stream of ``device`` (a ``torch.device`` or an index: the operands'
    GPU, never the current device's, which may be another GPU). Read as the raw handle:
    ``torch.cuda.current_stream`` builds a Python stream object per call, 8 us of host time
    inside a layer step on an H100 host against 0.1 us (13 launches a step; measured)."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # absent from CPU-only builds
    if raw is None:
        return Stream(torch.cuda.current_stream(device).cuda_stream)
    index = device if isinstance(device, int) else device.index
    if index is None:
        index = torch.cuda.current_device()
    return Stream(raw(index))


def c_compiler() -> str | None:
    """The C compiler used to link cached objects: ``$CC``, else cc / gcc / clang on PATH
    (Triton, which runs the data path, needs one too)."""
    cc = os.environ.get("CC")
    if cc and shutil.which(cc):
        return shutil.which(cc)
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


def link_shared(obj: bytes, out: Path, timeout: float = 60.0) -> bool:
    """Link the exported object ``obj`` into the shared library ``out`` (written whole or not
    at all). False when no C compiler is found or the link fails: the caller then keeps using
    CuTeDSL's own loader."""
    cc = c_compiler()
    if cc is None or obj[:4] != ELF_MAGIC:
        return False
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".link.") as tmp:
        src, dst = Path(tmp) / "kernel.o", Path(tmp) / "kernel.so"
        src.write_bytes(obj)
        try:
            res = subprocess.run([cc, "-shared", "-o", str(dst), str(src)],
                                 capture_output=True, timeout=timeout)
        except (OSError, subprocess.SubprocessError):
            return False
        if res.returncode != 0 or not dst.is_file():
            return False
        os.chmod(dst, 0o644)
        os.replace(dst, out)
    return True


def runtime_library() -> str | None:
    """Path of CuTeDSL's ``libcute_dsl_runtime.so`` found without importing CuTeDSL (the
    installed distribution's file list), or None."""
    from importlib import metadata

    try:
        files = metadata.files("nvidia-cutlass-dsl-libs-base") or []
        files = list(files) + list(metadata.files("nvidia-cutlass-dsl") or [])
    except metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.name == RUNTIME_LIB and "stubs" not in f.parts:
            path = Path(f.locate())
            if path.is_file():
                return str(path)
    return None


_runtime_handles: dict[str, ctypes.CDLL] = {}
_runtime_lock = threading.Lock()


def load_runtime(path: str) -> None:
    """Load CuTeDSL's runtime library globally (once): the kernels' undefined CUDA symbols
    resolve against it."""
    with _runtime_lock:
        if path not in _runtime_handles:
            _runtime_handles[path] = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


INT32_RANGE = (-(2**31), 2**31 - 1)  # an ``Int32`` launch argument (sizes, counts, offsets)


def int32_arg(value: int) -> int:
    """``value`` as an ``Int32`` launch argument, or one error line: a size that does not fit
    would wrap in the C call and the kernel would address the wrong bytes."""
    lo, hi = INT32_RANGE
    if not lo <= value <= hi:
        raise ValueError(f"moe_mxfp8: kernel argument {value} does not fit a 32-bit integer "
                         f"(the kernels' limit is 2^31 - 1); split the problem into smaller calls")
    return value


def _packed(values: list) -> ctypes.Array:
    arr = (ctypes.c_void_p * len(values))()
    for i, v in enumerate(values):
        arr[i] = ctypes.cast(ctypes.pointer(v), ctypes.c_void_p)
    return arr


SLOT_BYTES = 8  # one launch argument's cell: a pointer, a stream handle or an int32
INT32_MASK = 0xFFFFFFFF


def _slot(a) -> int:
    """A launch argument as its 8-byte cell's value: an ``int32_t`` lives in the low half
    (little-endian; an int that does not fit is refused by `int32_arg`)."""
    if isinstance(a, Ptr):
        return a.addr
    if isinstance(a, Stream):
        return a.handle
    if isinstance(a, int):
        return int32_arg(a) & INT32_MASK
    raise TypeError(f"unsupported kernel argument {a!r}")


_THREAD_CELLS = threading.local()


def _launch_cells(n: int):
    """This thread's ``n`` argument cells and the array of their addresses, made once per
    ``n``: the launch reads them only during the call (which copies the arguments into the
    launch), and a thread makes one call at a time."""
    made = getattr(_THREAD_CELLS, "by_count", None)
    if made is None:
        made = _THREAD_CELLS.by_count = {}
    pair = made.get(n)
    if pair is None:
        cells = (ctypes.c_uint64 * n)()
        base = ctypes.addressof(cells)
        addresses = (ctypes.c_void_p * n)(*range(base, base + SLOT_BYTES * n, SLOT_BYTES))
        pair = made[n] = (cells, addresses)
    return pair


def _int32(v: int) -> int:
    v &= INT32_MASK
    return v - (1 << 32) if v >> 31 else v


class NativeKernel:
    """A cached kernel called through ``ctypes`` (see the module docstring).

    ``lib``: the shared library; ``prefix``: its symbol prefix; ``function``: the exported
    host function's name (the ciface symbol's tail); ``runtime``: CuTeDSL's runtime library.
    The CUDA library is loaded on the first call, for every device (as CuTeDSL does)."""

    def __init__(self, lib: Path, prefix: str, function: str, runtime: str) -> None:
        if sys.byteorder != "little":  # the argument cells hold int32 values in their low half
            raise OSError("native launches need a little-endian host")
        load_runtime(runtime)
        self.path = str(lib)
        self._lib = ctypes.CDLL(self.path)
        self.prefix = prefix
        self._entry = self._symbol(f"_mlir_{prefix}__mlir_ciface_{function}")
        self._entry.restype = None
        self._entry.argtypes = [ctypes.c_void_p, ctypes.c_int32]
        self._init = self._symbol(f"_mlir_{prefix}_cuda_init")
        self._load = self._symbol(f"_mlir_{prefix}_cuda_load_to_device")
        for f in (self._init, self._load):
            f.restype = None
            f.argtypes = [ctypes.c_void_p]
        self._loaded = False
        self._lock = threading.Lock()
        self._keep: list = []  # the library handle's cell must outlive every launch

    def _symbol(self, name: str):
        try:
            return getattr(self._lib, name)
        except AttributeError as e:
            raise ValueError(f"{self.path} has no symbol {name}") from e

    def _ensure_loaded(self) -> None:
        with self._lock:
            if self._loaded:
                return
            import torch

            library = ctypes.c_void_p()
            lib_ptr = ctypes.pointer(library)
            err = ctypes.c_int32(0)
            self._init(_packed([lib_ptr, err]))
            _check(err.value, "loading the kernel library")
            device = ctypes.c_int32(0)
            for d in range(torch.cuda.device_count()):
                device.value = d
                self._load(_packed([lib_ptr, device, err]))
                _check(err.value, f"loading the kernel on device {d}")
            self._keep = [library, lib_ptr]
            self._loaded = True

    def __call__(self, *args) -> None:
        if not self._loaded:
            self._ensure_loaded()
        # one 8-byte cell per argument and one for the int32 CUDA result, written into this
        # thread's cells for the argument count (a ctypes object and a pointer cast per
        # argument cost 10x the host time; two new ctypes arrays per launch, 2x; measured)
        n = len(args) + 1
        cells, addresses = _launch_cells(n)
        cells[:] = [*map(_slot, args), 0]
        self._entry(addresses, n)
        _check(_int32(cells[n - 1]), "launching the kernel")


class CuteKernel:
    """A CuTeDSL compiled function called with this module's launch arguments, like a
    `NativeKernel` (CuTeDSL is imported: the function came from it). ``fn``: the compiled
    function itself (``kernel_info``, export)."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __getattr__(self, name):
        return getattr(self.fn, name)

    def __call__(self, *args):
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_ptr

        conv = []
        for a in args:
            if isinstance(a, Ptr):
                dtype = getattr(cutlass, CUTLASS_TYPE_NAMES[a.dtype])
                conv.append(make_ptr(dtype, a.addr, cute.AddressSpace.gmem,
                                     assumed_align=a.align))
            elif isinstance(a, Stream):
                conv.append(cu_stream(a))
            elif isinstance(a, int):
                conv.append(cutlass.Int32(int32_arg(a)))
            else:
                conv.append(a)  # already a CuTeDSL value
        return self.fn(*conv)


def _check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"moe_mxfp8: CUDA error {code} {what}")
