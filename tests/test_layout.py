"""Packed scale layouts against an independent loop implementation of the contract."""

from __future__ import annotations

import pytest
import torch

from moe_mxfp8 import layout as L


def _loop_pack(dense: torch.Tensor) -> torch.Tensor:
    """Tile by tile, as the contract describes it in words: 512-byte tiles of 128 rows x 4
    blocks, row-tile-major; inside a tile, row r sits at (r % 32) * 16 + (r // 32) * 4."""
    rows, nb = dense.shape
    row_tiles, col_tiles = -(-rows // 128), -(-nb // 4)
    out = bytearray(row_tiles * col_tiles * 512)
    for rt in range(row_tiles):
        for ct in range(col_tiles):
            base = (rt * col_tiles + ct) * 512
            for rr in range(128):
                for cc in range(4):
                    r, c = rt * 128 + rr, ct * 4 + cc
                    if r < rows and c < nb:
                        out[base + (rr % 32) * 16 + (rr // 32) * 4 + cc] = int(dense[r, c])
    return torch.frombuffer(out, dtype=torch.uint8)


@pytest.mark.parametrize("rows,nb", [(1, 1), (128, 4), (129, 5), (300, 7), (256, 8), (31, 9)])
def test_pack_matches_loop_and_unpack_inverts(rows, nb, gen):
    dense = torch.randint(0, 255, (rows, nb), generator=gen, dtype=torch.uint8)
    packed = L.pack_scales(dense)
    assert packed.numel() == L.packed_scale_bytes(rows, nb)
    assert torch.equal(packed, _loop_pack(dense))
    assert torch.equal(L.unpack_scales(packed, rows, nb), dense)


def test_offset_formula_is_a_bijection_onto_the_buffer():
    rows, nb = 256, 8
    r = torch.arange(rows)[:, None]
    c = torch.arange(nb)[None, :]
    off = L.packed_scale_offset(r, c, nb).reshape(-1)
    assert torch.equal(off.sort().values, torch.arange(rows * nb))


def test_scalar_and_tensor_offsets_agree():
    for r, c, nb in [(0, 0, 1), (127, 3, 4), (128, 4, 5), (200, 6, 7), (31, 0, 2)]:
        assert L.packed_scale_offset(r, c, nb) == int(
            L.packed_scale_offset(torch.tensor(r), torch.tensor(c), nb))


SIZES = [[0, 1, 31, 33, 127, 129, 0], [128, 128], [0], [257, 3]]


def _offs(sizes):
    return torch.tensor(sizes).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("sizes", SIZES)
def test_grouped_rows_is_concatenation_of_per_group_packs(sizes, gen):
    m, nb = sum(sizes), 6
    dense = torch.randint(0, 255, (m, nb), generator=gen, dtype=torch.uint8)
    offs = _offs(sizes)
    packed = L.pack_scales_grouped_rows(dense, offs)
    assert packed.numel() == L.grouped_rows_scale_bytes(m, nb, len(sizes))
    parts, start = [], 0
    for s in sizes:
        if s:
            parts.append(_loop_pack(dense[start : start + s]))
        start += s
    want = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)
    assert torch.equal(packed[: want.numel()], want) and not packed[want.numel():].any()
    assert torch.equal(L.unpack_scales_grouped_rows(packed, offs, m, nb), dense)


@pytest.mark.parametrize("sizes", SIZES)
def test_grouped_k_is_concatenation_of_per_group_packs(sizes, gen):
    rows = 130
    offs = _offs(sizes)
    nbs = [-(-s // 32) for s in sizes]
    dense = torch.randint(0, 255, (rows, sum(nbs)), generator=gen, dtype=torch.uint8)
    packed = L.pack_scales_grouped_k(dense, offs, sum(sizes))
    assert packed.numel() == L.grouped_k_scale_bytes(rows, sum(sizes), len(sizes))
    parts, col = [], 0
    for nb in nbs:
        if nb:
            parts.append(_loop_pack(dense[:, col : col + nb]))
        col += nb
    want = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)
    assert torch.equal(packed[: want.numel()], want) and not packed[want.numel():].any()
    assert torch.equal(L.unpack_scales_grouped_k(packed, offs, rows), dense)


def test_experts_packed_one_after_another(gen):
    dense = torch.randint(0, 255, (3, 100, 5), generator=gen, dtype=torch.uint8)
    packed = L.pack_scales_experts(dense)
    stride = L.expert_scale_stride(100, 5)
    assert stride == 128 * 8
    for e in range(3):
        assert torch.equal(packed[e * stride : (e + 1) * stride], _loop_pack(dense[e]))
    assert torch.equal(L.unpack_scales_experts(packed, 3, 100, 5), dense)


@pytest.mark.parametrize("m,g", [(0, 1), (1, 1), (1000, 1), (1000, 8), (5, 128)])
def test_static_bounds_hold_for_adversarial_splits(m, g):
    bound = L.grouped_row_tiles_bound(m, g)
    # worst case: every group 1 row over a tile boundary
    worst = [129] * min(g, m // 129) + [0] * g
    worst = worst[:g]
    worst[-1] += m - sum(worst)
    assert sum(-(-s // 128) for s in worst) <= bound
    if g == 1:
        assert bound == -(-m // 128)
