"""The routing layout of the MoE data path: where each (token, slot) pair goes in the
expert-sorted buffer, and the one check of the index tensors that describe it.

The ``T*k`` (token, slot) pairs are sorted by expert (stable) into a buffer of ``M`` rows whose
expert groups start on multiples of ``align`` rows (16 for the MXFP8 layer: the Hopper wgrad
kernel's TMA alignment; 128 for its "1x128" recipe; 1 for BF16: no padding). `route_layout`
gives, on the device and without a host sync::

    rows (T, k) int32   row of pair (t, j) in the sorted buffer
    src  (M,)   int32   pair index t*k + j of each row, -1 for the zero pad rows
    offs (E,)   int32   cumulative group ends; offs[-1] == M = padded_extent(T*k, E, align)

`sorted_layout` gives the same tensors for rows that already come sorted by expert, one slot
each, from the counts alone (no sort). `block_table` cuts that buffer into the row kernels'
blocks (`moe_mxfp8.stages`).

These PyTorch compositions are the references and the CPU path. On a GPU, `step_layout` runs
the same integers as three Triton launches (`kernels.routing_triton`, operator
``moe_mxfp8::route_layout_tables``; the row tables alone: ``moe_mxfp8::row_tables``) instead of
some fifty small device ops, each of which costs host time.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from . import checks as C
from . import layout as L
from .kernels.mx_format import ROW_TABLE_COLS, group_blocks_bound, padded_extent
from .op_library import define_op

INDEX_DTYPES = (torch.int32, torch.int64)  # rows / src: every backend indexes with either



def route_layout(expert_ids: Tensor, counts: Tensor, align: int) -> tuple[Tensor, Tensor, Tensor]:
    """``expert_ids (T, k)`` and ``counts (E,)`` -> ``rows (T, k)``, ``src (M,)``, ``offs (E,)``
    (int32, on the ids' device, no host sync; see the module doc). Pairs keep their token order
    inside a group (stable sort). The last group absorbs the slack up to the static extent."""
    _check_align("route_layout", align)
    t, k = expert_ids.shape
    m = t * k
    flat = expert_ids.reshape(-1)
    sorted_ids, order = torch.sort(flat, stable=True)
    shift, m_pad, offs = _groups(counts, m, align)
    rows_sorted = torch.arange(m, device=flat.device)
    if shift is None:  # no padding: each pair's row is its sorted position, src is the order
        src = order
    else:
        rows_sorted = rows_sorted + shift[sorted_ids]
        src = torch.full((m_pad,), -1, dtype=torch.int64, device=flat.device)
        src = src.scatter_(0, rows_sorted, order)
    rows = torch.empty_like(order).scatter_(0, order, rows_sorted)
    return rows.to(torch.int32).reshape(t, k), src.to(torch.int32), offs


def sorted_layout(counts: Tensor, m: int, align: int) -> tuple[Tensor, Tensor, Tensor]:
    """The layout of ``m`` rows that already come sorted by expert, one slot each (``counts
    (E,)`` rows per expert, summing to ``m``: torchtitan's grouped tokens): ``rows (m, 1)``,
    ``src``, ``offs`` as `route_layout` gives them for those rows' expert ids, bit for bit,
    without its sort (on the counts' device, no host sync)."""
    _check_align("sorted_layout", align)
    if C.values_on_host(counts) and int(counts.sum()) != m:
        raise ValueError(f"sorted_layout: counts must sum to m={m}, got {int(counts.sum())}")
    shift, m_pad, offs = _groups(counts, m, align)
    r = torch.arange(m, device=counts.device)
    # each row's expert: the first group that ends past it (empty groups end where they start)
    g = torch.searchsorted(torch.cumsum(counts.to(torch.int64), 0), r, right=True)
    rows = r if shift is None else shift[g] + r
    src = torch.full((m_pad,), -1, dtype=torch.int64, device=counts.device).scatter_(0, rows, r)
    return rows.to(torch.int32)[:, None], src.to(torch.int32), offs


def _check_align(who: str, align) -> None:
    if not isinstance(align, int) or align < 1:
        raise ValueError(f"{who}: align must be a positive int, got {align!r}")


def _groups(counts: Tensor, m: int, align: int) -> tuple[Tensor | None, int, Tensor]:
    """The padded groups of ``m`` sorted pairs, ``counts (E,)`` per expert: each group's shift
    from its sorted position to its row (int64; None for ``align`` 1: no padding, no shift),
    the static extent ``M``, and ``offs`` (int32). The last group absorbs the slack up to ``M``."""
    counts = counts.to(torch.int64)
    m_pad = padded_extent(m, counts.numel(), align)
    shift = None
    padded = counts
    if align > 1:
        padded = (counts + (align - 1)) // align * align
        slack = padded - counts
        shift = torch.cumsum(slack, 0) - slack  # the padding of the groups before
    # The last end is the static extent, padded on the device (writing a Python int into a CUDA
    # tensor is a host->device copy, which syncs).
    offs = F.pad(torch.cumsum(padded[:-1], 0, dtype=torch.int32), (0, 1), value=m_pad)
    return shift, m_pad, offs


def _layout_kernels():
    """`kernels.routing_triton`; imported on the first GPU call (it needs Triton)."""
    from .kernels import routing_triton

    return routing_triton


@define_op("moe_mxfp8::route_layout_tables")
def _route_layout_tables(expert_ids: Tensor, num_experts: int, align: int, block: int
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`route_layout` + `row_tables` on the GPU (`kernels.routing_triton`): ``rows, src, offs,
    table, tile_ends``, int32 (``block`` 0: no tables, both empty)."""
    return _layout_kernels().route_layout_tables(expert_ids, num_experts, align, block)


@_route_layout_tables.register_fake
def _route_layout_tables_fake(expert_ids, num_experts, align, block):
    t, k = expert_ids.shape
    m = padded_extent(t * k, num_experts, align)
    new = functools.partial(expert_ids.new_empty, dtype=torch.int32)
    nb = group_blocks_bound(m, num_experts, block) if block else 0
    return (new(t, k), new(m), new(num_experts), new(nb, ROW_TABLE_COLS),
            new(num_experts if block else 0))


@define_op("moe_mxfp8::row_tables")
def _row_tables_kernel(offs: Tensor, m: int, block: int) -> tuple[Tensor, Tensor]:
    """`row_tables` on the GPU (`kernels.routing_triton`): ``table, tile_ends``, int32."""
    return _layout_kernels().row_tables(offs.to(torch.int32), m, block)


@_row_tables_kernel.register_fake
def _row_tables_fake(offs, m, block):
    e = offs.numel()
    new = functools.partial(offs.new_empty, dtype=torch.int32)
    return new(group_blocks_bound(m, e, block), ROW_TABLE_COLS), new(e)


def step_layout(expert_ids: Tensor, counts: Tensor, align: int, block: int | None,
                kernels: bool) -> tuple[Tensor, Tensor, Tensor, tuple[Tensor, Tensor] | None]:
    """A step's layout and row tables: ``rows, src, offs`` (`route_layout`) and, with
    ``kernels`` (the data path's GPU kernels run: they read the tables) and a ``block``,
    ``(table, tile_ends)`` of ``block``-row blocks (`row_tables`), else None. On ``kernels``
    the Triton launches of ``moe_mxfp8::route_layout_tables`` give them all (the same integers;
    they read the counts off ``expert_ids`` themselves)."""
    _check_align("step_layout", align)
    if not kernels:
        return (*route_layout(expert_ids, counts, align), None)
    rows, src, offs, table, tile_ends = torch.ops.moe_mxfp8.route_layout_tables(
        expert_ids, counts.numel(), align, block or 0)
    return rows, src, offs, None if block is None else (table, tile_ends)


def check_index(who: str, name: str, t, ndim: int, like: Tensor, lo: int = 0,
                hi: int | None = None) -> None:
    """An index tensor of the data path (``rows``, ``src``, the EP payload's row index): int32
    (route_layout's) or int64, ``ndim``-D on ``like``'s device, any strides (the kernels read
    dense copies). Its values, in ``[lo, hi)``, are read only where that costs no device sync
    (CPU tensors): the rule depends on the device, not the backend."""
    if not isinstance(t, Tensor) or t.dtype not in INDEX_DTYPES:
        what = t.dtype if isinstance(t, Tensor) else type(t).__name__
        raise TypeError(f"{who}: {name} must be an int32 or int64 tensor, got {what}")
    if t.dim() != ndim or t.device != like.device:
        raise ValueError(f"{who}: {name} must be {ndim}D on {like.device}, got shape "
                         f"{tuple(t.shape)} on {t.device}")
    if hi is None or t.numel() == 0 or not C.values_on_host(t):
        return
    t_min, t_max = int(t.min()), int(t.max())
    if t_min < lo or t_max >= hi:
        raise ValueError(f"{who}: {name} values must lie in [{lo}, {hi}), got "
                         f"[{t_min}, {t_max}]")


def check_layout(who: str, like: Tensor, m: int, *, rows: Tensor | None = None,
                 src: Tensor | None = None, offs: Tensor | None = None,
                 pairs: int | None = None) -> None:
    """The index tensors of a `route_layout` layout of ``m`` sorted rows, as the stage ``who``
    gets them (`check_index`): ``rows (T, k)`` in ``[0, m)``, ``src (m,)`` in ``[-1, pairs)``,
    ``offs`` (the one `checks.check_offs`, last == m), all on ``like``'s device."""
    if rows is not None:
        check_index(who, "rows", rows, 2, like, 0, m)
    if src is not None:
        check_index(who, "src", src, 1, like, -1, pairs)
        if src.numel() != m:
            raise ValueError(f"{who}: src has {src.numel()} rows but the sorted buffer has {m}")
    if offs is not None:
        C.check_offs(offs, m)
        if offs.device != like.device:
            raise ValueError(f"{who}: offs is on {offs.device} but the data is on {like.device}")


def numel_of(t) -> int:
    """Rows of an index tensor, 0 for what is not one (`check_layout` then names it)."""
    return t.numel() if isinstance(t, Tensor) else 0


def block_table(offs: Tensor, m: int, block: int = L.BLOCK_SIZE) -> Tensor:
    """int32 ``(ceil-bound, 6)`` table of the ``block``-row blocks of the sorted buffer (blocks
    restart at each group; ``block`` the activation block length, 32 or 128):
    ``rs, re, prow0, tiles, lblk, nblk`` (see `kernels.datapath_triton`)."""
    return row_tables(offs, m, block)[0]


def row_tables(offs: Tensor, m: int, block: int = L.BLOCK_SIZE) -> tuple[Tensor, Tensor]:
    """The step's tables of the sorted buffer's rows, from one pass: `block_table` and the
    groups' cumulative 128-row tile ends (int32 ``(E,)``, the grouped quantizers' table,
    `kernels.quantize_launch.group_tile_ends`; the block table counts the same tiles)."""
    e = offs.numel()
    nb_bound = group_blocks_bound(m, e, block)
    ends = offs.to(torch.int64)
    starts = F.pad(ends[:-1], (1, 0))
    sizes = ends - starts
    nblk = (sizes + (block - 1)) // block
    cum = torch.cumsum(nblk, 0)
    tiles = (sizes + (L.TILE_ROWS - 1)) // L.TILE_ROWS
    tile_ends = torch.cumsum(tiles, 0, dtype=torch.int32)
    tiles_before = tile_ends - tiles
    j = torch.arange(nb_bound, device=offs.device)
    g = torch.searchsorted(cum, j, right=True)
    valid = g < e
    g = g.clamp(max=e - 1)
    lblk = j - (cum - nblk)[g]
    start = starts[g]
    rs = start + block * lblk
    re = torch.where(valid, torch.minimum(rs + block, ends[g]), rs)
    before = tiles_before[g]
    prow0 = before * L.TILE_ROWS - start
    tbl = torch.stack([rs, re, prow0, before, lblk, nblk[g]], 1)  # ROW_TABLE_COLS
    return tbl.to(torch.int32), tile_ends
