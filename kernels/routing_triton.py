"""Triton kernels of the routing layout (`moe_mxfp8.routing`): the expert-sorted rows of a
step's (token, slot) pairs and the row tables of that buffer, in three launches.

The PyTorch composition they replace (`routing.route_layout` + `routing.row_tables`, which stay
the references and run on CPUs) is some fifty small device ops a step -- a stable sort, scatters,
cumulative sums, a search -- each a launch and some 30-60 us of host time on a GPU machine; the
layer's eager step is bound by such host time at short steps (docs/design/datapath.md). Every
value here is an integer, so the kernels equal the references exactly; the tests compare them
bit for bit (the interpreter on CPUs, the compiled kernels on the GPU).

Passes over the ``M = T * k`` pairs (expert ids ``ids``, row-major ``(T, k)``), ``CHUNK`` pairs a
program, ``EP`` = the expert count rounded up to a power of two (extra experts stay empty):

1. ``_hist_kernel``  (one program per chunk): ``hist[c, e]`` = the chunk's pairs of expert e.
2. ``_scan_kernel``  (one program): ``hist[c, e]`` becomes the pairs of expert e in the chunks
   before c; the last row ``hist[C, e]`` gets the padded start of group e (groups padded to
   ``align`` rows, their starts the exclusive sum of the padded sizes); ``offs`` the groups'
   ends, the last one the static extent ``M_pad`` (it absorbs the slack, as `route_layout`'s).
3. ``_place_kernel`` (one program per chunk, then one per ``TB`` table rows): a chunk's pair p of
   expert e lands on row ``start[e] + hist[c, e] + (earlier pairs of e in the chunk)`` -- a
   stable counting sort, so pairs keep their token order inside a group -- written to ``rows``
   and inverted into ``src``; the table programs cut ``[0, M_pad)`` into the row kernels'
   blocks (`kernels.datapath_triton`'s table) from ``offs``, and the first writes the
   quantizer's 128-row tile ends. ``row_tables`` alone (groups given as ``offs``) is this launch
   with no chunk programs.

``src`` starts as -1 (the pad rows'); with ``align`` 1 there are none and every row is written.
No atomics: the result does not depend on scheduling.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import on_device
from .mx_format import ROW_TABLE_COLS, TILE_ROWS, group_blocks_bound, padded_extent

CHUNK = 1024  # pairs per program of the histogram and placement passes
SCAN_ROWS, TABLE_ROWS = 32, 64  # at most: chunks per step of the prefix pass, table rows a program
MIN_EXPERTS = 16  # the expert axis is at least this wide (tl.arange, reductions)
ONE_HOT_ELEMS = 8192  # pairs x experts per step of a one-hot pass (registers of 4 warps)
TILE_ELEMS = 16384  # chunks or table rows x experts of the prefix and table tiles
# Triton types of the kernels' arguments for a build without a launch (the CPU tests' sm_90
# builds, tools/triton_sass.py): pointers not named here are uint8, other scalars int32
ARG_TYPES = {"ids_ptr": "*i64", **{n: "*i32" for n in ("hist_ptr", "rows_ptr", "src_ptr",
                                                       "offs_ptr", "tbl_ptr", "tile_ends_ptr")}}


def expert_width(num_experts: int) -> int:
    """``EP``: the expert axis of the kernels, a power of two >= ``num_experts``."""
    return max(MIN_EXPERTS, triton.next_power_of_2(num_experts))


def pairs_per_step(ep: int) -> int:
    """Pairs per step of the one-hot passes at expert width ``ep`` (512 at 16 experts, 16 at 512,
    at least 4): each step's ``(pairs, EP)`` tile in registers."""
    return max(4, ONE_HOT_ELEMS // ep)


def scan_rows(ep: int) -> int:
    """Chunks per step of the prefix pass at expert width ``ep`` (32 up to 512 experts)."""
    return max(2, min(SCAN_ROWS, TILE_ELEMS // ep))


def table_rows(ep: int) -> int:
    """Block-table rows per program at expert width ``ep`` (64 up to 256 experts)."""
    return max(2, min(TABLE_ROWS, TILE_ELEMS // ep))


@triton.jit(do_not_specialize=["M"])  # one build for every token count
def _hist_kernel(ids_ptr, hist_ptr, M, EP: tl.constexpr, CHUNK: tl.constexpr,
                 SB: tl.constexpr):
    c = tl.program_id(0)
    e = tl.arange(0, EP)
    acc = tl.zeros((EP,), dtype=tl.int32)
    for s in range(0, CHUNK, SB):
        p = c * CHUNK + s + tl.arange(0, SB)
        ids = tl.load(ids_ptr + p, mask=p < M, other=EP).to(tl.int32)  # EP: no expert
        acc += tl.sum((ids[:, None] == e[None, :]).to(tl.int32), axis=0)
    tl.store(hist_ptr + c * EP + e, acc)


@triton.jit(do_not_specialize=["NCH", "M_PAD"])
def _scan_kernel(hist_ptr, offs_ptr, NCH, E, M_PAD, ALIGN: tl.constexpr, EP: tl.constexpr,
                 CR: tl.constexpr):
    e = tl.arange(0, EP)
    carry = tl.zeros((EP,), dtype=tl.int32)
    c0 = 0
    while c0 < NCH:  # a while loop: Triton's interpreter cannot take a runtime range bound
        r = c0 + tl.arange(0, CR)
        ptr = hist_ptr + r[:, None] * EP + e[None, :]
        rmask = (r < NCH)[:, None]
        h = tl.load(ptr, mask=rmask, other=0)
        tl.store(ptr, carry[None, :] + tl.cumsum(h, axis=0) - h, mask=rmask)
        carry += tl.sum(h, axis=0)
        c0 += CR
    padded = (carry + (ALIGN - 1)) // ALIGN * ALIGN
    ends = tl.cumsum(padded, axis=0)
    tl.store(hist_ptr + NCH * EP + e, ends - padded)
    tl.store(offs_ptr + e, tl.where(e == E - 1, M_PAD, ends), mask=e < E)


@triton.jit
def _place_rows(ids_ptr, hist_ptr, rows_ptr, src_ptr, c, M, NCH, EP: tl.constexpr,
                CHUNK: tl.constexpr, SB: tl.constexpr):
    e = tl.arange(0, EP)
    nxt = tl.load(hist_ptr + c * EP + e) + tl.load(hist_ptr + NCH * EP + e)  # next row per expert
    for s in range(0, CHUNK, SB):
        p = c * CHUNK + s + tl.arange(0, SB)
        pmask = p < M
        ids = tl.load(ids_ptr + p, mask=pmask, other=EP).to(tl.int32)
        hot = (ids[:, None] == e[None, :]).to(tl.int32)
        before = tl.cumsum(hot, axis=0) - hot  # earlier pairs of the same expert in the step
        row = tl.sum(hot * (nxt[None, :] + before), axis=1)
        tl.store(rows_ptr + p, row, mask=pmask)
        tl.store(src_ptr + row, p, mask=pmask)
        nxt += tl.sum(hot, axis=0)


@triton.jit
def _pick(sel, v):
    """``v[g]`` for each row's one-hot ``sel`` over the expert axis."""
    return tl.sum(tl.where(sel, v[None, :], 0), axis=1)


@triton.jit
def _tables(offs_ptr, tbl_ptr, tile_ends_ptr, t, E, M_PAD, NB, BLK: tl.constexpr,
            TILE: tl.constexpr, EP: tl.constexpr, TB: tl.constexpr):
    e = tl.arange(0, EP)
    emask = e < E
    ends = tl.where(emask, tl.load(offs_ptr + e, mask=emask, other=0), M_PAD)
    starts = tl.where(emask, tl.load(offs_ptr + e - 1, mask=emask & (e > 0), other=0), M_PAD)
    sizes = ends - starts
    nblk = (sizes + (BLK - 1)) // BLK
    cum = tl.cumsum(nblk, axis=0)
    tiles = (sizes + (TILE - 1)) // TILE
    tile_ends = tl.cumsum(tiles, axis=0)
    if t == 0:
        tl.store(tile_ends_ptr + e, tile_ends, mask=emask)
    j = t * TB + tl.arange(0, TB)
    # each block's group: the groups whose block range ends at or before it (searchsorted)
    g = tl.sum(((cum[None, :] <= j[:, None]) & emask[None, :]).to(tl.int32), axis=1)
    valid = g < E
    g = tl.minimum(g, E - 1)
    sel = e[None, :] == g[:, None]
    start = _pick(sel, starts)
    lblk = j - _pick(sel, cum - nblk)
    rs = start + BLK * lblk
    re = tl.where(valid, tl.minimum(rs + BLK, _pick(sel, ends)), rs)
    before = _pick(sel, tile_ends - tiles)
    out = tbl_ptr + j * 6  # ROW_TABLE_COLS
    jmask = j < NB
    tl.store(out, rs, mask=jmask)
    tl.store(out + 1, re, mask=jmask)
    tl.store(out + 2, before * TILE - start, mask=jmask)
    tl.store(out + 3, before, mask=jmask)
    tl.store(out + 4, lblk, mask=jmask)
    tl.store(out + 5, _pick(sel, nblk), mask=jmask)


@triton.jit(do_not_specialize=["M", "NCH", "M_PAD", "NB"])
def _place_kernel(ids_ptr, hist_ptr, rows_ptr, src_ptr, offs_ptr, tbl_ptr, tile_ends_ptr, M,
                  NCH, E, M_PAD, NB, BLK: tl.constexpr, TILE: tl.constexpr, EP: tl.constexpr,
                  CHUNK: tl.constexpr, SB: tl.constexpr, TB: tl.constexpr):
    pid = tl.program_id(0)
    if pid < NCH:
        _place_rows(ids_ptr, hist_ptr, rows_ptr, src_ptr, pid, M, NCH, EP, CHUNK, SB)
    else:
        _tables(offs_ptr, tbl_ptr, tile_ends_ptr, pid - NCH, E, M_PAD, NB, BLK, TILE, EP, TB)


# ---------------------------------------------------------------------------------------------
# Host wrappers (allocation and launch; argument checks live in moe_mxfp8.routing)
# ---------------------------------------------------------------------------------------------


def _meta(num_experts: int) -> dict:
    ep = expert_width(num_experts)
    return {"EP": ep, "CHUNK": CHUNK, "SB": pairs_per_step(ep), "num_warps": 4}


def _place(ids, hist, rows, src, offs, m_pad, block, nch, num_experts, meta):
    """The placement launch: ``nch`` chunk programs, then the table programs of ``block``-row
    blocks (none for ``block`` 0: empty table and tile ends)."""
    nb = group_blocks_bound(m_pad, num_experts, block) if block else 0
    tbl = offs.new_empty(nb, ROW_TABLE_COLS)
    tile_ends = offs.new_empty(num_experts if block else 0)
    tb = table_rows(meta["EP"])
    grid = (nch + triton.cdiv(nb, tb),)
    if grid[0]:
        # BLK only shapes the table programs: without them, the 1x128 build serves
        _place_kernel[grid](ids, hist, rows, src, offs, tbl, tile_ends, ids.numel(), nch,
                            num_experts, m_pad, nb, BLK=block or TILE_ROWS, TILE=TILE_ROWS,
                            TB=tb, **meta)
    return tbl, tile_ends


def route_layout_tables(expert_ids: torch.Tensor, num_experts: int, align: int, block: int):
    """``expert_ids (T, k)`` (int32/int64, values in ``[0, E)``) -> ``rows (T, k)``, ``src
    (M_pad,)``, ``offs (E,)``, ``table (NB, 6)``, ``tile_ends (E,)``, all int32: `route_layout`
    with ``align`` and `row_tables` of ``block``-row blocks (``block`` 0: no tables, both
    returned empty)."""
    t, k = expert_ids.shape
    m = t * k
    m_pad = padded_extent(m, num_experts, align)
    meta = _meta(num_experts)
    ids = expert_ids.reshape(-1)
    ids = ids if ids.is_contiguous() else ids.contiguous()
    nch = triton.cdiv(m, CHUNK)
    hist = ids.new_empty((nch + 1) * meta["EP"], dtype=torch.int32)
    rows = hist.new_empty(t, k)
    # pad rows keep -1; with align 1 there are none
    src = hist.new_empty(m_pad) if align == 1 else hist.new_full((m_pad,), -1)
    offs = hist.new_empty(num_experts)
    with on_device(ids.device):
        if nch:
            _hist_kernel[(nch,)](ids, hist, m, **meta)
        _scan_kernel[(1,)](hist, offs, nch, num_experts, m_pad, ALIGN=align, EP=meta["EP"],
                           CR=scan_rows(meta["EP"]), num_warps=4)
        tbl, tile_ends = _place(ids, hist, rows, src, offs, m_pad, block, nch, num_experts, meta)
    return rows, src, offs, tbl, tile_ends


def row_tables(offs: torch.Tensor, m: int, block: int):
    """``offs (E,)`` int32 group ends (the last == ``m``) -> ``table (NB, 6)`` and
    ``tile_ends (E,)``, int32: `routing.row_tables`."""
    e = offs.numel()
    meta = _meta(e)
    with on_device(offs.device):
        return _place(offs, offs, offs, offs, offs, m, block, 0, e, meta)
