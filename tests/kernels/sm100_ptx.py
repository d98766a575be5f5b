"""Static checks over the sm_100a grouped GEMM's PTX (used by test_grouped_gemm_sm100.py).

A small def-use reader: PTX from NVVM is in (nearly) SSA form, so the expression that forms a
shared-memory store's address can be read back through the defining instructions of its
registers. Every instruction that writes shared memory at an address the kernel computes is a
store here (`smem_write_address`): ``st.shared``, ``st.async``, ``stmatrix``, ``red.shared`` /
``red.async``, ``atom.shared`` and the non-bulk ``cp.async`` -- any of them into a swizzled
buffer must carry the swizzle. (TMA copies, ``cp.async.bulk``, swizzle in hardware.)
"""

from __future__ import annotations

import re

_INSTR = re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.:]*)\s+([^;]*);")
_NO_DEF = ("st.", "stmatrix", "mbarrier", "tcgen05", "cp.", "bar", "fence", "prefetch", "red.",
           "@")


def parse(ptx: str):
    """[(line, opcode, operands)] of the PTX instructions."""
    out = []
    for i, line in enumerate(ptx.splitlines()):
        m = _INSTR.match(line)
        if m:
            out.append((i, m.group(1), _split(m.group(2))))
    return out


def _split(text: str) -> list[str]:
    """Operands separated by top-level commas (not inside ``[...]`` or ``{...}``)."""
    ops, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "[{"
        depth -= ch in "]}"
        if ch == "," and depth == 0:
            ops.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return ops + [cur.strip()]


def definitions(instrs):
    """register -> [(opcode, operands)] of every instruction that writes it."""
    d: dict[str, list] = {}
    for _, op, ops in instrs:
        if ops and re.fullmatch(r"%\w+", ops[0]) and not op.startswith(_NO_DEF):
            d.setdefault(ops[0], []).append((op, ops))
    return d


def expression(reg: str, defs, depth: int = 16, seen=None):
    """The instructions (opcode, operands) that feed ``reg``, up to ``depth`` levels."""
    seen = set() if seen is None else seen
    if depth == 0 or reg in seen:
        return []
    seen.add(reg)
    nodes = []
    for op, ops in defs.get(reg, []):
        nodes.append((op, ops))
        for o in ops[1:]:
            if o.startswith("%"):
                nodes += expression(o, defs, depth - 1, seen)
    return nodes


def _imms(nodes):
    return {int(o) for _, ops in nodes for o in ops[1:] if re.fullmatch(r"-?\d+", o)}


def smem_buffers(instrs):
    """Byte offsets of the operand and output buffers in dynamic shared memory, read off the
    TMA copies: loads (A, B, SFA, SFB in the producer's order) write ``[reg+imm]``; the output
    store reads ``[reg+imm]``."""
    loads, stores = [], []
    for _, op, ops in instrs:
        if op.startswith("cp.async.bulk.tensor"):
            if ".global.shared::" in op:
                stores.append(ops[1])
            else:
                loads.append(ops[0])
    base = [int(m.group(1)) for m in (re.search(r"\+(\d+)\]", x) for x in loads) if m]
    first = list(dict.fromkeys(base))[:4]
    out = re.search(r"\+(\d+)\]", stores[0])
    return dict(zip(("a", "b", "sfa", "sfb"), first, strict=True), c=int(out.group(1)))


def swizzle_of(nodes, defs, lo: int, hi: int):
    """(mask, shift) of the swizzle ``x ^ ((x >> shift) & mask)`` applied to an address ``x``
    whose expression adds a buffer offset in ``[lo, hi)``; None if no such XOR exists."""
    for op, ops in nodes:
        if op != "xor.b32":
            continue
        _, x, y = ops
        for s_reg, addr in ((x, y), (y, x)):
            for a_op, a_ops in defs.get(s_reg, []):
                if a_op != "and.b32" or not re.fullmatch(r"\d+", a_ops[2]):
                    continue
                for h_op, h_ops in defs.get(a_ops[1], []):
                    if h_op == "shr.u32" and h_ops[1] == addr and re.fullmatch(r"\d+", h_ops[2]):
                        inner = expression(addr, defs)
                        if any(lo <= v < hi for v in _imms(inner)):
                            return int(a_ops[2]), int(h_ops[2])
    return None


def smem_write_address(op: str, ops: list[str]) -> str | None:
    """The shared-memory address operand (``[...]``) an instruction writes through, or None
    for an instruction that writes no shared memory at a computed address. ``stmatrix``,
    ``st.async`` and ``red.async`` write shared memory whether or not they spell the state
    space; ``atom`` returns the old value in its first operand."""
    head = op.split(".")[0]
    if head == "stmatrix" or op.startswith(("st.async", "red.async")):
        return ops[0]
    if head in ("st", "red") and ".shared" in op:
        return ops[0]
    if head == "atom" and ".shared" in op:
        return ops[1]
    if op.startswith("cp.async.c") and ".shared" in op:  # cp.async.ca / .cg (not .bulk)
        return ops[0]
    return None


def shared_stores(ptx: str):
    """Every instruction that writes shared memory at a computed address, with the buffer it
    writes and the swizzle its address carries:
    [(line, opcode, buffer name or None, (mask, shift) or None)]."""
    instrs = parse(ptx)
    defs = definitions(instrs)
    bufs = smem_buffers(instrs)
    bounds = sorted(bufs.items(), key=lambda kv: kv[1])
    found = []
    for line, op, ops in instrs:
        addr = smem_write_address(op, ops)
        if addr is None:
            continue
        m = re.match(r"\[(%\w+)(?:\+(-?\d+))?\]", addr)
        if m is None:  # a symbol or immediate address: no buffer this reader can name
            found.append((line, op, None, None))
            continue
        nodes = expression(m.group(1), defs)
        imms = _imms(nodes) | ({int(m.group(2))} if m.group(2) else set())
        buf, swz = None, None
        for i, (name, lo) in enumerate(bounds):
            hi = bounds[i + 1][1] if i + 1 < len(bounds) else 1 << 30
            if any(lo <= v < hi for v in imms):
                buf = name
                swz = swizzle_of(nodes, defs, lo, hi)
        found.append((line, op, buf, swz))
    return found


def swizzle_signature(text: str) -> tuple[int, int]:
    """(mask, shift) of ``x ^ ((x >> shift) & mask)`` for a CuTe swizzle printed ``S<B,M,S>``:
    bits ``[M + S, M + S + B)`` are XORed into bits ``[M, M + B)``."""
    b, m, s = (int(v) for v in re.fullmatch(r"S<(\d+),(\d+),(\d+)>", text).groups())
    return ((1 << b) - 1) << m, s
