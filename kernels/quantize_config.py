"""Configuration of the MXFP8 quantizer kernels (`QuantConfig`, the compile key) and the tile
constants the kernels and their launcher share. No CuTeDSL.
"""

from __future__ import annotations

import dataclasses

import torch

from . import mx_format as F

TILE_TOKENS = F.TILE_ROWS  # tokens per CTA tile = rows of one packed scale tile
TILE_FEATURES = F.TILE_BLOCKS * F.BLOCK_SIZE  # features per CTA tile = one packed 4-block column
VEC_BYTES = 16  # one ld.global.v4 / st.global.v4
ELEM_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPE_NAMES = {dt: name for name, dt in TORCH_DTYPES.items()}
ACT_BLOCKS = tuple(sorted(set(F.ACT_BLOCK.values())))  # 32, 128
TILE_BLOCK_ROWS = tuple(sorted(set(F.WEIGHT_BLOCK_ROWS.values())))  # 1, 32, 128
SOURCES = ("x", "swiglu", "swiglu_grad", "gather", "combine_grad")  # QuantConfig.source


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """Static configuration of one compiled quantizer (the compile-cache key with the arch).

    dtype: input dtype name; rounding: "rceil" | "floor"; k: features (static; % 32 == 0
    whenever blocks run along it: rows or 32x32 blocks; any k >= 1 for the columnwise output);
    rows / cols: write the rowwise / columnwise output; grouping: "none" | "offs" (row groups
    from device ``offs``) | "uniform" (groups of ``group_rows`` tokens: experts);
    col_layout: "concat" (``x.T`` as ``(K, M)``) | "experts" (``(E, K, N)``);
    block_rows: weights' scale tiles, 1 (1x32 blocks), 32 (32x32) or 128 (128x128);
    col_aligned: every colwise output segment starts on 16 bytes (no offs, tokens per group
    % 16 == 0) -> 16-byte stores instead of shifted words; act_block: activations' block length
    along the reduced axis, 32 (MXFP8) or 128 (the 1x128 recipe; rows and columns alike);
    source: what the tile holds -- "x" (the input itself), "swiglu" (BF16 ``silu(gate) * up``
    of ``h = [gate | up] (M, 2k)``, k = H) or "swiglu_grad" (BF16 ``dh = [dgate | dup] (M, k)``
    of ``dA (M, k/2)`` and ``h (M, k)``, k = 2H): the data path's SwiGLU fused with its
    quantization; "gather" (row r = token ``src[r] // top_k`` of ``x (T, k)``: the dispatch) or
    "combine_grad" (that row times ``bf16(w[src[r]])``: the combine's backward; ``with_part``:
    also the routing weights' partial gradients). Rows whose ``src`` entry is negative, the
    layout's pad rows, are zeros; joint_halves ("swiglu_grad", H % 128 == 0): a CTA writes the
    dgate and the dup tile of one feature tile;
    load_batch: the computed sources' 16-byte vectors per input loaded together (1, 2, 4, 8);
    load_ahead: batches whose loads go out before the arithmetic of the current one (0: each
    batch is loaded, then computed; 1: the next batch's loads overlap this one's arithmetic);
    unpredicated ("swiglu", "swiglu_grad"): the ``h`` and ``dA`` rows load without waiting for
    their ``src`` entries, pad rows are read and zeroed after (their rows exist: ``M`` rows);
    speculate_rows (grouping "offs"): the tile loads rows ``[128 t, 128 t + 128)`` while it
    searches the group tables, which are its rows wherever every group starts on a multiple of
    128 rows (the 1x128 layer's layout); a tile elsewhere (CTA-uniform) loads again;
    ctas_per_sm: CTAs an SM the compiler must fit (a register cap; 0: its choice);
    col_tile (``act_block`` 128, columnwise output): one scale per 128 x 128 tile of the
    columnwise copy -- the tile's 128 features share each 128-token block's scale (the
    weight-gradient GEMM's activation operand, docs/numerics.md "The 1x128 recipe").
    """

    dtype: str
    rounding: str
    k: int
    rows: bool
    cols: bool
    grouping: str = "none"
    group_rows: int = 0
    col_layout: str = "concat"
    block_rows: int = 1
    col_aligned: bool = False
    act_block: int = F.BLOCK_SIZE
    source: str = "x"
    load_batch: int = 4
    ctas_per_sm: int = 0
    top_k: int = 1
    with_part: bool = False
    joint_halves: bool = False
    load_ahead: int = 0
    unpredicated: bool = False
    speculate_rows: bool = False
    col_tile: bool = False
