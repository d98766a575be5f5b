"""Persistent compiled-kernel cache: each compiled CuTeDSL function is exported once as an
object file (host launcher with the cubin embedded, ``dump_to_object``) and later processes load
it with ``cutlass.cute.runtime.load_module`` instead of tracing and compiling it again.

Location: ``$MOE_MXFP8_CACHE_DIR``, else ``$XDG_CACHE_HOME/moe_mxfp8``, else
``~/.cache/moe_mxfp8``; ``MOE_MXFP8_DISABLE_CACHE=1`` turns it off (in-process caching stays).

An entry's identity is the SHA-256 of: the kernel family, ``repr(key)`` (config, static sizes,
arch), the CuTeDSL version, a hash of the kernel and ``moe_mxfp8`` sources, the host platform
and the CuTeDSL environment variables that change the generated code. Any change gives a new
entry (the old one is simply no longer read; `clear` removes them all). Per entry, in
``kernels-v1/``:

* ``<digest>.json``: the full key text, the object file's name and SHA-256 (the commit point);
* ``<digest>-<sha>.o``: the object file, named by its content;
* ``<digest>-<sha>.so``: the same object linked into a shared library (`native.link_shared`),
  which later processes call through ``ctypes`` without importing CuTeDSL (`native.NativeKernel`;
  without a C compiler the entry has none and loads through CuTeDSL);
* ``<digest>.lock``: ``flock``-ed while one process builds, so concurrent processes compile a
  kernel once and the others load it.

Files are written to a temporary name and ``os.replace``-d (readers never see a partial file).
An entry that fails any check (unreadable JSON, another key, missing object, checksum, loader
error) is ignored, removed and rebuilt. The cache is bypassed while CuTeDSL is asked for
compile artifacts (``CUTE_DSL_KEEP`` and friends), which a loaded entry cannot produce.

`CompileCache` is the in-process layer above the entries: one per kernel family, keyed by
one hashable object. Kernels it returns take the launch arguments of `native` (`native.Ptr`,
ints, `native.Stream`), whether they were compiled in this process, loaded through CuTeDSL or
loaded natively.

This module imports no CuTeDSL at import time (its logic is tested without it).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Hashable
from pathlib import Path

from . import native

ENV_DIR = "MOE_MXFP8_CACHE_DIR"
ENV_DISABLE = "MOE_MXFP8_DISABLE_CACHE"
ENV_NATIVE = "MOE_MXFP8_NATIVE_LAUNCH"
SUBDIR = "kernels-v1"  # bump when the entry format changes
# CuTeDSL settings that change the generated code (the DSL's own ``affects_compile`` list)
COMPILE_ENV = (
    "CUTE_DSL_ARCH", "CUTE_DSL_DEBUG", "CUTE_DSL_LINEINFO", "CUTE_DSL_COMPILER_OPT",
    "CUTE_DSL_COMPILER_BACKEND", "CUTE_DSL_ENABLE_ASSERTIONS", "CUTE_DSL_ENABLE_PYIR",
    "CUTE_DSL_AUTO_M2S", "CUTE_DSL_TOLERATE_M2M", "CUTE_DSL_ENABLE_TVM_FFI",
    "CUTE_DSL_LOC_TRACEBACKS", "CUTE_DSL_WARNINGS_AS_ERRORS", "CUTE_DSL_LIBS",
)
# settings under which the caller expects the compiler to run (artifact files, printed IR)
ARTIFACT_ENV = (
    "CUTE_DSL_KEEP", "CUTE_DSL_KEEP_IR", "CUTE_DSL_KEEP_PTX", "CUTE_DSL_KEEP_CUBIN",
    "CUTE_DSL_KEEP_SASS", "CUTE_DSL_PRINT_IR", "CUTE_DSL_DRYRUN",
)
FALSE_WORDS = ("", "0", "false", "no", "off")
FILE_MODE = 0o644

_warned: set[str] = set()


# Archs the kernels are built for; CUTE_DSL_ARCH overrides (compile without a GPU).
ARCH_BY_BACKEND = {"sm90": "sm_90a", "sm100": "sm_100a"}
ARCH_ENV = "CUTE_DSL_ARCH"


def target_arch() -> str:
    """The arch string kernels compile for, which keys their cache entries: ``$CUTE_DSL_ARCH``,
    else GPU 0's -- what CuTeDSL compiles for (its default reads device 0, not the current
    device) -- or sm_100a without a GPU (the DSL's own default)."""
    env = os.environ.get(ARCH_ENV)
    return env if env else _default_arch()


@functools.cache
def _default_arch() -> str:
    import torch

    return device_arch(0) if torch.cuda.is_available() else "sm_100a"


@functools.cache
def device_arch(index: int) -> str:
    """The arch string of GPU ``index`` (``sm_90a``, ``sm_100a``, ...)."""
    import torch

    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}a"


def launch_arch(device) -> str:
    """`target_arch`, checked against the GPU a kernel is about to run on (``device``, a
    ``torch.device``): a GPU of another arch than GPU 0 cannot run what CuTeDSL compiled (and
    its loader loads every kernel onto every GPU), so it is refused with a clear error rather
    than keyed and launched as if it were GPU 0. ``$CUTE_DSL_ARCH`` is taken as given."""
    arch = target_arch()
    if device.type == "cuda" and not os.environ.get(ARCH_ENV):
        found = device_arch(device.index)
        if found != arch:
            raise RuntimeError(
                f"moe_mxfp8: {device} is {found} but the kernels compile for GPU 0's {arch}; "
                "GPUs of different architectures in one process are not supported (select "
                "one kind with CUDA_VISIBLE_DEVICES)")
    return arch


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(f"moe_mxfp8 kernel cache: {msg}", RuntimeWarning, stacklevel=4)


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in FALSE_WORDS


def cache_dir() -> Path:
    """The cache root (whether or not the cache is enabled)."""
    env = os.environ.get(ENV_DIR)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "moe_mxfp8"


def enabled() -> bool:
    """Whether compiled kernels are read from / written to disk now."""
    return not _env_true(ENV_DISABLE) and not any(_env_true(v) for v in ARTIFACT_ENV)


@functools.cache
def source_digest() -> str:
    """SHA-256 over the kernel sources (every ``*.py`` of this package and its subpackages: the
    kernels import nothing from the API above them, so these are all the sources a compiled
    kernel depends on): editing any of them invalidates every entry."""
    base = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for f in sorted(base.rglob("*.py")):
        h.update(f.relative_to(base).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


@functools.cache
def dsl_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("nvidia-cutlass-dsl")
    except metadata.PackageNotFoundError:
        import cutlass

        return str(getattr(cutlass, "__version__", "unknown"))


def key_text(name: str, key) -> str | None:
    """The full description an entry is stored under, or None when ``repr(key)`` is not stable
    across processes (an object repr with an address)."""
    r = repr(key)
    if " at 0x" in r:
        return None
    env = ";".join(f"{v}={os.environ[v]}" for v in COMPILE_ENV if v in os.environ)
    return "\n".join([
        f"{SUBDIR} {name}", f"key={r}", f"cutedsl={dsl_version()}", f"src={source_digest()}",
        f"host={platform.system()}-{platform.machine()}", f"env={env}",
    ])


def _dump_cutedsl(fn, prefix: str) -> bytes:
    return fn.dump_to_object(prefix)


def _load_cutedsl(path: Path, prefix: str):
    from cutlass.cute.runtime import load_module

    return load_module(str(path))[prefix]


def _native_facts(fn) -> dict:
    """What `native.NativeKernel` needs besides the library: the exported function's name and
    CuTeDSL's runtime library (read from the compiling process, which imported CuTeDSL)."""
    from cutlass.runtime import find_runtime_libraries

    libs = [p for p in find_runtime_libraries(enable_tvm_ffi=False)
            if p.endswith(native.RUNTIME_LIB)]
    name = getattr(fn, "function_name", None)
    if not libs or not name:
        return {}
    return {"function": name, "runtime": libs[0]}


def _load_native(path: Path, prefix: str, meta: dict):
    runtime = meta["runtime"] if Path(meta["runtime"]).is_file() else native.runtime_library()
    if runtime is None:
        raise FileNotFoundError(native.RUNTIME_LIB)
    return native.NativeKernel(path, prefix, meta["function"], runtime)


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, FILE_MODE)  # mkstemp makes 0600; entries are as readable as the dir
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive ``flock`` on ``path`` (released by the OS if the process dies). Where locking
    is unavailable (not POSIX, a file system without locks) it is skipped: the atomic writes
    alone keep readers safe, concurrent processes may then both compile."""
    fd = None
    try:
        import fcntl

        fd = os.open(path, os.O_RDWR | os.O_CREAT, FILE_MODE)
        fcntl.flock(fd, fcntl.LOCK_EX)
    except (ImportError, OSError):
        pass
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # closing drops the lock


class Entry:
    """One kernel's place in the cache. ``dump(fn, prefix) -> bytes`` and
    ``load(path, prefix) -> fn`` default to CuTeDSL's object-file export and loader."""

    def __init__(self, root: Path, name: str, text: str,
                 dump: Callable | None = None, load: Callable | None = None) -> None:
        # the native (ctypes) form exists for CuTeDSL's own exporter only
        self.native = dump is None and load is None
        self.text = text
        self.digest = hashlib.sha256(text.encode()).hexdigest()
        stem = f"{name}-{self.digest[:32]}"
        self.dir = root / SUBDIR
        self.meta = self.dir / f"{stem}.json"
        self.lock = self.dir / f"{stem}.lock"
        self.stem = stem
        self.prefix = f"moe_mxfp8_{self.digest[:16]}"  # symbol prefix inside the object file
        self._dump = dump or _dump_cutedsl
        self._load = load or _load_cutedsl

    def get_or_build(self, build: Callable):
        """``(fn, "loaded" | "compiled")``: the stored kernel, else ``build()``'s (then stored)."""
        fn = self.try_load(discard=False)
        if fn is not None:
            return fn, "loaded"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            _warn_once(f"cannot use {self.dir} ({e}); compiling without it")
            return build(), "compiled"
        with _file_lock(self.lock):
            # another process may have built it while this one waited for the lock
            fn = self.try_load(discard=True)
            if fn is not None:
                return fn, "loaded"
            fn = build()
            meta = self.store(fn)
            if meta is not None and meta.get("shared") and native_enabled():
                # launched from here on as the next process will launch it: natively, a few
                # microseconds of host time where CuTeDSL's own call converts every argument
                # (about 100 us a launch on a slow host)
                fn = self._try_native(meta) or fn
        return fn, "compiled"

    def try_load(self, discard: bool):
        """The stored kernel, or None (absent or failing a check; ``discard``: then removed)."""
        try:
            meta = json.loads(self.meta.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            meta = None
        obj = None
        try:
            if not isinstance(meta, dict) or meta.get("key") != self.text:
                raise ValueError("entry describes another key")
            obj = self.dir / meta["object"]
            if self.native and meta.get("shared") and native_enabled():
                fn = self._try_native(meta)
                if fn is not None:
                    return fn
            data = obj.read_bytes()
            if hashlib.sha256(data).hexdigest() != meta["sha256"]:
                raise ValueError("object file checksum mismatch")
            fn = self._load(obj, self.prefix)
            if fn is None:
                raise ValueError("loader returned nothing")
            return fn
        except Exception:  # noqa: BLE001  (any bad entry is rebuilt, never trusted)
            if discard:
                shared = meta.get("shared") if isinstance(meta, dict) else None
                for p in (self.meta, obj, self.dir / shared if shared else None):
                    if p is not None:
                        with contextlib.suppress(OSError):
                            p.unlink()
            return None

    def _try_native(self, meta: dict):
        """The native form of the entry, or None: a checksum mismatch or a loader error falls
        back to CuTeDSL's loader of the object file (warned once), never to a wrong kernel."""
        try:
            lib = self.dir / meta["shared"]
            if hashlib.sha256(lib.read_bytes()).hexdigest() != meta["shared_sha256"]:
                raise ValueError("shared library checksum mismatch")
            return _load_native(lib, self.prefix, meta)
        except Exception as e:  # noqa: BLE001
            _warn_once(f"native load failed ({type(e).__name__}: {e}); using CuTeDSL's loader")
            return None

    def store(self, fn) -> dict | None:
        """Write ``fn``'s object file, then the metadata that commits it; returns that metadata
        (None: not stored). Failures only warn."""
        try:
            data = self._dump(fn, self.prefix)
        except Exception as e:  # noqa: BLE001  (an unexportable function stays in memory only)
            _warn_once(f"cannot export a compiled kernel ({type(e).__name__}: {e})")
            return None
        sha = hashlib.sha256(data).hexdigest()
        obj = self.dir / f"{self.stem}-{sha[:16]}.o"
        meta = {"key": self.text, "object": obj.name, "sha256": sha, "bytes": len(data)}
        try:
            _write_atomic(obj, data)
            if self.native:
                meta.update(self._store_shared(fn, data, sha))
            _write_atomic(self.meta, json.dumps(meta, indent=1).encode())
        except OSError as e:
            _warn_once(f"cannot write to {self.dir} ({e})")
            return None
        return meta

    def _store_shared(self, fn, data: bytes, sha: str) -> dict:
        """The shared-library form of the object (``{}`` when it cannot be made)."""
        try:
            facts = _native_facts(fn)
        except Exception:  # noqa: BLE001  (no native form: CuTeDSL's loader still works)
            return {}
        lib = self.dir / f"{self.stem}-{sha[:16]}.so"
        if not facts or not native.link_shared(data, lib):
            return {}
        lib_sha = hashlib.sha256(lib.read_bytes()).hexdigest()
        return {"shared": lib.name, "shared_sha256": lib_sha, **facts}


FACTS_FILE = "device-facts.json"


def device_fact(name: str, compute: Callable[[], int]) -> int:
    """A number about this machine's GPU that only changes with the hardware (``name`` says
    which, e.g. the GPU's UUID): read from the cache directory, else ``compute()``-d and kept
    there (while the cache is enabled)."""
    if not enabled():
        return compute()
    d = cache_dir() / SUBDIR
    path = d / FACTS_FILE
    try:
        facts = json.loads(path.read_text())
        if isinstance(facts, dict) and isinstance(facts.get(name), int):
            return facts[name]
    except (OSError, ValueError):
        pass
    value = int(compute())
    try:
        d.mkdir(parents=True, exist_ok=True)
        with _file_lock(d / (FACTS_FILE + ".lock")):
            try:
                facts = json.loads(path.read_text())
                facts = facts if isinstance(facts, dict) else {}
            except (OSError, ValueError):
                facts = {}
            facts[name] = value
            _write_atomic(path, json.dumps(facts, indent=1, sort_keys=True).encode())
    except OSError as e:
        _warn_once(f"cannot write to {d} ({e})")
    return value


def native_enabled() -> bool:
    """Whether stored kernels are called through ``ctypes`` (``MOE_MXFP8_NATIVE_LAUNCH=0``: through
    CuTeDSL's loader, as before)."""
    return os.environ.get(ENV_NATIVE, "1").strip().lower() not in FALSE_WORDS


def entry(name: str, key, **kw) -> Entry | None:
    """The on-disk entry for ``(name, key)``, or None while the cache is off or the key cannot
    be stored (see `key_text`)."""
    if not enabled():
        return None
    text = key_text(name, key)
    if text is None:
        return None
    return Entry(cache_dir(), name, text, **kw)


def clear(root: Path | None = None) -> int:
    """Remove every stored entry; returns the number of files removed."""
    d = (root or cache_dir()) / SUBDIR
    n = 0
    if d.is_dir():
        for p in d.iterdir():
            with contextlib.suppress(OSError):
                p.unlink()
                n += 1
    return n


# ---------------------------------------------------------------------------------------------
# In-process layer
# ---------------------------------------------------------------------------------------------


class CompileCache:
    """Compiled kernels keyed by one hashable object (dtypes, config, arch, static sizes), kept
    in this process and, through `entry`, on disk for the next process.

    Never key on data values: token counts stay symbolic in the compiled code. ``name`` (the
    kernel family) namespaces the on-disk entries; the key's ``repr`` must describe the compiled
    code completely (frozen dataclasses, dtypes, strings and ints do). ``cute``: ``build``
    returns a CuTeDSL compiled function, which is adapted to the launch arguments of `native`
    (`native.CuteKernel`) unless it was loaded natively.
    """

    def __init__(self, name: str = "kernel", cute: bool = False) -> None:
        self.name = name
        self.cute = cute
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
                    disk = entry(self.name, key) if persist else None
                    if disk is None:
                        fn, how = build(), "compiled"
                    else:
                        fn, how = disk.get_or_build(build)
                    if self.cute and not isinstance(fn, native.NativeKernel):
                        fn = native.CuteKernel(fn)
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
