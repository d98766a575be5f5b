"""The grouped GEMMs' shared tile schedule and scale-tile addressing (CPU).

* `problem.scale_tile_index` (the one scale-address function of both arch kernels) gives the
  packed scale tiles `moe_mxfp8.layout` defines, byte for byte, in both groupings;
* `schedule.GroupedTileSchedule` -- the device tile walk over ``offs`` both arch kernels run --
  executed on the host by CuTeDSL host functions (`schedule_walk.walk`), visits every output
  tile exactly once with the right operand origins, k-tile counts and scale tiles, for 128- and
  256-row tiles, empty and partial groups, and grids that wrap.
"""

from __future__ import annotations

import pytest
import torch

from moe_mxfp8 import layout as L

pytest.importorskip("cutlass")

from moe_mxfp8.kernels.grouped_gemm import problem as P  # noqa: E402
from schedule_walk import walk  # noqa: E402  (tests/kernels is on sys.path under pytest)


@pytest.mark.parametrize("mma_m", [128, 256])
def _m_offsets(sizes, n, k):
    """Expected tile indices of M-mode scales from the layout module (the contract)."""
    nb = L.ceil_div(k, L.BLOCK_SIZE)
    return nb, L.expert_scale_stride(n, nb)


@pytest.mark.parametrize("mma_m", [128, 256])
def test_scale_tile_index_mode_m(mma_m):
    sizes, n, k = [300, 0, 37, 531], 2880, 2880 + 64
    nb, stride = _m_offsets(sizes, n, k)
    p_start, tb = 0, 0
    for g, m_g in enumerate(sizes):
        for mt in range(L.ceil_div(m_g, mma_m)):
            for nt in range(L.ceil_div(n, 128)):
                for v in range(mma_m // 128):
                    sfa, sfb, step = P.scale_tile_index("m", n, k, mma_m, 128, mt, nt, v, g,
                                                        m_g, tb)
                    for kt in (0, 1, L.ceil_div(k, 128) - 1):
                        row = p_start + mt * mma_m + v * 128
                        want_a = L.packed_scale_offset(row, 4 * kt, nb)
                        assert (sfa + kt) * 512 == want_a
                        want_b = g * stride + L.packed_scale_offset(nt * 128, 4 * kt, nb)
                        assert (sfb + kt) * 512 == want_b
                        assert step == L.ceil_div(nb, 4)
        p_start += L.round_up(m_g, 128)
        tb += L.ceil_div(m_g, 128)


def test_scale_tile_index_mode_k():
    sizes, n, k = [100, 0, 33, 171, 300], 288, 160
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    tb = 0
    for rows, which in ((n, "a"), (k, "b")):
        tb = 0
        nbt = L.grouped_k_num_blocks(offs)
        byte_off, _ = L.grouped_k_offsets(offs, rows, nbt)
        _, block_id, local = L.grouped_k_block_index(offs, int(offs[-1]))
        starts = L.group_starts(offs)
        for g, m_g in enumerate(sizes):
            if m_g == 0:
                continue
            for rt in range(L.ceil_div(rows, 128)):
                if which == "a":
                    sfa, _, _ = P.scale_tile_index("k", n, k, 128, 128, rt, 0, 0, g, m_g, tb)
                    first = sfa
                else:
                    _, sfb, _ = P.scale_tile_index("k", n, k, 128, 128, 0, rt, 0, g, m_g, tb)
                    first = sfb
                for kt in range(L.ceil_div(m_g, 128)):
                    tok = int(starts[g]) + kt * 128  # first token of the k-tile
                    j = int(block_id[tok])
                    assert int(local[tok]) == 4 * kt
                    assert (first + kt) * 512 == int(byte_off[rt * 128, j]) // 512 * 512
            tb += L.ceil_div(m_g, 128)


def _tile_order(m_tiles, n_tiles, band_m, gran=1):
    """(mt, nt) in walk order inside a group: bands of ``band_m`` rows of tiles (1: row by
    row), each walked granule by granule (``gran`` adjacent nt) with the band's rows
    fastest."""
    for m0 in range(0, m_tiles, band_m):
        for g0 in range(0, n_tiles, gran):
            for mt in range(m0, min(m0 + band_m, m_tiles)):
                for nt in range(g0, g0 + gran):
                    yield mt, nt


def _expected_walk(mode, sizes, n, k, mma_m, clusters, tile_n=128, band_m=1, gran=1):
    """The same schedule from the contract: tiles numbered group by group (m-tile, then
    n-tile, or in bands: `_tile_order`), unit u on cluster u % clusters; scale tiles from
    `moe_mxfp8.layout`."""
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    starts = [0, *offs.tolist()[:-1]]
    rows = []
    unit = 0
    if mode == "m":
        nb = L.ceil_div(k, 32)
        p_start = 0
        for g, m_g in enumerate(sizes):
            for mt, nt in _tile_order(L.ceil_div(m_g, mma_m), L.ceil_div(n, tile_n), band_m,
                                      gran):
                for v in range(mma_m // 128):
                    a_row = starts[g] + mt * mma_m
                    rows.append(dict(
                        cluster=unit % clusters, g=g, mt=mt, nt=nt, v=v, a_row=a_row,
                        b_row=nt * tile_n, b_l=g, k0=0, k_tiles=L.ceil_div(k, 128),
                        sfa=L.packed_scale_offset(p_start + mt * mma_m + v * 128, 0, nb)
                        // 512,
                        sfb=(g * L.expert_scale_stride(n, nb)
                             + L.packed_scale_offset(nt * tile_n, 0, nb)) // 512,
                        sfb_step=L.ceil_div(nb, 4)))
                unit += 1
            p_start += L.round_up(m_g, 128)
        return rows
    nbt = L.grouped_k_num_blocks(offs)
    off_a, _ = L.grouped_k_offsets(offs, n, nbt)
    off_b, _ = L.grouped_k_offsets(offs, k, nbt)
    _, block_id, _ = L.grouped_k_block_index(offs, int(offs[-1]))
    for g, m_g in enumerate(sizes):
        for mt, nt in _tile_order(L.ceil_div(n, 128), L.ceil_div(k, tile_n), band_m, gran):
            row = dict(cluster=unit % clusters, g=g, mt=mt, nt=nt, v=0, a_row=mt * 128,
                       b_row=nt * tile_n, b_l=0, k0=starts[g], k_tiles=L.ceil_div(m_g, 128),
                       sfb_step=L.ceil_div(m_g, 128))
            if m_g:  # an empty group loads no scales
                j = int(block_id[starts[g]])
                row["sfa"] = int(off_a[mt * 128, j]) // 512
                row["sfb"] = int(off_b[nt * tile_n, j]) // 512
            rows.append(row)
            unit += 1
    return rows


@pytest.mark.parametrize(
    "mode,sizes,n,k,mma_m,clusters,tile_n,band_m,gran",
    [
        ("m", (130, 0, 37, 133, 0), 160, 288, 128, 3, 128, 1, 1),
        ("m", (300, 0, 531, 1), 96, 2880, 256, 4, 128, 1, 1),
        ("m", (0, 0, 5), 128, 128, 128, 7, 128, 1, 1),
        ("k", (100, 0, 33, 171, 0), 160, 96, 128, 5, 128, 1, 1),
        ("k", (16, 129, 0, 207), 288, 160, 128, 2, 128, 1, 1),
        # 256-column tiles and raster bands (the sm90 1x128 defaults): bands of 3 over 1 / 5
        # / 11 m-tiles (a short last band), N not a multiple of the tile; K-grouped bands of
        # 2 over 3 rows of tiles in granules of 2 (a 2-CTA cluster's tiles stay adjacent)
        ("m", (130, 0, 600, 1300, 5), 640, 288, 128, 3, 256, 3, 1),
        ("m", (1030, 0, 37), 384, 256, 128, 5, 256, 8, 1),
        ("m", (700, 0, 300), 1024, 256, 128, 4, 256, 3, 2),
        ("k", (100, 0, 33, 171, 0), 320, 1024, 128, 5, 256, 2, 2),
    ],
)
def test_device_schedule_covers_every_tile_once(mode, sizes, n, k, mma_m, clusters, tile_n,
                                                band_m, gran):
    """Each output tile is visited by exactly one cluster, in the schedule's order (the
    cluster that takes it), with the right operand origins, k-tile count and packed-scale
    tiles (the schedule's device code, run on the host)."""
    got = walk(mode, sizes, n, k, mma_m, clusters, tile_n, band_m, gran)
    want = _expected_walk(mode, sizes, n, k, mma_m, clusters, tile_n, band_m, gran)

    def key(r):
        return (r["g"], r["mt"], r["nt"], r["v"])

    got, want = sorted(got, key=key), sorted(want, key=key)
    assert [key(r) for r in got] == [key(r) for r in want]
    for g_row, w_row in zip(got, want, strict=True):
        for col, val in w_row.items():
            assert g_row[col] == val, (col, g_row, w_row)
