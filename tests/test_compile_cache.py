"""The persistent compiled-kernel cache (kernels/compile_cache.py, its native launch in
kernels/native.py) and `moe_mxfp8.precompile`.

CPU: keying, location and switches, atomic writes, concurrent processes (one build, the others
load), invalidation, corrupted entries (ignored and rebuilt) -- with a stand-in exporter so they
run in milliseconds -- and a real CuTeDSL round trip: a quantizer compiled for sm_90a in one
process is loaded, not compiled, by the next.
GPU: a second process runs `MXFP8MoE` forward+backward with every kernel loaded from the cache
(none traced) and gets the first process's results.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from moe_mxfp8.kernels import compile_cache as CC

import moe_mxfp8
from moe_mxfp8.precompile import warm_layer

ROOT = Path(__file__).resolve().parents[1]


def _env(**kw) -> dict:
    """This environment with the repository importable (kept: whatever else PYTHONPATH has)."""
    env = dict(os.environ, **kw)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    """A fresh cache directory, the cache on, no CuTeDSL artifact switches."""
    monkeypatch.setenv(CC.ENV_DIR, str(tmp_path / "cache"))
    monkeypatch.delenv(CC.ENV_DISABLE, raising=False)
    for v in CC.ARTIFACT_ENV:
        monkeypatch.delenv(v, raising=False)
    return tmp_path / "cache"


# A stand-in for CuTeDSL's exporter/loader: the "compiled function" is a string; its object
# file is its bytes. Module-level so that spawned processes can use them.
def fake_dump(fn, prefix):
    return f"{prefix}|{fn}".encode()


def fake_load(path, prefix):
    head, _, body = Path(path).read_bytes().decode().partition("|")
    if head != prefix:
        raise ValueError("not an object file of this entry")
    return body


def fake_entry(root, key="k", name="fam"):
    return CC.Entry(Path(root), name, CC.key_text(name, key), dump=fake_dump, load=fake_load)


def counting_build(log: Path, value: str, delay: float = 0.0):
    def build():
        time.sleep(delay)
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        return value
    return build


# ---------------------------------------------------------------------------------------------
# keying, location, switches
# ---------------------------------------------------------------------------------------------


def test_key_text_covers_every_part(cache_env, monkeypatch):
    base = CC.key_text("quantize", ("op", 1, torch.bfloat16, "sm_90a"))
    assert base is not None
    assert f"cutedsl={CC.dsl_version()}" in base and CC.source_digest() in base
    assert CC.key_text("quantize", ("op", 2, torch.bfloat16, "sm_90a")) != base  # static size
    assert CC.key_text("quantize", ("op", 1, torch.float16, "sm_90a")) != base  # dtype
    assert CC.key_text("quantize", ("op", 1, torch.bfloat16, "sm_100a")) != base  # arch
    assert CC.key_text("gemm", ("op", 1, torch.bfloat16, "sm_90a")) != base  # kernel family
    monkeypatch.setenv("CUTE_DSL_LINEINFO", "1")  # changes the generated code
    assert CC.key_text("quantize", ("op", 1, torch.bfloat16, "sm_90a")) != base
    monkeypatch.delenv("CUTE_DSL_LINEINFO")
    assert CC.key_text("quantize", ("op", 1, torch.bfloat16, "sm_90a")) == base
    # a key whose repr holds an address cannot name the same kernel in another process
    assert CC.key_text("quantize", (object(),)) is None


def test_key_text_is_the_same_in_another_process(cache_env):
    key = ("quantize_dual", 2048, torch.bfloat16, "sm_90a")
    code = ("import torch; from moe_mxfp8.kernels import compile_cache as CC; "
            f"print(CC.key_text('quantize', {key!r}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True, env=_env())
    assert out.stdout.strip() == CC.key_text("quantize", key)


def test_source_edit_invalidates(cache_env, monkeypatch, tmp_path):
    log = tmp_path / "builds"
    fn, how = fake_entry(cache_env).get_or_build(counting_build(log, "v1"))
    assert (fn, how) == ("v1", "compiled")
    assert fake_entry(cache_env).get_or_build(counting_build(log, "x"))[1] == "loaded"
    monkeypatch.setattr(CC, "source_digest", lambda: "edited-kernel-sources")
    fn, how = fake_entry(cache_env).get_or_build(counting_build(log, "v2"))
    assert (fn, how) == ("v2", "compiled")
    assert len(log.read_text().split()) == 2


def test_location_and_switches(tmp_path, monkeypatch):
    monkeypatch.delenv(CC.ENV_DIR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert CC.cache_dir() == tmp_path / "xdg" / "moe_mxfp8"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert CC.cache_dir() == Path.home() / ".cache" / "moe_mxfp8"
    monkeypatch.setenv(CC.ENV_DIR, str(tmp_path / "mine"))
    assert CC.cache_dir() == tmp_path / "mine"
    for v in CC.ARTIFACT_ENV:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.delenv(CC.ENV_DISABLE, raising=False)
    assert CC.enabled() and CC.entry("fam", "k") is not None
    for off in ("1", "true", "yes"):
        monkeypatch.setenv(CC.ENV_DISABLE, off)
        assert not CC.enabled() and CC.entry("fam", "k") is None
    monkeypatch.setenv(CC.ENV_DISABLE, "0")
    assert CC.enabled()
    # asking CuTeDSL for artifacts (cubin/PTX files) needs a real compile: bypassed
    monkeypatch.setenv("CUTE_DSL_KEEP", "cubin")
    assert not CC.enabled()


def test_compile_cache_memo_bypass_and_hook(cache_env, monkeypatch):
    monkeypatch.setattr(CC, "_dump_cutedsl", fake_dump)
    monkeypatch.setattr(CC, "_load_cutedsl", fake_load)
    calls = []
    prev = CC.set_progress_hook(lambda *a: calls.append(a[0]))
    try:
        c = CC.CompileCache("test_family")
        assert c.get(("a", 1), lambda: "A") == "A"
        assert c.get(("a", 1), lambda: pytest.fail("rebuilt an in-memory kernel")) == "A"
        assert c.events[("a", 1)][0] == "compiled"
        c2 = CC.CompileCache("test_family")  # a "new process": same family, empty memory
        assert c2.get(("a", 1), lambda: pytest.fail("rebuilt a stored kernel")) == "A"
        assert c2.events[("a", 1)][0] == "loaded"
        c3 = CC.CompileCache("test_family")
        assert c3.get(("a", 1), lambda: "fresh", persist=False) == "fresh"
        assert calls == ["start", "compiled", "start", "loaded", "start", "compiled"]
        assert ("test_family", ("a", 1), "loaded", c2.events[("a", 1)][1]) in \
            CC.compile_events()
    finally:
        CC.set_progress_hook(prev)
        for c_ in (c, c2, c3):
            CC._CACHES.remove(c_)


# ---------------------------------------------------------------------------------------------
# atomic writes, corruption
# ---------------------------------------------------------------------------------------------


def test_failed_write_leaves_old_file_and_no_temp(tmp_path, monkeypatch):
    target = tmp_path / "entry.json"
    target.write_bytes(b"old")

    def boom(fd):
        raise OSError("disk full")

    monkeypatch.setattr(CC.os, "fsync", boom)
    with pytest.raises(OSError):
        CC._write_atomic(target, b"new content")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry.json"]


def test_unwritable_cache_still_compiles(cache_env, tmp_path):
    cache_env.parent.mkdir(exist_ok=True)
    cache_env.write_text("a file where the cache directory should be")
    with pytest.warns(RuntimeWarning, match="kernel cache"):
        fn, how = fake_entry(cache_env).get_or_build(lambda: "v")
    assert (fn, how) == ("v", "compiled")


def test_file_system_without_locks_still_caches(cache_env, monkeypatch):
    import fcntl

    def no_locks(fd, op):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    assert fake_entry(cache_env).get_or_build(lambda: "v") == ("v", "compiled")
    assert fake_entry(cache_env).get_or_build(lambda: "x") == ("v", "loaded")


def _corrupt(entry: CC.Entry, how: str) -> None:
    meta = json.loads(entry.meta.read_text())
    obj = entry.dir / meta["object"]
    if how == "meta_garbage":
        entry.meta.write_bytes(b"\x00\xffnot json")
    elif how == "meta_truncated":
        entry.meta.write_text(entry.meta.read_text()[:20])
    elif how == "other_key":
        meta["key"] = "something else"
        entry.meta.write_text(json.dumps(meta))
    elif how == "object_missing":
        obj.unlink()
    elif how == "object_flipped":
        data = bytearray(obj.read_bytes())
        data[len(data) // 2] ^= 0xFF
        obj.write_bytes(bytes(data))
    elif how == "object_empty":
        obj.write_bytes(b"")
    elif how == "loader_rejects":  # checksum fine, content not loadable
        data = b"wrongprefix|v"
        obj.write_bytes(data)
        meta["sha256"] = CC.hashlib.sha256(data).hexdigest()
        entry.meta.write_text(json.dumps(meta))


@pytest.mark.parametrize("how", ["meta_garbage", "meta_truncated", "other_key", "object_missing",
                                 "object_flipped", "object_empty", "loader_rejects"])
def test_corrupted_entry_is_rebuilt(cache_env, tmp_path, how):
    log = tmp_path / "builds"
    e = fake_entry(cache_env)
    assert e.get_or_build(counting_build(log, "good")) == ("good", "compiled")
    _corrupt(e, how)
    assert fake_entry(cache_env).try_load(discard=False) is None
    fn, got = fake_entry(cache_env).get_or_build(counting_build(log, "rebuilt"))
    assert (fn, got) == ("rebuilt", "compiled")
    # the rebuilt entry is whole again
    assert fake_entry(cache_env).get_or_build(counting_build(log, "x")) == ("rebuilt", "loaded")
    assert len(log.read_text().split()) == 2


def test_clear(cache_env, tmp_path):
    fake_entry(cache_env, key="a").get_or_build(lambda: "a")
    fake_entry(cache_env, key="b").get_or_build(lambda: "b")
    assert CC.clear() >= 4  # two objects, two metadata files (+ locks)
    assert fake_entry(cache_env, key="a").try_load(discard=False) is None


# ---------------------------------------------------------------------------------------------
# concurrent processes
# ---------------------------------------------------------------------------------------------


def _worker(root: str, log: str, start_at: float, q) -> None:
    time.sleep(max(0.0, start_at - time.time()))  # all processes ask at the same moment
    fn, how = fake_entry(root, key="shared").get_or_build(
        counting_build(Path(log), "the-kernel", delay=0.5))
    q.put((fn, how))


def test_concurrent_processes_build_once(cache_env, tmp_path):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    log = tmp_path / "builds"
    start_at = time.time() + 3.0  # after every spawned interpreter is up
    procs = [ctx.Process(target=_worker, args=(str(cache_env), str(log), start_at, q))
             for _ in range(4)]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert {fn for fn, _ in results} == {"the-kernel"}
    assert sorted(how for _, how in results) == ["compiled", "loaded", "loaded", "loaded"]
    assert len(log.read_text().split()) == 1  # one process compiled, three waited and loaded
    leftovers = [p.name for p in (cache_env / CC.SUBDIR).iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []


# ---------------------------------------------------------------------------------------------
# CuTeDSL round trip (compile-only, CPU): export, then load in a new process without tracing
# ---------------------------------------------------------------------------------------------

ROUND_TRIP = textwrap.dedent(
    """
    import json, sys
    from moe_mxfp8.kernels import compile_cache, quantize_launch as Q
    cfg = Q.QuantConfig("bfloat16", "rceil", 256, True, True, grouping="offs")
    fn = Q.compile_quantizer("quantize_dual", cfg)
    (name, key, how, sec), = compile_cache.compile_events()
    info = getattr(fn, "kernel_info", None) if type(fn).__name__ != "NativeKernel" else None
    print(json.dumps({"how": how, "sec": sec, "type": type(fn).__name__,
                      "src": compile_cache.source_digest(), "cutlass": "cutlass" in sys.modules,
                      "kernels": sorted(info) if info else None}))
    """
)


def _round_trip(cache: Path, arch: str, **extra) -> dict:
    env = _env(CUTE_DSL_ARCH=arch, **extra)
    env[CC.ENV_DIR] = str(cache)
    env.pop(CC.ENV_DISABLE, None)
    for v in CC.ARTIFACT_ENV:
        env.pop(v, None)
    out = subprocess.run([sys.executable, "-c", ROUND_TRIP], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_cutedsl_round_trip_sm90a(tmp_path):
    cache = tmp_path / "cache"
    first = _round_trip(cache, "sm_90a")
    second = _round_trip(cache, "sm_90a")
    assert second["src"] == first["src"], "kernel sources were edited between the two runs"
    assert first["how"] == "compiled" and second["how"] == "loaded"
    # the compiling process launches the entry it stored natively as well
    assert first["type"] == "NativeKernel", first
    # loaded as a shared library through ctypes: its symbols resolve against CuTeDSL's runtime
    # library, and the loading process never imports CuTeDSL
    assert second["type"] == "NativeKernel" and not second["cutlass"], second
    assert second["sec"] < 0.5 * first["sec"]
    # with the native launch turned off, CuTeDSL's loader reads the same entry
    third = _round_trip(cache, "sm_90a", **{CC.ENV_NATIVE: "0"})
    assert third["how"] == "loaded" and third["type"] == "CuteKernel" and third["kernels"]
    # without native launches, the compiling process keeps CuTeDSL's function: the same kernels
    fresh = _round_trip(tmp_path / "cache2", "sm_90a", **{CC.ENV_NATIVE: "0"})
    assert fresh["how"] == "compiled" and fresh["type"] == "CuteKernel"
    assert fresh["kernels"] == third["kernels"]
    # another arch is another key: compiled, not the sm_90a object
    assert _round_trip(cache, "sm_100a")["how"] == "compiled"
    objs = list((cache / CC.SUBDIR).glob("quantize-*.o"))
    assert len(objs) == 2
    libs = list((cache / CC.SUBDIR).glob("quantize-*.so"))
    assert len(libs) == 2


@pytest.mark.slow
def test_native_kernel_passes_arguments_as_the_c_header_does(tmp_path):
    """A real entry (a quantizer compiled for sm_90a), loaded natively; its ciface entry is
    replaced by a recorder so that the packing can be checked without a GPU: one ``void *``
    per pointer argument, an ``int32_t`` per Int32, the stream as a ``cudaStream_t``, then the
    ``int32_t`` CUDA result, whose non-zero value becomes one error line."""
    import ctypes

    from moe_mxfp8.kernels import native

    cache = tmp_path / "cache"
    _round_trip(cache, "sm_90a")
    meta = json.loads(next((cache / CC.SUBDIR).glob("quantize-*.json")).read_text())
    prefix = "moe_mxfp8_" + CC.Entry(cache, "quantize", meta["key"]).digest[:16]
    kern = native.NativeKernel(cache / CC.SUBDIR / meta["shared"], prefix, meta["function"],
                               meta["runtime"])
    seen, status = [], [0]

    @ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32)
    def recorder(args, n):
        cells = ctypes.cast(args, ctypes.POINTER(ctypes.c_void_p))
        ptr = [ctypes.cast(cells[i], ctypes.POINTER(ctypes.c_void_p)).contents.value
               for i in (0, 1)]
        i32 = ctypes.cast(cells[2], ctypes.POINTER(ctypes.c_int32)).contents.value
        stream = ctypes.cast(cells[3], ctypes.POINTER(ctypes.c_void_p)).contents.value
        seen.append((n, ptr, i32, stream))
        ctypes.cast(cells[n - 1], ctypes.POINTER(ctypes.c_int32)).contents.value = status[0]

    kern._entry, kern._loaded = recorder, True  # no GPU: skip the CUDA library load
    kern(native.Ptr("uint8", 0x7F0000001000), native.Ptr("bfloat16", 0x7F0000002000), -5,
         native.Stream(0x1234))
    assert seen == [(5, [0x7F0000001000, 0x7F0000002000], -5, 0x1234)]
    status[0] = 700  # cudaErrorIllegalAddress
    with pytest.raises(RuntimeError, match="CUDA error 700"):
        kern(native.Ptr("uint8", 16), native.Ptr("uint8", 32), 1, native.Stream(0))
    with pytest.raises(TypeError, match="unsupported kernel argument"):
        kern(1.5)


def test_native_kernel_refuses_an_int_that_would_wrap():
    """Every Python int is packed as an ``int32_t``: one outside its range would wrap silently
    (a scale-buffer size of 2^31 bytes becoming negative), so it is one error line and the
    kernel is not called. A kernel object with the recorder as its entry (no library, no GPU)."""
    import ctypes

    from moe_mxfp8.kernels import native

    seen = []

    @ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32)
    def recorder(args, n):
        cells = ctypes.cast(args, ctypes.POINTER(ctypes.c_void_p))
        seen.append([ctypes.cast(cells[i], ctypes.POINTER(ctypes.c_int32)).contents.value
                     for i in range(n - 1)])

    kern = native.NativeKernel.__new__(native.NativeKernel)
    kern._entry, kern._loaded = recorder, True
    kern(2**31 - 1, -(2**31), 0)  # the edges fit
    assert seen == [[2**31 - 1, -(2**31), 0]]
    for value in (2**31, -(2**31) - 1, 2**40):
        with pytest.raises(ValueError, match="does not fit a 32-bit integer") as info:
            kern(native.Ptr("uint8", 16), value, native.Stream(0))
        assert "\n" not in str(info.value)
    assert len(seen) == 1  # nothing reached the kernel


def test_native_launch_cells_without_a_library():
    """The launch packing alone (no compiled library, so it runs in CI): every argument in an
    8-byte cell -- pointers and the stream whole, an ``int32_t`` (signed) in the low half --
    then the ``int32_t`` result, read back signed."""
    import ctypes

    from moe_mxfp8.kernels import native

    seen, status = [], [0]

    @ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32)
    def recorder(args, n):
        cells = ctypes.cast(args, ctypes.POINTER(ctypes.c_void_p))
        ptr = [ctypes.cast(cells[i], ctypes.POINTER(ctypes.c_void_p)).contents.value
               for i in (0, 1)]
        i32 = [ctypes.cast(cells[i], ctypes.POINTER(ctypes.c_int32)).contents.value
               for i in (2, 3, 4)]
        stream = ctypes.cast(cells[5], ctypes.POINTER(ctypes.c_void_p)).contents.value
        seen.append((n, ptr, i32, stream))
        ctypes.cast(cells[n - 1], ctypes.POINTER(ctypes.c_int32)).contents.value = status[0]

    kern = object.__new__(native.NativeKernel)
    kern._entry, kern._loaded = recorder, True
    kern(native.Ptr("uint8", 0x7F0000001000), native.Ptr("bfloat16", 0x7F0000002000), -5,
         2**31 - 1, -(2**31), native.Stream(0x1234))
    assert seen == [(7, [0x7F0000001000, 0x7F0000002000], [-5, 2**31 - 1, -(2**31)], 0x1234)]
    for code in (700, -1):
        status[0] = code
        with pytest.raises(RuntimeError, match=f"CUDA error {code} launching"):
            kern(native.Ptr("uint8", 16), native.Ptr("uint8", 32), 1, 2, 3, native.Stream(0))
    with pytest.raises(TypeError, match="unsupported kernel argument"):
        kern(1.5)


def test_native_launch_cells_are_per_thread():
    """A launch's argument cells are reused by the next launch of the same argument count on
    the same thread only: a launch in flight on one thread (its C call runs without the GIL)
    reads its own arguments while another thread launches."""
    import ctypes
    import threading

    from moe_mxfp8.kernels import native

    seen: dict = {}
    other_done = threading.Event()

    @ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32)
    def recorder(args, n):
        name = threading.current_thread().name
        if name == "first":
            assert other_done.wait(10)  # the other thread launches while this call is on
        cells = ctypes.cast(args, ctypes.POINTER(ctypes.c_void_p))
        seen[name] = [ctypes.cast(cells[i], ctypes.POINTER(ctypes.c_int32)).contents.value
                      for i in range(n - 1)]

    kern = object.__new__(native.NativeKernel)
    kern._entry, kern._loaded = recorder, True

    def launch(values, done=None):
        kern(*values)
        if done is not None:
            done.set()

    first = threading.Thread(target=launch, args=((1, 2, 3),), name="first")
    second = threading.Thread(target=launch, args=((7, 8, 9), other_done), name="second")
    first.start()
    second.start()
    first.join(20)
    second.join(20)
    assert seen == {"first": [1, 2, 3], "second": [7, 8, 9]}
    kern(4, 5, 6)  # this thread's cells, reused by count
    kern(4, 5, 6, 7)
    assert seen["MainThread"] == [4, 5, 6, 7]


def test_link_shared_refuses_what_it_cannot_link(tmp_path, monkeypatch):
    from moe_mxfp8.kernels import native

    assert not native.link_shared(b"not an object file", tmp_path / "a.so")
    assert not (tmp_path / "a.so").exists()
    monkeypatch.setattr(native, "c_compiler", lambda: None)  # no C compiler on the machine
    assert not native.link_shared(native.ELF_MAGIC + b"\0" * 60, tmp_path / "b.so")
    assert list(tmp_path.iterdir()) == []


def test_launch_path_imports_no_cutedsl():
    """Everything a launch of a cached kernel runs -- the API, the host classes, the launchers,
    the compile cache and the native loader, and on sm_100 the first-use self-check (its stage
    count, check problem and verdict) -- imports without CuTeDSL; the kernel classes
    (compiles) are the only importers. The sm_100 launches run on the CPU with a stand-in for
    the cached kernel, as a natively loaded entry is held in memory."""
    code = textwrap.dedent("""
        import dataclasses
        import sys
        import torch
        import moe_mxfp8
        from moe_mxfp8 import grouped_gemm, quantize, selfcheck
        from moe_mxfp8.kernels import compile_cache, native, quantize_launch
        from moe_mxfp8.kernels.grouped_gemm import launcher, sm90_config, sm100_config
        from moe_mxfp8.kernels.grouped_gemm import problem as P
        assert grouped_gemm._host_class("sm90") is sm90_config.GroupedGemmSm90Host
        assert quantize._kernel_module() is quantize_launch
        print("cutlass imported:", "cutlass" in sys.modules)

        host = grouped_gemm._host_class("sm100")
        launcher._grid_clusters = lambda *a: 1  # CUDA-only queries
        launcher.current_stream = lambda *a: None
        for mode in ("m", "k"):
            prob = selfcheck.pipeline_problem(mode, 64, 96, torch.bfloat16, tile_m=128,
                                              stages=2)
            a, b, offs = selfcheck.make_operands(mode, prob, "cpu")
            desc = (P.describe_m(a, b, offs, torch.bfloat16) if mode == "m"
                    else P.describe_k(a, b, offs, torch.bfloat16))
            aligned = desc if mode == "m" else dataclasses.replace(  # as the launcher aligns
                desc, m=P.k_aligned_extent(desc.m, desc.num_groups))
            cfg = host.select_config(aligned)
            launches = []
            key = (host.kernel_name, cfg, compile_cache.target_arch(), None)
            launcher._CACHE._fns[key] = lambda *args: launches.append(args)  # "cached"
            try:  # the kernel writes nothing: the first-use check runs and refuses it
                grouped_gemm.run_kernel("sm100", desc, a, b, offs)
                raise AssertionError("the check accepted an empty output")
            except selfcheck.KernelSelfCheckError as err:
                assert "self-check" in str(err) and len(launches) == 1, (err, launches)
            selfcheck.reset()
            selfcheck._verdicts[(f"{host.kernel_name}.{mode}", cfg, "cpu")] = None
            grouped_gemm.run_kernel("sm100", desc, a, b, offs)  # verified: launches
            assert len(launches) == 2
        print("sm100 launch imported cutlass:", "cutlass" in sys.modules)
        from moe_mxfp8.kernels.grouped_gemm import sm90
        print("after the kernel class:", "cutlass" in sys.modules)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=ROOT, env=_env())
    assert res.returncode == 0, res.stderr[-2000:]
    assert "cutlass imported: False" in res.stdout
    assert "sm100 launch imported cutlass: False" in res.stdout
    assert "after the kernel class: True" in res.stdout


def test_host_decisions_are_the_kernel_class_decisions():
    """The launcher decides with the arch's host class; the kernel class inherits the same
    decisions (config choice, checks, grid bound), so a compiled and a loaded kernel launch
    alike."""
    from moe_mxfp8.kernels.grouped_gemm import launcher
    from moe_mxfp8.kernels.grouped_gemm import problem as P
    from moe_mxfp8.kernels.grouped_gemm.sm90 import GroupedGemmSm90
    from moe_mxfp8.kernels.grouped_gemm.sm90_config import GroupedGemmSm90Host

    for mode, n, k, blocks in (("m", 4096, 7168, "1x128"), ("k", 2048, 7168, "1x128"),
                               ("m", 160, 288, "1x32")):
        prob = P.GroupedProblem(mode, 3000, n, k, 8, torch.bfloat16, blocks,
                                torch.device("cpu"))
        cfg = GroupedGemmSm90Host.select_config(prob)
        assert GroupedGemmSm90.select_config(prob) == cfg
        host, kern = GroupedGemmSm90Host(cfg), GroupedGemmSm90(cfg)
        assert type(launcher._host(GroupedGemmSm90, cfg)) is GroupedGemmSm90Host
        assert host.can_implement(prob) == kern.can_implement(prob)
        assert host.cluster_size() == kern.cluster_size()
        assert host.units_bound(3000, 8) == kern.units_bound(3000, 8)
        assert host.tiles_x() == kern.sched.tiles_x  # the device walk's tiles along x


def test_device_fact_is_computed_once_per_machine(cache_env):
    calls = []

    def compute():
        calls.append(1)
        return 66

    assert CC.device_fact("max_active_clusters GPU-1 cluster=2", compute) == 66
    assert CC.device_fact("max_active_clusters GPU-1 cluster=2", compute) == 66
    assert calls == [1]  # the second answer came from the file
    assert CC.device_fact("max_active_clusters GPU-2 cluster=2", lambda: 60) == 60
    data = json.loads((cache_env / CC.SUBDIR / CC.FACTS_FILE).read_text())
    assert data == {"max_active_clusters GPU-1 cluster=2": 66,
                    "max_active_clusters GPU-2 cluster=2": 60}


# ---------------------------------------------------------------------------------------------
# precompile
# ---------------------------------------------------------------------------------------------


def test_precompile_arguments():
    with pytest.raises(TypeError, match="precompile"):
        moe_mxfp8.precompile(42)
    with pytest.raises(ValueError, match="no MXFP8MoE"):
        moe_mxfp8.precompile(torch.nn.Linear(4, 4))
    layer = moe_mxfp8.MXFP8MoE(64, 32, 4, 2)
    with pytest.raises(ValueError, match="token counts"):
        moe_mxfp8.precompile(layer, tokens=0)
    with pytest.raises(ValueError, match="token count"):
        moe_mxfp8.precompile(layer, tokens=[])


def test_precompile_warms_each_distinct_layer_once_per_token_count(monkeypatch, cache_env):
    """Layers with the same kernel-relevant configuration are warmed once; every kernel the
    warm-up obtains is counted (a stand-in warm-up compiles two fake kernels per call); the
    wait at the end is for the layers' device."""
    import importlib

    # the module (``moe_mxfp8.precompile`` the attribute is the function)
    P = importlib.import_module("moe_mxfp8.precompile")
    monkeypatch.setattr(CC, "_dump_cutedsl", fake_dump)
    monkeypatch.setattr(CC, "_load_cutedsl", fake_load)
    monkeypatch.setattr(P, "resolve_backend", lambda backend, device: "sm90")
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: synced.append(a))
    fam = CC.CompileCache("test_precompile")
    warmed = []

    def fake_warm(layer, tokens):
        warmed.append((layer.dim, tokens))
        for op in ("fprop", "dgrad"):
            fam.get((op, layer.dim, layer.hidden_dim), lambda op=op: f"{op}-kernel")

    monkeypatch.setattr(P, "warm_layer", fake_warm)
    try:
        model = torch.nn.ModuleList([moe_mxfp8.MXFP8MoE(64, 32, 4, 2),
                                     moe_mxfp8.MXFP8MoE(64, 32, 4, 2),  # same kernels
                                     moe_mxfp8.MXFP8MoE(96, 32, 4, 2)])
        s = moe_mxfp8.precompile(model, tokens=[8, 16], progress=False)
        assert sorted(warmed) == [(64, 8), (64, 16), (96, 8), (96, 16)]
        assert (s["kernels"], s["compiled"], s["loaded"]) == (4, 4, 0)
        assert s["cache_dir"] == str(cache_env) and s["backends"] == ["sm90"]
        assert synced == [(torch.device("cpu"),)]  # the layers' device, not the current one
        fam.clear()  # as in a new process: the kernels come from the cache now
        s = moe_mxfp8.precompile(model, tokens=8, progress=False)
        assert (s["kernels"], s["compiled"], s["loaded"]) == (4, 0, 4)
    finally:
        CC._CACHES.remove(fam)


def test_precompile_reference_layers_need_nothing():
    model = torch.nn.Sequential(moe_mxfp8.MXFP8MoE(64, 32, 4, 2, backend="reference"),
                                moe_mxfp8.MXFP8MoE(64, 32, 4, 2, precision="bf16"))
    s = moe_mxfp8.precompile(model, tokens=[8, 64])
    assert s["kernels"] == 0 and s["backends"] == ["reference"]


@pytest.mark.parametrize("tty", [False, True])
def test_precompile_progress_is_one_line(tty):
    import io

    from moe_mxfp8.precompile import _Progress

    class Stream(io.StringIO):
        def isatty(self):
            return tty

    st = Stream()
    show = _Progress(st, True)
    for i in range(3):
        show.hook("start", "quantize", ("op", i))
        show.hook("compiled", "quantize", ("op", i), 0.5)
    show.done({"kernels": 3, "compiled": 2, "loaded": 1, "seconds": 1.5})
    text = st.getvalue()
    assert text.endswith("3 kernels ready in 1.5 s (2 compiled, 1 loaded from the cache)\n")
    # a terminal sees one line rewritten in place; a log gets a start and an end line
    assert text.count("\n") == (1 if tty else 2)
    assert ("\r" in text) == tty
    quiet = Stream()
    _Progress(quiet, False).done({"kernels": 3, "compiled": 3, "loaded": 0, "seconds": 1.0})
    assert quiet.getvalue() == ""


def test_warm_layer_runs_every_gemm_of_a_training_step(monkeypatch):
    """Both fprops, both dgrads (the first layer's dgrad runs only when the input needs a
    gradient, as inside a model) and both wgrads: every GEMM kernel a training step compiles."""
    import moe_mxfp8.reference as R

    calls = []
    real = R.grouped_mm

    def spy(a, b, *args, **kw):
        calls.append("k" if b.group_axis == "k" else "m")
        return real(a, b, *args, **kw)

    monkeypatch.setattr(R, "grouped_mm", spy)
    warm_layer(moe_mxfp8.MXFP8MoE(64, 32, 4, 2, backend="reference"), 40)
    assert sorted(calls) == ["k"] * 2 + ["m"] * 4


def test_warm_layer_leaves_the_layer_untouched():
    torch.manual_seed(0)
    layer = moe_mxfp8.MXFP8MoE(64, 32, 4, 2, backend="reference")
    params = {n: p.detach().clone() for n, p in layer.named_parameters()}
    rng = torch.get_rng_state()
    warm_layer(layer, 48)
    assert torch.equal(torch.get_rng_state(), rng)
    assert layer.aux_loss is None and layer.tokens_per_expert is None
    for n, p in layer.named_parameters():
        assert p.grad is None and torch.equal(p, params[n])


# ---------------------------------------------------------------------------------------------
# GPU: the second process loads every kernel and gets the same results
# ---------------------------------------------------------------------------------------------

GPU_RUN = textwrap.dedent(
    """
    import json, sys, time, torch
    import moe_mxfp8
    from moe_mxfp8.kernels import compile_cache
    out_path = sys.argv[1]
    torch.manual_seed(1234)
    layer = moe_mxfp8.MXFP8MoE(256, 128, 8, 2, device="cuda")
    x = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t0 = time.perf_counter()
    y = layer(x)
    y.backward(torch.randn_like(y))
    torch.cuda.synchronize()
    sec = time.perf_counter() - t0
    torch.save({"y": y.detach().cpu(), "dx": x.grad.cpu(),
                "dw1": layer.w_gate_up.grad.cpu(), "dw2": layer.w_down.grad.cpu()}, out_path)
    ev = [how for _, _, how, _ in compile_cache.compile_events()]
    print(json.dumps({"sec": sec, "events": ev, "cutlass": "cutlass" in sys.modules}))
    """
)


@pytest.mark.gpu
def test_second_process_loads_without_retrace(tmp_path):
    env = _env()
    env[CC.ENV_DIR] = str(tmp_path / "cache")
    env.pop(CC.ENV_DISABLE, None)
    for v in CC.ARTIFACT_ENV:
        env.pop(v, None)
    runs = []
    for i in range(2):
        out = subprocess.run([sys.executable, "-c", GPU_RUN, str(tmp_path / f"r{i}.pt")],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["events"] and set(first["events"]) == {"compiled"}
    assert second["events"] == ["loaded"] * len(first["events"])  # nothing traced again
    # every kernel launched natively (a C compiler is on the machine: Triton needs one too)
    assert first["cutlass"] and not second["cutlass"]
    a, b = torch.load(tmp_path / "r0.pt"), torch.load(tmp_path / "r1.pt")
    assert torch.equal(a["y"], b["y"])  # the same kernels on the same data
    for name in ("dx", "dw1", "dw2"):  # backward scatters may sum in another order
        assert torch.isfinite(b[name]).all()
        torch.testing.assert_close(b[name], a[name], rtol=1e-2, atol=1e-2)
    print(f"first process {first['sec']:.2f} s, second {second['sec']:.2f} s")


def test_first_step_imports_no_dynamo():
    """A new process's first forward+backward of the layer (both precisions) does not import
    torch._dynamo: the layer's operators are defined through `moe_mxfp8.op_library`, not
    ``torch.library.custom_op``, whose first call imports it (docs/design/compile_cache.md)."""
    code = textwrap.dedent("""
        import sys
        import torch
        from moe_mxfp8 import MXFP8MoE
        for precision in ("mxfp8", "bf16"):
            m = MXFP8MoE(64, 64, 4, 2, precision=precision)
            x = torch.randn(40, 64).to(torch.bfloat16).requires_grad_()
            m(x).float().sum().backward()
            assert x.grad is not None
        print("dynamo imported:", "torch._dynamo" in sys.modules)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=Path(__file__).resolve().parent.parent)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "dynamo imported: False" in res.stdout
