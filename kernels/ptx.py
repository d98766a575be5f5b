"""Inline-PTX wrappers for the SIMT kernels (kernels/quantize.py): the exact instruction of each
memory access and conversion, so the PTX/SASS checks in the tests can count them.

Every wrapper takes CuTeDSL integers (``Int32``/``Int64`` addresses and values) and returns
``Int32`` words; a ``pred`` argument of 0 turns a load into its default value and a store into
nothing (``setp.ne`` + a predicated instruction, no branch).
"""

from __future__ import annotations

from cutlass import Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def _asm(ret, args, text, constraints, side_effects, loc, ip):
    return llvm.inline_asm(
        ret, [a.ir_value(loc=loc, ip=ip) for a in args], text, constraints,
        has_side_effects=side_effects, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def ld_global_v4(addr, pred, *, loc=None, ip=None):
    """16 bytes from read-only global memory as 4 int32 words (zeros where ``pred`` is 0)."""
    st = llvm.StructType.get_literal([T.i32()] * 4)
    res = _asm(
        st, [Int64(addr), Int32(pred)],
        "{\n.reg .pred p;\nsetp.ne.b32 p, $5, 0;\n"
        "mov.b32 $0, 0;\nmov.b32 $1, 0;\nmov.b32 $2, 0;\nmov.b32 $3, 0;\n"
        "@p ld.global.nc.L1::no_allocate.v4.b32 {$0, $1, $2, $3}, [$4];\n}",
        "=r,=r,=r,=r,l,r", False, loc, ip,
    )
    return [Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def ld_global_b32(addr, pred, default: int, *, loc=None, ip=None):
    """One int32 from read-only global memory, ``default`` where ``pred`` is 0."""
    return Int32(_asm(
        T.i32(), [Int64(addr), Int32(pred)],
        "{\n.reg .pred p;\nsetp.ne.b32 p, $2, 0;\n"
        f"mov.b32 $0, {default};\n@p ld.global.nc.b32 $0, [$1];\n}}",
        "=r,l,r", False, loc, ip,
    ))


@dsl_user_op
def ld_global_u16(addr, pred, *, loc=None, ip=None):
    """One 16-bit element from read-only global memory, zero-extended (0 where ``pred`` is 0)."""
    return Int32(_asm(
        T.i32(), [Int64(addr), Int32(pred)],
        "{\n.reg .pred p;\nsetp.ne.b32 p, $2, 0;\n"
        "mov.b32 $0, 0;\n@p ld.global.nc.u16 $0, [$1];\n}",
        "=r,l,r", False, loc, ip,
    ))


@dsl_user_op
def st_global(addr, words, pred, *, loc=None, ip=None):
    """Store 1, 2 or 4 int32 words (4, 8, 16 bytes) where ``pred`` is nonzero."""
    n = len(words)
    vec = {1: "b32 [$0], $1", 2: "v2.b32 [$0], {$1, $2}", 4: "v4.b32 [$0], {$1, $2, $3, $4}"}[n]
    _asm(
        None, [Int64(addr), *[Int32(w) for w in words], Int32(pred)],
        f"{{\n.reg .pred p;\nsetp.ne.b32 p, ${n + 1}, 0;\n@p st.global.{vec};\n}}",
        "l," + ",".join(["r"] * (n + 1)), True, loc, ip,
    )


@dsl_user_op
def st_global_u8(addr, value, pred, *, loc=None, ip=None):
    _asm(
        None, [Int64(addr), Int32(value), Int32(pred)],
        "{\n.reg .pred p;\nsetp.ne.b32 p, $2, 0;\n@p st.global.u8 [$0], $1;\n}",
        "l,r,r", True, loc, ip,
    )


@dsl_user_op
def st_shared(addr, words, *, loc=None, ip=None):
    """Store 1 or 4 int32 words to shared memory (32-bit shared address)."""
    n = len(words)
    vec = {1: "b32 [$0], $1", 4: "v4.b32 [$0], {$1, $2, $3, $4}"}[n]
    _asm(
        None, [Int32(addr), *[Int32(w) for w in words]], f"st.shared.{vec};",
        "r," + ",".join(["r"] * n), True, loc, ip,
    )


@dsl_user_op
def st_shared_pred(addr, value, pred, *, loc=None, ip=None):
    _asm(
        None, [Int32(addr), Int32(value), Int32(pred)],
        "{\n.reg .pred p;\nsetp.ne.b32 p, $2, 0;\n@p st.shared.b32 [$0], $1;\n}",
        "r,r,r", True, loc, ip,
    )


@dsl_user_op
def ld_shared_b32(addr, *, loc=None, ip=None):
    # volatile (side effects) so that it is never hoisted above a barrier
    return Int32(_asm(T.i32(), [Int32(addr)], "ld.shared.b32 $0, [$1];", "=r,r", True, loc, ip))


@dsl_user_op
def ld_shared_v4(addr, *, loc=None, ip=None):
    st = llvm.StructType.get_literal([T.i32()] * 4)
    res = _asm(st, [Int32(addr)], "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];",
               "=r,=r,=r,=r,r", True, loc, ip)
    return [Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def cvt_e4m3x4(a, b, c, d, inv_scale_bits, *, loc=None, ip=None):
    """Four fp32 bit patterns times ``2^-e`` -> four E4M3 bytes in one int32 (``a`` lowest).

    ``mul.rn.f32`` (no ftz) then ``cvt.rn.satfinite.e4m3x2.f32``: round to nearest even,
    saturate to +-448 -- the reference's clamp-then-cast.
    """
    return Int32(_asm(
        T.i32(), [Int32(v) for v in (a, b, c, d, inv_scale_bits)],
        "{\n.reg .f32 fa, fb, fc, fd, s;\n.reg .b16 lo, hi;\n"
        "mov.b32 s, $5;\nmov.b32 fa, $1;\nmov.b32 fb, $2;\nmov.b32 fc, $3;\nmov.b32 fd, $4;\n"
        "mul.rn.f32 fa, fa, s;\nmul.rn.f32 fb, fb, s;\nmul.rn.f32 fc, fc, s;\n"
        "mul.rn.f32 fd, fd, s;\ncvt.rn.satfinite.e4m3x2.f32 lo, fb, fa;\n"
        "cvt.rn.satfinite.e4m3x2.f32 hi, fd, fc;\nmov.b32 $0, {lo, hi};\n}",
        "=r,r,r,r,r,r", False, loc, ip,
    ))


@dsl_user_op
def funnel_shift_right(lo, hi, n, *, loc=None, ip=None):
    """Low 32 bits of ``(hi:lo) >> n``, n clamped to 32 (``shf.r.clamp``)."""
    return Int32(_asm(T.i32(), [Int32(lo), Int32(hi), Int32(n)],
                      "shf.r.clamp.b32 $0, $1, $2, $3;", "=r,r,r,r", False, loc, ip))


@dsl_user_op
def f16_to_f32_bits(word, half: int, *, loc=None, ip=None):
    """fp32 bit pattern of the low (``half=0``) or high fp16 of a word (exact conversion)."""
    sel = "l" if half == 0 else "h"
    return Int32(_asm(
        T.i32(), [Int32(word)],
        "{\n.reg .b16 l, h;\n.reg .f32 f;\nmov.b32 {l, h}, $1;\n"
        f"cvt.f32.f16 f, {sel};\nmov.b32 $0, f;\n}}",
        "=r,r", False, loc, ip,
    ))
