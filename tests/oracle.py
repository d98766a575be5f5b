"""An independent scalar oracle of the MXFP8 contract, in plain Python floats (exact).

It shares no code with `moe_mxfp8.reference`: exponents come from `math.frexp` and comparisons
against 448 * 2^e; E4M3 rounding is a nearest search over the 256-entry code table with ties to
the even code. Slow: for small property tests only.
"""

from __future__ import annotations

import math

E4M3_MAX = 448.0


def _e4m3_value(code: int) -> float:
    s = -1.0 if code & 0x80 else 1.0
    e = (code >> 3) & 0xF
    m = code & 0x7
    if e == 0:
        return s * m * 2.0**-9
    return s * (1 + m / 8) * 2.0 ** (e - 7)


# Non-negative finite codes 0x00..0x7E in increasing order of value.
POS_CODES = list(range(0x7F))
POS_VALUES = [_e4m3_value(c) for c in POS_CODES]


def e4m3_rne_satfinite(v: float) -> int:
    """Byte of v rounded to nearest-even E4M3, saturating to +-448; sign of zero kept."""
    neg = math.copysign(1.0, v) < 0
    a = min(abs(v), E4M3_MAX)
    best = 0
    for c, val in zip(POS_CODES, POS_VALUES, strict=True):
        if val <= a:
            best = c
        else:
            break
    lo = POS_VALUES[best]
    if lo != a and best < 0x7E:
        hi = POS_VALUES[best + 1]
        if a - lo > hi - a or (a - lo == hi - a and best % 2 == 1):
            best += 1
    return best | (0x80 if neg else 0)


def scale_exponent(amax: float, rounding: str) -> int | None:
    """Unbiased e, or None for a NaN/Inf block."""
    if math.isnan(amax) or math.isinf(amax):
        return None
    if amax == 0:
        return -127
    if rounding == "floor":
        _, p = math.frexp(amax)  # amax = f * 2^p, f in [0.5, 1)
        e = (p - 1) - 8
    else:
        e = math.frexp(amax / E4M3_MAX)[1] + 2  # a safe over-estimate, then walk down
        while math.ldexp(E4M3_MAX, e - 1) >= amax:
            e -= 1
        while math.ldexp(E4M3_MAX, e) < amax:
            e += 1
    return max(-127, min(127, e))


def quantize_block(values: list[float], rounding: str) -> tuple[list[int | None], int]:
    """(element bytes, or None where unspecified; scale byte) of one block."""
    amax = 0.0
    for v in values:
        if math.isnan(v):
            amax = math.nan
            break
        amax = max(amax, abs(v))
    e = scale_exponent(amax, rounding)
    if e is None:
        return [None] * len(values), 0xFF
    return [e4m3_rne_satfinite(math.ldexp(v, -e)) for v in values], e + 127
