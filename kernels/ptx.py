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


# ---------------------------------------------------------------------------------------------
# SwiGLU arithmetic, bit for bit PyTorch's BF16 `F.silu(gate) * up` and its autograd
# ---------------------------------------------------------------------------------------------

# ``den = 1 + exp(-g)`` for fp32 ``g`` in register ``g``, into ``den``: libdevice's ``expf``
# (the one PyTorch's CUDA silu calls; its range reduction, 2^j from the exponent bits and
# ``ex2.approx``) with the final ``2^j * ex2`` fused into the ``+ 1`` -- the instruction sequence
# Triton emits for ``1.0 + libdevice.exp(-g)``, which the data path's GPU tests hold bit-equal to
# PyTorch's. Registers it uses: t, m, n, p, q, e (f32) and j (b32).
_ONE_PLUS_EXP_NEG = (
    "sub.rn.f32 t, 0f00000000, g;\n"
    "fma.rn.ftz.f32 m, t, 0f3BBB989D, 0f3F000000;\n"
    "cvt.ftz.sat.f32.f32 m, m;\n"
    "fma.rm.ftz.f32 n, m, 0f437C0000, 0f4B400001;\n"
    "add.rn.f32 p, n, 0fCB40007F;\n"
    "neg.f32 p, p;\n"
    "fma.rn.ftz.f32 q, t, 0f3FB8AA3B, p;\n"
    "fma.rn.ftz.f32 q, t, 0f32A57060, q;\n"
    "mov.b32 j, n;\n"
    "shl.b32 j, j, 23;\n"
    "mov.b32 e, j;\n"
    "ex2.approx.ftz.f32 q, q;\n"
    "fma.rn.f32 den, q, e, 0f3F800000;\n"
)
_SWIGLU_REGS = ".reg .f32 g, u, d, t, m, n, p, q, e, den, s, r;\n.reg .b32 j;\n"


@dsl_user_op
def swiglu_bf16x2(g_word, u_word, *, loc=None, ip=None):
    """Two BF16 ``silu(gate) * up`` (one 32-bit word, low half first) from the words of two
    gate and two up BF16 values: silu in fp32 (``g / (1 + exp(-g))``, IEEE division) rounded to
    BF16, the product of two BF16 values (exact in fp32) rounded to BF16."""
    half = (
        "mov.b32 g, {z, gh%(i)d};\nmov.b32 u, {z, uh%(i)d};\n" + _ONE_PLUS_EXP_NEG
        + "div.rn.f32 s, g, den;\ncvt.rn.bf16.f32 sb, s;\nmov.b32 s, {z, sb};\n"
        "mul.rn.f32 r, s, u;\ncvt.rn.bf16.f32 o%(i)d, r;\n"
    )
    return Int32(_asm(
        T.i32(), [Int32(g_word), Int32(u_word)],
        "{\n" + _SWIGLU_REGS + ".reg .b16 z, sb, gh0, gh1, uh0, uh1, o0, o1;\n"
        "mov.b16 z, 0;\nmov.b32 {gh0, gh1}, $1;\nmov.b32 {uh0, uh1}, $2;\n"
        + half % {"i": 0} + half % {"i": 1} + "mov.b32 $0, {o0, o1};\n}",
        "=r,r,r", False, loc, ip,
    ))


# dup = bf16(dA * bf16(silu(g))), from ``s`` = silu(g) in fp32, into ``ou``
_DUP = "cvt.rn.bf16.f32 sb, s;\nmov.b32 r, {z, sb};\nmul.rn.f32 r, d, r;\ncvt.rn.bf16.f32 ou, r;\n"
# dgate = bf16(sig * bf16(dA * up) * fma(1 - sig, g, 1)), from ``s`` = sig, into ``og``
_DGATE = (
    "mul.rn.f32 r, u, d;\ncvt.rn.bf16.f32 sb, r;\nmov.b32 r, {z, sb};\n"
    "mul.rn.f32 r, s, r;\nsub.rn.f32 t, 0f3F800000, s;\nfma.rn.f32 t, t, g, 0f3F800000;\n"
    "mul.rn.f32 r, r, t;\ncvt.rn.bf16.f32 og, r;\n"
)


@dsl_user_op
def swiglu_grad_bf16x2(g_word, u_word, da_word, is_up, *, loc=None, ip=None):
    """Two BF16 elements of ``dgate`` (``is_up`` 0) or ``dup`` (``is_up`` nonzero) from the
    words of gate, up and dA, as PyTorch's autograd of `F.silu(gate) * up` in BF16 computes
    them: ``dup = bf16(dA * bf16(silu(g)))``; ``dgate = bf16(sig * bf16(dA * up) * (1 + g * (1
    - sig)))`` with ``sig = 1 / (1 + exp(-g))`` (its CUDA silu_backward, the inner ``1 + ...``
    one fma). Both are computed, one kept (tiles that straddle the halves); one division."""
    elem = (
        "mov.b32 g, {z, gh%(i)d};\nmov.b32 u, {z, uh%(i)d};\nmov.b32 d, {z, dh%(i)d};\n"
        + _ONE_PLUS_EXP_NEG + "selp.f32 s, g, 0f3F800000, up;\ndiv.rn.f32 s, s, den;\n"
        + _DUP + _DGATE + "selp.b16 o%(i)d, ou, og, up;\n"
    )
    return Int32(_asm(
        T.i32(), [Int32(g_word), Int32(u_word), Int32(da_word), Int32(is_up)],
        "{\n" + _SWIGLU_REGS + ".reg .pred up;\n"
        ".reg .b16 z, sb, ou, og, gh0, gh1, uh0, uh1, dh0, dh1, o0, o1;\n"
        "setp.ne.b32 up, $4, 0;\nmov.b16 z, 0;\nmov.b32 {gh0, gh1}, $1;\n"
        "mov.b32 {uh0, uh1}, $2;\nmov.b32 {dh0, dh1}, $3;\n"
        + elem % {"i": 0} + elem % {"i": 1} + "mov.b32 $0, {o0, o1};\n}",
        "=r,r,r,r,r", False, loc, ip,
    ))


@dsl_user_op
def scale_bf16x2(word, w_bits, *, loc=None, ip=None):
    """Two BF16 ``g`` (one word, low half first) times ``bf16(w)`` (``w_bits``: an fp32 bit
    pattern rounded to BF16 first), each product rounded to BF16: PyTorch's ``g * w.to(bf16)``
    (the product of two BF16 values is exact in fp32, so one rounding)."""
    return Int32(_asm(
        T.i32(), [Int32(word), Int32(w_bits)],
        "{\n.reg .f32 w, a, b;\n.reg .b16 z, wb, lo, hi, oa, ob;\n"
        "mov.b16 z, 0;\nmov.b32 w, $2;\ncvt.rn.bf16.f32 wb, w;\nmov.b32 w, {z, wb};\n"
        "mov.b32 {lo, hi}, $1;\nmov.b32 a, {z, lo};\nmov.b32 b, {z, hi};\n"
        "mul.rn.f32 a, a, w;\nmul.rn.f32 b, b, w;\n"
        "cvt.rn.bf16.f32 oa, a;\ncvt.rn.bf16.f32 ob, b;\nmov.b32 $0, {oa, ob};\n}",
        "=r,r,r", False, loc, ip,
    ))


@dsl_user_op
def dot_bf16x2(acc_bits, g_word, y_word, *, loc=None, ip=None):
    """fp32 ``acc + bf16(g0 * y0) + bf16(g1 * y1)`` (bit patterns; the words' low halves
    first): the routing-weight gradient's BF16 products, summed in fp32."""
    return Int32(_asm(
        T.i32(), [Int32(acc_bits), Int32(g_word), Int32(y_word)],
        "{\n.reg .f32 s, g, y;\n.reg .b16 z, g0, g1, y0, y1, p;\n"
        "mov.b16 z, 0;\nmov.b32 s, $1;\nmov.b32 {g0, g1}, $2;\nmov.b32 {y0, y1}, $3;\n"
        "mov.b32 g, {z, g0};\nmov.b32 y, {z, y0};\nmul.rn.f32 g, g, y;\n"
        "cvt.rn.bf16.f32 p, g;\nmov.b32 g, {z, p};\nadd.rn.f32 s, s, g;\n"
        "mov.b32 g, {z, g1};\nmov.b32 y, {z, y1};\nmul.rn.f32 g, g, y;\n"
        "cvt.rn.bf16.f32 p, g;\nmov.b32 g, {z, p};\nadd.rn.f32 s, s, g;\n"
        "mov.b32 $0, s;\n}",
        "=r,r,r,r", False, loc, ip,
    ))


@dsl_user_op
def add_f32_bits(a, b, *, loc=None, ip=None):
    """fp32 ``a + b`` on bit patterns (round to nearest even)."""
    return Int32(_asm(T.i32(), [Int32(a), Int32(b)],
                      "{\n.reg .f32 x, y;\nmov.b32 x, $1;\nmov.b32 y, $2;\n"
                      "add.rn.f32 x, x, y;\nmov.b32 $0, x;\n}", "=r,r,r", False, loc, ip))


@dsl_user_op
def swiglu_grad_pair_bf16x2(g_word, u_word, da_word, *, loc=None, ip=None):
    """``(dgate word, dup word)``: `swiglu_grad_bf16x2`'s two halves from one ``1 + exp(-g)``
    (a gate/up feature pair: one exp, the two divisions)."""
    elem = (
        "mov.b32 g, {z, gh%(i)d};\nmov.b32 u, {z, uh%(i)d};\nmov.b32 d, {z, dh%(i)d};\n"
        + _ONE_PLUS_EXP_NEG
        + "div.rn.f32 s, g, den;\n" + _DUP + "mov.b16 pu%(i)d, ou;\n"
        + "div.rn.f32 s, 0f3F800000, den;\n" + _DGATE + "mov.b16 pg%(i)d, og;\n"
    )
    st = llvm.StructType.get_literal([T.i32()] * 2)
    res = _asm(
        st, [Int32(g_word), Int32(u_word), Int32(da_word)],
        "{\n" + _SWIGLU_REGS
        + ".reg .b16 z, sb, ou, og, gh0, gh1, uh0, uh1, dh0, dh1, pg0, pg1, pu0, pu1;\n"
        "mov.b16 z, 0;\nmov.b32 {gh0, gh1}, $2;\nmov.b32 {uh0, uh1}, $3;\n"
        "mov.b32 {dh0, dh1}, $4;\n"
        + elem % {"i": 0} + elem % {"i": 1}
        + "mov.b32 $0, {pg0, pg1};\nmov.b32 $1, {pu0, pu1};\n}",
        "=r,=r,r,r,r", False, loc, ip,
    )
    return [Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(2)]
