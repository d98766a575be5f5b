"""Instruction mix of the Hopper grouped GEMM's consumer k-loop, from its SASS (CPU only).

``python tools/sass_mix.py [--json out.json] [--keep DIR] [--configs "m 32x32,..."]`` (needs
nvidia-cutlass-dsl and ``nvdisasm``: ``pip install nvidia-cuda-nvdisasm``). Method, per config
(N=4096, K=7168 static):

1. compile `GroupedGemmSm90` for ``CUTE_DSL_ARCH=sm_90a`` with fake pointers
   (`grouped_gemm.launcher.compile_config`, as CPU CI does) and ``--keep-cubin`` into a temporary
   ``CUTE_DSL_DUMP_DIR``; disassemble with ``nvdisasm -c``.
2. k-loop = the innermost backward ``BRA`` whose body holds a QGMMA (the persistent tile loop
   around it is larger). Diag "promote_only" issues no wgmma, so there the marker is
   ``WARPGROUP.DEPBAR`` (its wait_groups remain). Static count, each instruction once: the
   mbarrier try-wait spin counts one pass (data ready). A region skipped by a forward
   conditional branch and holding a nested loop (K-grouped last-k-tile `zero_tail`) runs
   once per tile, not per k-tile, and is left out.
3. k-tiles per iteration = QGMMAs (else DEPBARs) / `BLOCKS_PER_KTILE` (1 here: not unrolled;
   a 256-column tile's k-tile counts as 2, one per 128-column half, so every row compares
   the same 128x128x128 unit of work).
   Counts are per warp (each warp of a warpgroup issues every instruction, QGMMA included).
4. issue cycles per SMSP per k-tile = instrs x consumer warps per SMSP (2 warpgroups = 8 warps
   on 4 SMSPs = 2) at 1 instr/cycle (producer and scale warps left out). Tensor-core time of a
   k-tile = 2 TILE_M TILE_N TILE_K / (dense FP8 FLOP per SM-cycle = 1979e12 / 132 SMs /
   1.83e9 Hz = 8192, H100 SXM spec at boost clock) = 512 cycles for 128x128x128. A ratio > 1:
   the consumers' issue alone outlasts the MMAs (and it does not hide: docs/design/hopper_gemm.md).
5. regs = ptxas' allocation (``.nv.info`` REGCOUNT) and the ``USETMAXREG`` values (producer /
   consumer warpgroups); hi reg = highest register the loop names (vector loads and the QGMMA
   accumulator at full width); spills = LDL/STL anywhere in the kernel.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
N_DIM, K_DIM = 4096, 7168
# name -> GroupedGemmSm90Config fields besides n, k
CONFIGS = {
    "m 1x32": dict(mode="m", scale_blocks="1x32"),
    "m 32x32": dict(mode="m", scale_blocks="32x32"),
    "k 1x32": dict(mode="k", scale_blocks="1x32"),
    "m 32x32 cluster2": dict(mode="m", scale_blocks="32x32", cluster_n=2),
    "m 1x32 no_promote": dict(mode="m", scale_blocks="1x32", diag="no_promote"),
    "m 1x32 no_scale_wait": dict(mode="m", scale_blocks="1x32", diag="no_scale_wait"),
    "m 1x32 promote_only": dict(mode="m", scale_blocks="1x32", diag="promote_only"),
    "m 32x32 promote_only": dict(mode="m", scale_blocks="32x32", diag="promote_only"),
    "m 1x128": dict(mode="m", scale_blocks="1x128"),
    "k 1x128": dict(mode="k", scale_blocks="1x128", cluster_n=2),
    "m 1x128 overlap": dict(mode="m", scale_blocks="1x128", overlap_promotion=True),
    "k 1x128 overlap": dict(mode="k", scale_blocks="1x128", overlap_promotion=True, cluster_n=2),
    "m 1x128 wide": dict(mode="m", scale_blocks="1x128", tile_n=256),
    "k 1x128 wide": dict(mode="k", scale_blocks="1x128", tile_n=256, cluster_n=2),
    # the layer's wgrad: B (the saved activation) in 128 x 128 tiles
    "k 1x128 tiles": dict(mode="k", scale_blocks="1x128", cluster_n=2, b_block_rows=128),
    "k 1x128 wide tiles": dict(mode="k", scale_blocks="1x128", tile_n=256, cluster_n=2,
                               b_block_rows=128),
}
FP8_DENSE_FLOPS, CLOCK_HZ, NUM_SMS = 1979e12, 1.83e9, 132  # H100 SXM spec (boost clock)
SMSPS = 4
EIFMT_SVAL, EIATTR_REGCOUNT = 0x04, 0x2F  # cubin .nv.info attribute encoding
INSTR = re.compile(r"/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)\s*([^;]*);")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")
BRA_TARGET = re.compile(r"`\((\.L_x_\d+)\)")
REG = re.compile(r"\bR(\d+)\b")


def kernel_module(dump_dir: Path):
    """`moe_mxfp8.kernels.grouped_gemm` from this checkout (an editable install of
    another checkout would otherwise win), compiling for sm_90a, cubins kept in dump_dir."""
    os.environ.update(CUTE_DSL_ARCH="sm_90a", CUTE_DSL_DUMP_DIR=str(dump_dir))
    sys.path.insert(0, str(ROOT))
    import moe_mxfp8

    if not Path(moe_mxfp8.__file__).resolve().is_relative_to(ROOT):
        raise SystemExit(f"moe_mxfp8 resolves to {moe_mxfp8.__file__}, not {ROOT}")
    name = "moe_mxfp8.kernels"
    spec = importlib.util.find_spec(name)
    if spec is None or not Path(spec.origin).resolve().is_relative_to(ROOT):
        init = ROOT / "kernels" / "__init__.py"
        spec = importlib.util.spec_from_file_location(
            name, init, submodule_search_locations=[str(init.parent)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    from moe_mxfp8.kernels.grouped_gemm import launcher, sm90

    return launcher, sm90


def find_nvdisasm() -> str:
    if exe := shutil.which("nvdisasm"):
        return exe
    import nvidia  # nvidia-cuda-nvdisasm installs under nvidia/cu*/bin

    hits = [h for base in nvidia.__path__ for h in glob.glob(f"{base}/*/bin/nvdisasm")]
    if not hits:
        raise SystemExit("nvdisasm not found: pip install nvidia-cuda-nvdisasm")
    return sorted(hits)[-1]


def compile_cubin(K, fields: dict, dump_dir: Path, dest: Path) -> Path:
    """Compile one config; ``--keep-cubin`` writes to $CUTE_DSL_DUMP_DIR (read once, at the
    DSL's start), so each new cubin is moved to ``dest`` (the DSL's name is ~250 chars)."""
    launcher, sm90 = K
    launcher.compile_config(sm90.GroupedGemmSm90,
                            sm90.GroupedGemmSm90Config(n=N_DIM, k=K_DIM, **fields),
                            options="--keep-cubin")
    cubins = list(dump_dir.glob("*.cubin"))
    if len(cubins) != 1:
        raise RuntimeError(f"expected one new cubin in {dump_dir}, got {cubins}")
    return cubins[0].replace(dest)


def elf_regcount(cubin: Path) -> int:
    """ptxas' register allocation: EIATTR_REGCOUNT in ``.nv.info`` (one kernel per cubin)."""
    data = cubin.read_bytes()
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQII", data, shoff + i * shentsize)
                for i in range(shnum)]
    strtab_off = sections[shstrndx][4]
    regs = []
    for sh_name, _, _, _, off, size, _, _ in sections:
        name = data[strtab_off + sh_name:data.index(b"\0", strtab_off + sh_name)].decode()
        pos = off
        while name == ".nv.info" and pos < off + size:  # (format, attribute, payload)*
            fmt, attr = data[pos], data[pos + 1]
            if fmt == EIFMT_SVAL:
                length, = struct.unpack_from("<H", data, pos + 2)
                if attr == EIATTR_REGCOUNT:
                    regs.append(struct.unpack_from("<II", data, pos + 4)[1])
                pos += 4 + length
            else:  # NVAL: no payload, BVAL: 1 byte, HVAL: 2 bytes
                pos += 2 + {1: 0, 2: 1, 3: 2}[fmt]
    return max(regs, default=-1)


def parse_sass(text: str):
    """[(addr, opcode, operands, predicated)] and {label: index of the instruction it names}."""
    instrs, labels = [], {}
    for line in text.splitlines():
        if m := LABEL.match(line):
            labels[m.group(1)] = len(instrs)  # the next instruction's index
        elif m := INSTR.search(line):
            instrs.append((int(m.group(1), 16), m.group(3), m.group(4), bool(m.group(2))))
    return instrs, labels


def branches(instrs, labels, start=0, stop=None):
    """(index, target index) of the BRAs in instrs[start:stop]."""
    for i in range(start, len(instrs) if stop is None else stop):
        t = BRA_TARGET.search(instrs[i][2])
        if instrs[i][1].startswith("BRA") and t and t.group(1) in labels:
            yield i, labels[t.group(1)]


def rare_paths(instrs, labels, lo: int, hi: int) -> set[int]:
    """Indices in the loop skipped by a forward conditional branch over a region holding a
    nested loop (the K-grouped last-k-tile `zero_tail`): run once per tile, not per k-tile."""
    rare = set()
    for i, t in branches(instrs, labels, lo, hi):
        if instrs[i][3] and i < t <= hi and any(
                j < i2 for i2, j in branches(instrs, labels, i + 1, t)):
            rare.update(range(i + 1, t))
    return rare


def find_k_loop(instrs, labels):
    """(start, end) indices of the innermost backward-branch body holding the marker."""
    best = None
    for marker in ("QGMMA", "WARPGROUP.DEPBAR"):
        for i, lo in branches(instrs, labels):
            if lo <= i and any(ins[1].startswith(marker) for ins in instrs[lo:i + 1]):
                if best is None or i - lo < best[1] - best[0]:
                    best = (lo, i)
        if best:
            return best, marker
    raise RuntimeError("no loop holding QGMMA or WARPGROUP.DEPBAR")


def highest_reg(op: str, args: str) -> int:
    """Highest register an instruction names, counting vector / accumulator widths."""
    regs = [int(r) for r in REG.findall(args)]
    if not regs:
        return -1
    if op.startswith("QGMMA"):  # fp32 accumulator of 64xNxK: N/2 registers per thread
        return max(max(regs), regs[0] + int(re.search(r"64x(\d+)x", op).group(1)) // 2 - 1)
    if op.startswith(("LDS", "LDG", "LDL")) and (m := re.search(r"\.(64|128)\b", op)):
        return max(max(regs), regs[0] + int(m.group(1)) // 32 - 1)
    return max(regs)


def analyse(K, sass: str, regs: int) -> dict:
    instrs, labels = parse_sass(sass)
    (lo, hi), marker = find_k_loop(instrs, labels)
    rare = rare_paths(instrs, labels, lo, hi)
    body = [ins for j, ins in enumerate(instrs[lo:hi + 1], lo) if j not in rare]
    ops = Counter(ins[1] for ins in body)
    base = Counter(ins[1].split(".")[0] for ins in body)
    per = max(1, sum(n for op, n in ops.items() if op.startswith(marker)) // K[1].BLOCKS_PER_KTILE)
    lds = {op.removeprefix("LDS").lstrip(".") or "32": n / per
           for op, n in sorted(ops.items()) if op.split(".")[0] == "LDS"}
    named = ("QGMMA", "FFMA", "FMUL", "FADD", "LDS")
    counts = {k: base[k] / per for k in named}
    total = len(body) / per
    issue = total * (K[1].NUM_CONSUMER_WG * 4 // SMSPS)  # consumer warps per SMSP
    tc = 2 * K[1].TILE_M * K[1].TILE_N * K[1].TILE_K / (FP8_DENSE_FLOPS / NUM_SMS / CLOCK_HZ)
    maxnreg = [int(a.split(",")[-1], 16) for _, op, a, _ in instrs
               if op.startswith("USETMAXREG")]
    return {
        "instrs": total, **counts, "lds_widths": lds, "other": total - sum(counts.values()),
        "other_top": dict(Counter({op: n / per for op, n in base.items()
                                   if op not in named}).most_common(6)),
        "issue_cyc": issue, "tc_cyc": tc, "x_tc": issue / tc, "ktiles_per_iter": per,
        "loop_addr": [hex(body[0][0]), hex(body[-1][0])], "regs": regs, "setmaxnreg": maxnreg,
        "hi_reg": max(highest_reg(op, a) for _, op, a, _ in body), "rare_skipped": len(rare),
        "spills": sum(ins[1].split(".")[0] in ("LDL", "STL") for ins in instrs),
    }


def fmt(x: float) -> str:
    return f"{x:g}" if x == int(x) else f"{x:.2f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--keep", help="keep cubins and SASS in this directory")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma list of: {', '.join(CONFIGS)} (default all)")
    args = ap.parse_args()
    configs = {name: CONFIGS[name] for name in args.configs.split(",")}
    nvdisasm = find_nvdisasm()
    results = {}
    with tempfile.TemporaryDirectory(prefix="sass_mix_") as tmp:
        work, dump_dir = Path(args.keep or tmp), Path(tmp) / "dump"
        work.mkdir(parents=True, exist_ok=True)
        dump_dir.mkdir()
        K = kernel_module(dump_dir)
        for name, fields in configs.items():
            if fields.get("diag", "") not in K[1].DIAG_MODES:
                print(f"skip {name}: diag not in {K[1].DIAG_MODES}", file=sys.stderr)
                continue
            cubin = compile_cubin(K, fields, dump_dir, work / f"{name.replace(' ', '_')}.cubin")
            sass = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True,
                                  text=True, check=True).stdout
            cubin.with_suffix(".sass").write_text(sass)
            results[name] = analyse(K, sass, elf_regcount(cubin))
    cols = ["config", "instrs/ktile/warp", "QGMMA", "FFMA", "FMUL", "FADD", "LDS", "other",
            "issue cyc/SMSP", "x TC time", "regs", "hi reg", "spills"]
    rows = []
    for name, r in results.items():
        lds = " ".join(f"{fmt(n)}x.{w}" for w, n in r["lds_widths"].items())
        rows.append([name, fmt(r["instrs"]), fmt(r["QGMMA"]), fmt(r["FFMA"]), fmt(r["FMUL"]),
                     fmt(r["FADD"]), f"{fmt(r['LDS'])} ({lds})" if lds else "0",
                     fmt(r["other"]), fmt(r["issue_cyc"]), f"{r['x_tc']:.2f}",
                     f"{r['regs']} ({'/'.join(map(str, r['setmaxnreg']))})",
                     f"R{r['hi_reg']}", str(r["spills"])])
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    print(f"N={N_DIM} K={K_DIM}, sm_90a; tensor-core time per k-tile "
          f"{next(iter(results.values()))['tc_cyc']:.0f} cycles")
    for row in [cols, ["-" * w for w in widths], *rows]:
        print(" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    for name, r in results.items():
        skipped = f"; {r['rare_skipped']} once-per-tile instrs left out" * bool(r["rare_skipped"])
        print(f"{name}: other = {r['other_top']}{skipped}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
