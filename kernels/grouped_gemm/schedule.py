"""The device tile schedule of the grouped GEMMs: one walk over ``offs`` for every arch.

Work units are output tiles numbered group by group: M-grouped, group g owns
``ceil(m_g / tile_m) * ceil(n / tile_n)`` units (its m-tiles); K-grouped, every group owns
``ceil(n / tile_m) * ceil(k / tile_n)`` units of its ``(n, k)`` output, an empty group
included (its units store zeros). Inside a group the x tile (n-tile M-grouped, k-tile
K-grouped) is fastest, or the walk goes in bands of ``band_m`` rows of tiles, the rows
fastest inside a band (`tile_coords`). A persistent CTA (or cluster) visits units
``u, u + stride, ...`` in increasing order, so each role keeps a **cursor** over the groups that
only moves forward: ``cur = (g, unit_base, tok_start, tok_end, tiles128_before)`` -- group g,
its first unit, its token range and ``sum_{h<g} ceil(m_h/128)`` (the packed-scale base of the
contract's grouped layouts). ``g == E`` ends the walk. ``offs`` is read on the device; nothing
is synchronised with the host, and group ends are clamped to ``[0, num_tokens]`` so that a
malformed ``offs`` can neither store outside the output nor read past the operands.

Scalar code (no warp collectives): every role runs it in every thread, and the host emulation
of the sm100 kernel (tests/kernels/sm100_emu.py) runs the same code on the CPU. The packed
scale tiles of a unit come from `problem.scale_tile_index`, the one copy of that arithmetic.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .. import mx_format as F
from .host import TILE_K
from .problem import MODE_M, output_columns, scale_tile_index


class GroupedTileSchedule:
    """The walk for one compiled kernel: ``mode``, static ``n``/``k`` and the output tile
    ``tile_m x tile_n`` (M-grouped: rows of ``a`` x columns; K-grouped: rows of ``a`` x rows of
    ``b``), the raster band ``band_m`` (rows of tiles per band; 1: row by row) and
    ``x_granule``: tiles along x that stay adjacent in the walk (a cluster's CTAs, which share
    the A rows). Bind the runtime token count with `bind` inside the kernel before walking."""

    def __init__(self, mode: str, n: int, k: int, tile_m: int, tile_n: int, band_m: int = 1,
                 x_granule: int = 1):
        self.mode = mode
        self.n, self.k = n, k
        self.tile_m, self.tile_n = tile_m, tile_n
        self.is_m = mode == MODE_M
        self.band_m, self.x_granule = band_m, x_granule
        # units along the fast axis of a group's tile grid (static)
        self.tiles_x = -(-output_columns(mode, n, k) // tile_n)
        if band_m < 1 or x_granule < 1 or self.tiles_x % x_granule:
            raise ValueError("band_m >= 1, and x_granule must divide the tiles along x")
        self.num_tokens = None

    def bind(self, num_tokens: Int32) -> None:
        """Device: the token count that group ends are clamped to."""
        self.num_tokens = num_tokens

    @cute.jit
    def units_of_group(self, m_g: Int32) -> Int32:
        if cutlass.const_expr(self.is_m):
            return ((m_g + self.tile_m - 1) // self.tile_m) * self.tiles_x
        return ((self.n + self.tile_m - 1) // self.tile_m) * self.tiles_x

    @cute.jit
    def group_end(self, offs: cute.Tensor, g: Int32) -> Int32:
        """``offs[g]`` clamped to ``[0, num_tokens]`` (the host never validates device offs)."""
        return cutlass.min(cutlass.max(offs[g], Int32(0)), self.num_tokens)

    @cute.jit
    def start(self, offs: cute.Tensor):
        """The cursor at group 0."""
        return Int32(0), Int32(0), Int32(0), self.group_end(offs, Int32(0)), Int32(0)

    @cute.jit
    def seek(self, offs: cute.Tensor, unit: Int32, cur):
        """Advance ``cur`` to the group that owns work unit ``unit`` (``g == E``: none)."""
        g, base, t0, t1, tb = cur
        num_groups = cute.size(offs)
        done = g >= num_groups
        if not done:
            done = unit < base + self.units_of_group(t1 - t0)
        while not done:
            m_g = t1 - t0
            base = base + self.units_of_group(m_g)
            tb = tb + (m_g + F.TILE_ROWS - 1) // F.TILE_ROWS
            g = g + 1
            t0 = t1
            if g < num_groups:
                t1 = self.group_end(offs, g)
                done = unit < base + self.units_of_group(t1 - t0)
            else:
                done = True
        return g, base, t0, t1, tb

    @cute.jit
    def tile_coords(self, unit: Int32, cur):
        """(mt, nt): the unit's tile coordinates inside its group. ``band_m == 1``: nt fastest.
        Otherwise the group's rows of tiles form bands of ``band_m`` (the last one shorter)
        walked one after the other, each x-granule by x-granule (``x_granule`` adjacent nt)
        with the band's rows fastest: the CTAs running at once then share a few B tiles
        instead of streaming all of B once per row of tiles, which at large sizes does not
        fit in L2 (docs/design/hopper_gemm.md, "1x128 specifics")."""
        _, base, t0, t1, _ = cur
        local = unit - base
        if cutlass.const_expr(self.band_m == 1):
            mt = local // self.tiles_x
            nt = local % self.tiles_x
        else:
            m_tiles = self.units_of_group(t1 - t0) // self.tiles_x
            gran = self.x_granule
            per_band = self.band_m * (self.tiles_x // gran)
            gl = local // gran  # granule index; local % gran: the CTA's rank in it
            band = gl // per_band
            rows = cutlass.min(m_tiles - band * self.band_m, self.band_m)
            idx = gl - band * per_band
            mt = band * self.band_m + idx % rows
            nt = (idx // rows) * gran + local % gran
        return mt, nt

    @cute.jit
    def k_tiles(self, cur) -> Int32:
        """k-tiles of the unit's reduction: static M-grouped, the group's tokens K-grouped."""
        _, _, t0, t1, _ = cur
        if cutlass.const_expr(self.is_m):
            return Int32((self.k + TILE_K - 1) // TILE_K)
        return (t1 - t0 + TILE_K - 1) // TILE_K

    @cute.jit
    def origins(self, mt: Int32, nt: Int32, cur):
        """(first row of A's tile, first row of B's tile, B's batch index, first reduced
        element): M-grouped, A rows start at the group's first token and B is expert g;
        K-grouped, both read the group's tokens from its first one."""
        g, _, t0, _, _ = cur
        if cutlass.const_expr(self.is_m):
            return t0 + mt * self.tile_m, nt * self.tile_n, g, Int32(0)
        return mt * self.tile_m, nt * self.tile_n, Int32(0), t0

    @cute.jit
    def scale_tiles(self, mt: Int32, nt: Int32, v: Int32, cur):
        """`problem.scale_tile_index` of this unit (``v``: the 128-row slice of A's tile)."""
        g, _, t0, t1, tb = cur
        return scale_tile_index(self.mode, self.n, self.k, self.tile_m, self.tile_n, mt, nt, v,
                                g, t1 - t0, tb)
