"""Expert weights all-gathered as MXFP8 under FSDP2: ``fully_shard_moe(mxfp8_all_gather=True)``.

FSDP2 shards ``w_gate_up (E, 2H, D)`` and ``w_down (E, D, H)`` on dim 0, the experts. With the
default BF16 all-gather every rank receives the BF16 weights and the layer quantizes them (along
K in forward, along N in backward). Here each rank quantizes its own experts along K *before*
the all-gather (FSDP2's all-gather extension, ``fsdp_pre_all_gather`` /
``fsdp_post_all_gather`` on the parameter's local tensor class) and the FP8 bytes plus their
E8M0 scales travel instead: 1 byte per element plus the packed scales (one byte per 32
elements, `kernels.mx_format.expert_scale_stride` per expert) instead of 2 bytes.

Same numerics, bit for bit:

* every scale tile lies inside one expert and the quantizer is per expert (`quantize_weights`),
  so quantizing each rank's whole experts then concatenating them gives the bytes of quantizing
  the gathered BF16 weights; hence the shard size must hold whole experts (E a multiple of the
  shard mesh size: no padded shards), checked at setup;
* backward's N-axis operand is derived from the gathered K-axis bytes, `weights_along_n`: with
  32x32 or 128x128 tiles both axes share bytes and scales. The exact ``1x32`` recipe has no
  such relation (a 1x32 block along K is not one along N), so the N-axis bytes would have to
  travel too -- 2 bytes per element plus scales, no saving over BF16 -- and the recipe is refused;
* the bytes are quantized from the shard cast as the BF16 path casts it (FSDP's ``param_dtype``,
  then the layer's BF16), with the layer's backend.

The gathered parameter is an `MXFP8GatheredWeight`: a tensor of the weight's shape and dtype
holding no BF16 values, only the FP8 bytes and scales. The routed-expert operators
(`moe_mxfp8.datapath`) take its bytes as their pre-quantized weights; every other use of it
raises NotImplementedError (nothing silently reads made-up values). Its gradient is the
ordinary BF16 gradient of the weight's shape, reduce-scattered as before. The sharded
parameter's local tensor is an `MXFP8ShardedWeight`, which behaves as the plain BF16/fp32 shard
it wraps (optimizer steps run on it); ``state_dict`` and `moe_mxfp8.dcp` see the plain shard.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from . import datapath as DP
from .backend import AUTO
from .kernels.mx_format import BLOCK_SIZE, WEIGHT_BLOCK_ROWS, expert_scale_stride
from .mx_tensor import FP8, MXFP8Tensor
from .quantize import TILED_WEIGHT_ROWS, quantize_weights, weights_along_n

BF16 = torch.bfloat16
WRAPPED_PARAMS = ("w_gate_up", "w_down")  # the routed experts' weights: gathered as MXFP8
# recipes whose weights are 32x32 or 128x128 tiles (their N-axis operand is derivable)
MXFP8_GATHER_RECIPES = tuple(r for r, rows in WEIGHT_BLOCK_ROWS.items()
                             if rows in TILED_WEIGHT_ROWS)

_aten = torch.ops.aten
# ops FSDP2 applies to the sharded local tensor (chunking, padding, views) whose results must
# keep the all-gather extension; any other op sees (and returns) the plain shard
_KEEP_SHARD_WRAPPER = {
    _aten.detach.default, _aten.alias.default, _aten.view.default, _aten.slice.Tensor,
    _aten.split.Tensor, _aten.split_with_sizes.default, _aten.new_zeros.default,
    _aten.as_strided.default, _aten._unsafe_view.default,
}


def check_layer(layer: Any, shard_size: int) -> None:
    """The one check of ``mxfp8_all_gather=True`` for a layer sharded over ``shard_size``
    ranks: a one-line ValueError for what cannot give the BF16 all-gather's numerics."""
    who = "fully_shard_moe(mxfp8_all_gather=True)"
    if layer.precision != "mxfp8":
        raise ValueError(f"{who}: needs precision='mxfp8', got {layer.precision!r}")
    if layer.scale_blocks not in MXFP8_GATHER_RECIPES:
        why = ("it resolves per device, to 1x32 on Blackwell and CPUs" if layer.scale_blocks
               == AUTO else "1x32 weights need both axes gathered: no saving")
        raise ValueError(
            f"{who}: needs an explicit scale_blocks with tiled weights {MXFP8_GATHER_RECIPES}, "
            f"got {layer.scale_blocks!r} ({why})")
    if layer.cache_weights:
        raise ValueError(f"{who}: the gathered weights arrive quantized; use cache_weights=False")
    experts = layer.w_gate_up.shape[0]
    if experts % shard_size:
        raise ValueError(f"{who}: the layer's {experts} experts do not split evenly over "
                         f"{shard_size} ranks (a shard must hold whole experts)")


def wrap_expert_weights(layer: Any) -> None:
    """Before ``fully_shard``: the layer's expert weights as `MXFP8ShardedWeight` parameters,
    and a ``state_dict`` hook that hands out the plain shards."""
    recipe = layer.scale_blocks
    for name in WRAPPED_PARAMS:
        p = getattr(layer, name)
        wrapped = MXFP8ShardedWeight(p.data, WEIGHT_BLOCK_ROWS[recipe], layer.backend)
        setattr(layer, name, nn.Parameter(wrapped, requires_grad=p.requires_grad))
    layer.register_state_dict_post_hook(_plain_state_dict)


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` with an `MXFP8ShardedWeight` (itself, or a DTensor's local tensor) replaced by the
    plain shard it wraps (the same storage); any other tensor as it is."""
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    if isinstance(t, MXFP8ShardedWeight):
        return t.shard
    if isinstance(t, DTensor) and isinstance(t._local_tensor, MXFP8ShardedWeight):
        return DTensor.from_local(t._local_tensor.shard, t.device_mesh, t.placements,
                                  run_check=False, shape=t.shape, stride=t.stride())
    return t


def _plain_state_dict(module, state_dict, prefix, local_metadata) -> None:
    for name in WRAPPED_PARAMS:
        key = prefix + name
        if key in state_dict:
            state_dict[key] = plain(state_dict[key])


class MXFP8ShardedWeight(torch.Tensor):
    """A rank's shard of expert weights ``(E_local, N, K)`` (BF16 or fp32) that FSDP2 all-gathers
    as MXFP8 along K with ``block_rows`` weight tiles. Every op sees the plain shard ``shard``;
    FSDP2's chunking and views keep the wrapper (`_KEEP_SHARD_WRAPPER`)."""

    shard: torch.Tensor  # the plain shard (not ``inner``: a Tensor method's name)
    block_rows: int
    backend: str

    @staticmethod
    def __new__(cls, shard: torch.Tensor, block_rows: int, backend: str):
        t = torch.Tensor._make_wrapper_subclass(
            cls, shard.shape, strides=shard.stride(), storage_offset=shard.storage_offset(),
            dtype=shard.dtype, device=shard.device, requires_grad=False)
        t.shard, t.block_rows, t.backend = shard, block_rows, backend
        return t

    def __repr__(self, *, tensor_contents=None) -> str:  # type: ignore[override]
        return f"MXFP8ShardedWeight({self.shard!r}, block_rows={self.block_rows})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        wrappers = [a for a in args if isinstance(a, cls)]
        meta = (wrappers[0].block_rows, wrappers[0].backend) if wrappers else None
        inners = {}

        def unwrap(t):
            inners[id(t.shard)] = t
            return t.shard

        out = func(*tree_map_only(cls, unwrap, args), **tree_map_only(cls, unwrap, kwargs or {}))
        if func in _KEEP_SHARD_WRAPPER and meta is not None:
            return tree_map_only(torch.Tensor, lambda t: cls(t, *meta), out)
        # an in-place op returns its (wrapped) input
        return tree_map_only(torch.Tensor, lambda t: inners.get(id(t), t), out)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """The all-gather inputs: this rank's experts quantized along K, cast first as the BF16
        path casts them (FSDP's ``param_dtype``, then the layer's BF16)."""
        w = self.shard.to(mp_policy.param_dtype or self.dtype).to(BF16).contiguous()
        q = quantize_weights(w, axis="K", block_rows=self.block_rows, backend=self.backend)
        experts = w.shape[0]
        return (q.data.view(torch.uint8), q.scale.view(experts, -1)), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        """The unsharded parameter: an `MXFP8GatheredWeight` on the all-gather's own output
        tensors (FSDP2 frees and refills them; ``out``: the one made at the first gather)."""
        data, scale = outputs
        if out is not None:
            if out.data_u8.untyped_storage().data_ptr() != data.untyped_storage().data_ptr():
                raise RuntimeError("MXFP8ShardedWeight: FSDP2 gathered into another buffer")
            return None
        return MXFP8GatheredWeight(data, scale.view(-1), self.block_rows, param_dtype), (data,
                                                                                         scale)


class MXFP8GatheredWeight(torch.Tensor):
    """All-gathered expert weights ``(E, N, K)`` as MXFP8 along K: ``data_u8`` (FP8 bytes) and
    ``scale`` (packed, expert-major), weight tiles of ``block_rows``. It has the weight's shape
    and dtype but no values: only the routed-expert operators read it (as their pre-quantized
    weights, along K in forward and `weights_along_n` in backward); anything else raises
    NotImplementedError."""

    data_u8: torch.Tensor
    scale: torch.Tensor
    block_rows: int

    @staticmethod
    def __new__(cls, data_u8: torch.Tensor, scale: torch.Tensor, block_rows: int,
                dtype: torch.dtype):
        t = torch.Tensor._make_wrapper_subclass(cls, data_u8.shape, dtype=dtype,
                                                device=data_u8.device, requires_grad=False)
        t.data_u8, t.scale, t.block_rows = data_u8, scale, block_rows
        return t

    def __repr__(self, *, tensor_contents=None) -> str:  # type: ignore[override]
        return (f"MXFP8GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"block_rows={self.block_rows})")

    def along_k(self) -> MXFP8Tensor:
        return MXFP8Tensor(self.data_u8.view(FP8), self.scale, "packed", None, "experts",
                           self.block_rows)

    def _same(self, dtype: torch.dtype | None = None) -> MXFP8GatheredWeight:
        return MXFP8GatheredWeight(self.data_u8, self.scale, self.block_rows, dtype or self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        w = args[0] if args and isinstance(args[0], cls) else None
        if func in (_aten.detach.default, _aten.alias.default) and w is not None:
            return w._same()
        if func is _aten.as_strided.default and w is not None and tuple(args[1]) == w.shape:
            return w._same()  # FSDP2's view of the gathered parameter at its own shape
        if (func is _aten._to_copy.default and w is not None and set(kwargs) == {"dtype"}
                and kwargs["dtype"] == BF16):
            # the layer's cast of fp32 weights to BF16: the bytes were quantized from this cast
            # (`fsdp_pre_all_gather`), and autograd casts the BF16 gradient back
            return w._same(BF16)
        if func in DP.PREQUANTIZED_OPS:
            return func(**_with_prequantized(func, args, kwargs))
        # not a TypeError: Python would turn that into "unsupported operand" for ``w + 1``
        raise NotImplementedError(f"MXFP8GatheredWeight: MXFP8-all-gathered expert weights are "
                                  f"read only by the layer's expert GEMMs, not by {func}")


def _with_prequantized(func, args, kwargs) -> dict:
    """The routed-expert operator's arguments with each `MXFP8GatheredWeight` replaced by a
    storage-free stand-in of its shape and its bytes passed as the pre-quantized operand that
    pass reads (`datapath.PREQUANTIZED_OPS`: along K in forward, along N in backward's phases)."""
    bound = {a.name: v for a, v in zip(func._schema.arguments, args, strict=False)}
    bound.update(kwargs)
    axis, weight_args = DP.PREQUANTIZED_OPS[func]
    rows = WEIGHT_BLOCK_ROWS[bound["scale_blocks"]]
    for name, (data_arg, scale_arg) in weight_args.items():
        w = bound[name]
        if not isinstance(w, MXFP8GatheredWeight):
            continue
        if w.block_rows != rows:
            raise ValueError(f"MXFP8GatheredWeight: {name} was gathered with {w.block_rows}-row "
                             f"tiles but the operator runs scale_blocks={bound['scale_blocks']!r}")
        q = w.along_k() if axis == "K" else weights_along_n(w.along_k(), bound["backend"])
        bound[name] = torch.empty((), dtype=BF16, device=w.device).expand(w.shape)
        bound[data_arg], bound[scale_arg] = q.data.view(torch.uint8), q.scale
    return bound


def expert_gather_bytes(layer: Any, shard_size: int, mxfp8: bool) -> int:
    """Bytes one rank sends for ``layer``'s expert weights in one all-gather over ``shard_size``
    ranks: its experts' BF16 elements, or (``mxfp8``) their FP8 bytes plus each expert's packed
    scales. (The layer's weights before or after ``fully_shard``: their shape is the layer's
    experts either way.)"""
    total = 0
    for name in WRAPPED_PARAMS:
        e, n, k = getattr(layer, name).shape
        per_expert = (n * k + expert_scale_stride(n, k // BLOCK_SIZE)) if mxfp8 else 2 * n * k
        total += e // shard_size * per_expert
    return total


class AllGatherBytes:
    """An FSDP2 all-gather that counts the bytes this rank contributes (``sent``) and the calls
    (``calls``): ``unit.set_custom_all_gather(AllGatherBytes())`` on a ``fully_shard``-ed
    module, to measure what ``mxfp8_all_gather`` saves. Runs ``all_gather_into_tensor``."""

    def __init__(self) -> None:
        self.sent = 0
        self.calls = 0

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group,
                 async_op: bool = False):
        import torch.distributed as dist  # noqa: PLC0415

        self.sent += input_tensor.numel() * input_tensor.element_size()
        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group,
                                          async_op=async_op)
