"""Scheduling hints of the Hopper GEMMs' promotion instructions, set in the compiled cubin.

The Hopper kernels promote each k-tile's wgmma result into the fp32 accumulator on the CUDA
cores (``FFMA``, and ``FMUL`` for a row x column scale product; docs/design/hopper_gemm.md).
Every SASS instruction carries scheduling control bits beside its opcode (Volta and later: the
top 23 bits of the 128-bit word). Two of them matter here:

* the *yield* bit: set, the warp keeps its issue slot for its next instruction; clear, the
  scheduler may switch to another warp after it;
* the four operand *reuse* flags: a source operand stays in the reuse cache for the warp's next
  instruction. A warp that yields may lose the cache, so the compiler sets yield on every
  instruction with a reuse flag.

ptxas sets yield on about half of the promotion's instructions (every other one, those with a
reuse flag among them). While the two consumer warpgroups promote, the other warpgroup's
wgmma issue and the producer's copies wait behind those runs. `allow_yield` clears the yield
bit and the reuse flags of every ``FFMA`` / ``FMUL`` in the promotion's runs, so the scheduler
may interleave other warps at each of them (the idea DeepGEMM applies to its FP8 GEMMs; this is
our own implementation). Only scheduling changes: no opcode, operand or dependency barrier is
touched, so the results are the same bits (GPU-tested against the unpatched kernel).

The patch works on the object file a CuTeDSL function exports (``dump_to_object``: the host
launcher with the cubin embedded, uncompressed, in a fatbin) and on plain cubins; it rewrites
bits in place, so every size and offset stays. The instruction encodings it relies on (sm_90
``FFMA R, R, R, R`` = low 12 bits 0x223, ``FMUL R, R, R`` = 0x220, control bits from bit 105)
are pinned against nvdisasm by ``tests/kernels/test_sass_patch.py``.

Imports nothing from CuTeDSL or torch.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

ELF_MAGIC = b"\x7fELF"
EM_CUDA = 190  # e_machine of a CUDA cubin
ELFCLASS64 = 2
SHF_EXECINSTR = 0x4
SHT_NOBITS = 8

INSTR_BYTES = 16  # one SASS instruction on sm_70 and later: two little-endian 64-bit words
OPCODE_MASK = 0xFFF  # low 12 bits of the low word: the opcode (with its operand form)
FFMA_RRR = 0x223  # FFMA Rd, Ra, Rb, Rc
FMUL_RR = 0x220  # FMUL Rd, Ra, Rb
PROMOTION_OPCODES = (FFMA_RRR, FMUL_RR)
# control bits in the high 64-bit word (bit 41 of it is bit 105 of the instruction):
# stall [41:45), yield [45], write barrier [46:49), read barrier [49:52), wait mask [52:58),
# reuse flags [58:62)
NO_YIELD_BIT = 1 << 45
REUSE_MASK = 0xF << 58
# a promotion is a long run of these: a 64 x N accumulator's 32+ values a thread, back to back;
# the scale products and the few FFMAs elsewhere (addressing, epilogue) come in shorter runs
MIN_RUN = 16


class Patched(NamedTuple):
    """What `allow_yield` changed: cubins found, promotion runs, instructions rewritten."""

    cubins: int
    runs: int
    instructions: int


def _u16(b, off: int) -> int:
    return struct.unpack_from("<H", b, off)[0]


def _u32(b, off: int) -> int:
    return struct.unpack_from("<I", b, off)[0]


def _u64(b, off: int) -> int:
    return struct.unpack_from("<Q", b, off)[0]


def embedded_cubins(blob) -> list[int]:
    """Offsets in ``blob`` of the 64-bit CUDA ELF images it holds (a cubin itself: [0]; an
    exported object: the cubins inside its fatbin)."""
    found = []
    pos = blob.find(ELF_MAGIC)
    while pos >= 0:
        if (pos + 0x40 <= len(blob) and blob[pos + 4] == ELFCLASS64
                and _u16(blob, pos + 0x12) == EM_CUDA):
            found.append(pos)
        pos = blob.find(ELF_MAGIC, pos + 1)
    return found


def code_sections(blob, base: int) -> list[tuple[str, int, int]]:
    """``(name, offset in blob, size)`` of the executable sections of the cubin at ``base``."""
    shoff, shentsize = _u64(blob, base + 0x28), _u16(blob, base + 0x3A)
    shnum, shstrndx = _u16(blob, base + 0x3C), _u16(blob, base + 0x3E)

    def header(i: int) -> tuple[int, int, int, int, int]:
        h = base + shoff + i * shentsize
        if h + 0x40 > len(blob):
            raise ValueError("cubin section header past the end of the image")
        # sh_name, sh_type, sh_flags, sh_offset, sh_size
        return (_u32(blob, h), _u32(blob, h + 4), _u64(blob, h + 8), _u64(blob, h + 0x18),
                _u64(blob, h + 0x20))

    strtab = base + header(shstrndx)[3]
    out = []
    for i in range(shnum):
        name_off, kind, flags, off, size = header(i)
        if not flags & SHF_EXECINSTR or kind == SHT_NOBITS or size == 0:
            continue
        end = blob.find(b"\0", strtab + name_off)
        name = bytes(blob[strtab + name_off:end]).decode("ascii", "replace")
        if size % INSTR_BYTES or base + off + size > len(blob):
            raise ValueError(f"cubin section {name} is not whole 16-byte instructions")
        out.append((name, base + off, size))
    return out


def promotion_runs(blob, start: int, size: int, min_run: int = MIN_RUN) -> list[list[int]]:
    """Offsets of the instructions of each run of at least ``min_run`` consecutive FFMA /
    FMUL (register forms) in the code at ``blob[start:start + size]``."""
    runs, cur = [], []
    for off in range(start, start + size, INSTR_BYTES):
        if _u64(blob, off) & OPCODE_MASK in PROMOTION_OPCODES:
            cur.append(off)
            continue
        if len(cur) >= min_run:
            runs.append(cur)
        cur = []
    if len(cur) >= min_run:
        runs.append(cur)
    return runs


POLICIES = ("all", "none", "first_half")


def allow_yield(blob: bytearray, policy: str = "all", min_run: int = MIN_RUN) -> Patched:
    """Rewrite the yield bits of the promotion runs of every cubin in ``blob`` (in place):
    ``"all"``: every instruction may yield (reuse flags cleared); ``"first_half"``: the first
    half of each run so, the rest as compiled; ``"none"``: no instruction yields (reuse flags
    kept). A blob without a cubin is left as it is."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    cubins = embedded_cubins(blob)
    runs = changed = 0
    for base in cubins:
        for _name, start, size in code_sections(blob, base):
            for run in promotion_runs(blob, start, size, min_run):
                runs += 1
                part = run[:len(run) // 2] if policy == "first_half" else run
                for off in part:
                    hi = _u64(blob, off + 8)
                    if policy == "none":
                        new = hi | NO_YIELD_BIT
                    else:
                        new = hi & ~(NO_YIELD_BIT | REUSE_MASK)
                    if new != hi:
                        struct.pack_into("<Q", blob, off + 8, new)
                        changed += 1
    return Patched(len(cubins), runs, changed)


def patched_object(data: bytes, policy: str = "all", min_run: int = MIN_RUN) -> bytes:
    """An exported kernel object with `allow_yield` applied; raises ValueError when it holds no
    cubin or no promotion run (the kernel is not what the caller thinks it is)."""
    out = bytearray(data)
    res = allow_yield(out, policy, min_run)
    if res.cubins == 0 or res.runs == 0:
        raise ValueError(f"no promotion to patch ({res.cubins} cubins, {res.runs} runs)")
    return bytes(out)
