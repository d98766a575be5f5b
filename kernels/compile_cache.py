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
* ``<digest>.lock``: ``flock``-ed while one process builds, so concurrent processes compile a
  kernel once and the others load it.

Files are written to a temporary name and ``os.replace``-d (readers never see a partial file).
An entry that fails any check (unreadable JSON, another key, missing object, checksum, loader
error) is ignored, removed and rebuilt. The cache is bypassed while CuTeDSL is asked for
compile artifacts (``CUTE_DSL_KEEP`` and friends), which a loaded entry cannot produce.

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
import warnings
from collections.abc import Callable
from pathlib import Path

ENV_DIR = "MOE_MXFP8_CACHE_DIR"
ENV_DISABLE = "MOE_MXFP8_DISABLE_CACHE"
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
            self.store(fn)
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
            data = obj.read_bytes()
            if hashlib.sha256(data).hexdigest() != meta["sha256"]:
                raise ValueError("object file checksum mismatch")
            fn = self._load(obj, self.prefix)
            if fn is None:
                raise ValueError("loader returned nothing")
            return fn
        except Exception:  # noqa: BLE001  (any bad entry is rebuilt, never trusted)
            if discard:
                for p in (self.meta, obj):
                    if p is not None:
                        with contextlib.suppress(OSError):
                            p.unlink()
            return None

    def store(self, fn) -> bool:
        """Write ``fn``'s object file, then the metadata that commits it. Failures only warn."""
        try:
            data = self._dump(fn, self.prefix)
        except Exception as e:  # noqa: BLE001  (an unexportable function stays in memory only)
            _warn_once(f"cannot export a compiled kernel ({type(e).__name__}: {e})")
            return False
        sha = hashlib.sha256(data).hexdigest()
        obj = self.dir / f"{self.stem}-{sha[:16]}.o"
        meta = {"key": self.text, "object": obj.name, "sha256": sha, "bytes": len(data)}
        try:
            _write_atomic(obj, data)
            _write_atomic(self.meta, json.dumps(meta, indent=1).encode())
        except OSError as e:
            _warn_once(f"cannot write to {self.dir} ({e})")
            return False
        return True


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
