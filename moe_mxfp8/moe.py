"""`MXFP8MoE`: a drop-in Mixture-of-Experts feed-forward layer whose expert GEMMs run in MXFP8.

``precision="bf16"`` is its BF16 twin: the same parameters, names and ``state_dict``, with the
expert GEMMs on ``torch._grouped_mm`` (the baseline). A checkpoint of one loads into the other.

Shapes (``T`` tokens = product of the leading dims of ``x``, ``E`` experts, ``k = top_k``,
``D = dim``, ``H = hidden_dim``)::

    x (..., D) -> flatten (T, D)
    router      logits = x @ router.weight^T                (T, E)  fp32
                scores = softmax | sigmoid(logits)           (T, E)
                top-k  -> weights (T, k), expert ids (T, k)  (optionally renormalised to sum 1)
    dispatch    the layer's dispatcher (`moe_mxfp8.dispatcher`: in this process, or to the
                experts' ranks with ``ep_group``) takes the pairs to their experts and back:
    permute     the T*k (token, slot) pairs sorted by expert id (stable argsort);
                offs = cumsum(tokens per expert) int32 (E,), on device, no host sync
    experts     h = grouped_mm(x_sorted, w_gate_up^T)       (T*k, 2H)  gate | up
                a = silu(gate) * up                          (T*k, H)
                y = grouped_mm(a, w_down^T)                  (T*k, D)
    combine     un-permute (scatter back to (T, k, D)), weighted sum over k  -> (T, D)
    shared      (num_shared_experts = S > 0) a dense SwiGLU FFN of hidden size S*H on every
                token, in BF16 for both precisions, added:  out += shared(x)  -> (..., D)

The auxiliary load-balancing loss (Switch / GShard) of the last forward is ``module.aux_loss``::

    aux_loss = aux_loss_coef * E * sum_e f_e * P_e

with ``f_e`` the fraction of the ``T*k`` routed (token, slot) pairs that go to expert ``e`` (not
differentiable) and ``P_e`` the mean over tokens of the router probability of ``e`` (softmax
scores; for sigmoid scores, the scores normalised to sum 1 per token). Perfect balance gives
``aux_loss_coef`` (the sum is 1). It is a tensor in the autograd graph: add it to the loss.

Non-finite tokens (NaN or Inf in a token of ``x``, i.e. a row of non-finite router logits) never
stop the process: such a token goes to experts ``0 .. k-1`` (a fixed choice, the same on every
backend) with NaN routing weights, so its own output and input gradient are NaN while every other
token's output and input gradient are those of the batch without it. Weight gradients are sums
over tokens and become NaN (as in any BF16 layer), and so may ``aux_loss``. ``nonfinite_tokens``
counts such tokens on the device (no host sync), for a training loop that skips bad steps;
``check_finite="raise"`` reads it and raises `NonFiniteInputError` instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from . import dispatcher as DS
from . import router as RTR
from . import stages as ST
from . import weight_cache as WC
from .backend import AUTO, AutoScaleBlocks, check_backend_name
from .checks import COMPUTE_DTYPE
from .config import LAYER, MXFP8MoEConfig, check_finite_mode, check_scale_blocks
from .kernels.mx_format import K_GROUP_ALIGN
from .router import router_logits

PARAM_DTYPES = (torch.bfloat16, torch.float32, torch.float16)
INPUT_DTYPES = (torch.bfloat16, torch.float32, torch.float16)
# MXFP8 path: every expert group starts on a multiple of 16 rows (zero rows pad each group).
# The Hopper wgrad kernel TMA-loads tokens and needs 16-byte aligned token coordinates; an
# unaligned group takes its slow copy path, measured at 17 vs 394 TFLOP/s (dsv3 wgrad, H100,
# benchmarks/RESULTS.md). Zero rows change no result: a group's last 32-block is zero-padded by
# the contract anyway, round_up(m, 16) <= round_up(m, 32) keeps every group's block count, and
# all-zero blocks (scale byte 0, data 0) add exact zeros.
GROUP_ALIGN_ROWS = K_GROUP_ALIGN  # one constant: the wgrad kernel's token alignment
# scale_blocks="1x128": groups padded to 128 rows, so each 128-token k-tile of the wgrad GEMM is
# one whole 1x128 block of one group (no partial last block, no tail fix-up in the kernel);
# exact for the same reason (a zero row never raises a block's amax)
GROUP_ALIGN_ROWS_1X128 = 128


def group_align_rows(scale_blocks: str) -> int:
    """Rows each expert group starts on in the MXFP8 layout of recipe ``scale_blocks``."""
    return GROUP_ALIGN_ROWS_1X128 if scale_blocks == "1x128" else GROUP_ALIGN_ROWS


# MXFP8MoE's keyword arguments that make its config (the config's fields and the deprecated
# weight_blocks), with their defaults: given together with config=, a non-default one is an error
_OPTIONS = {
    **{f.name: f.default for f in dataclasses.fields(MXFP8MoEConfig)},
    "dim": None, "hidden_dim": None, "num_experts": None, "top_k": None,
    "save_colwise": None, "weight_blocks": None,
}


def _layer_config(config, options: dict) -> MXFP8MoEConfig:
    """The layer's config: ``config``, or one made of its keyword ``options`` (not both)."""
    if config is None:
        return MXFP8MoEConfig.from_options(**options)
    if not isinstance(config, MXFP8MoEConfig):
        raise TypeError(f"MXFP8MoE: config must be an MXFP8MoEConfig, got {type(config).__name__}")
    given = sorted(k for k, v in options.items() if v != _OPTIONS[k])
    if given:
        raise ValueError(f"MXFP8MoE: pass config or the layer's options, not both (got config "
                         f"and {', '.join(given)})")
    return config


def _from_config(name: str) -> Any:
    """A read-only layer attribute: its config's ``name``."""
    return property(lambda self: getattr(self._config, name), doc=f"``config.{name}``")


class MXFP8MoE(nn.Module):
    """Top-k routed SwiGLU Mixture-of-Experts feed-forward layer, ``x (..., dim) -> (..., dim)``.

    Args:
        dim: model width ``D`` (input and output features). Multiple of 32 for ``"mxfp8"``.
        hidden_dim: expert hidden width ``H``. Multiple of 32 for ``"mxfp8"``.
        num_experts: ``E``.
        top_k: experts per token, ``1 <= top_k <= num_experts``.
        precision: ``"mxfp8"`` (expert GEMMs in MXFP8, `moe_mxfp8.grouped_mm`) or ``"bf16"``
            (``torch._grouped_mm``, the BF16 twin).
        backend: MXFP8 backend (``"auto"``, ``"reference"``, ``"sm90"``, ``"sm100"``); ignored
            for ``"bf16"``.
        score_func: ``"softmax"`` or ``"sigmoid"`` router scores.
        renormalize: divide the top-k scores of each token by their sum (routing weights then
            sum to 1). Note: with softmax and ``top_k=1`` this makes every weight 1, so the
            router learns only through ``aux_loss``.
        aux_loss_coef: scale of the load-balancing loss stored in ``self.aux_loss``.
        wgrad: ``"mxfp8"`` or ``"bf16"`` weight gradients of the expert GEMMs (mxfp8 only).
        save_colwise: deprecated on the layer (a `DeprecationWarning`; still honoured, default
            True): the fused data path (`moe_mxfp8.datapath`) always writes the FP8 columnwise
            copy in its dispatch and SwiGLU passes, so it changes no byte and no result.
        weight_blocks: deprecated older name of ``scale_blocks="32x32"`` (a
            `DeprecationWarning`; still honoured, default ``"1x32"``).
        scale_blocks: the scale-block recipe of the expert GEMMs (mxfp8 only; one vocabulary
            with `moe_mxfp8.grouped_mm` and the quantizers): ``"auto"`` (default: the recipe of
            the GPU the layer runs on, `moe_mxfp8.backend.auto_scale_blocks` -- on Hopper
            `HOPPER_AUTO_SCALE_BLOCKS` (the parity protocol's choice, ``"1x128"``), the
            exact ``"1x32"`` on Blackwell and on CPUs; resolved at the first forward
            on a device and again, with a warning, if the layer moves to another kind of GPU),
            ``"1x32"`` (exact MXFP8), ``"32x32"`` (= ``weight_blocks="32x32"``) or ``"1x128"``
            (activations/gradients one scale per 128 elements, weights per 128x128 tile; groups
            padded to 128 rows; still MXFP8 tensors, faster on Hopper: docs/numerics.md "The
            1x128 recipe"). An explicit recipe is used on every device.
        num_shared_experts: ``S >= 0`` shared experts (DeepSeek-V3 / Qwen-MoE / torchtitan): one
            dense SwiGLU FFN of hidden size ``S * hidden_dim`` -- torchtitan's
            ``FeedForward(dim, hidden_dim * num_shared_experts)`` -- applied to every token, its
            output added to the routed output. It runs in BF16 (``F.linear``) for both
            precisions: like torchao, which converts only the routed experts to MXFP8.
        ep_group: a ``torch.distributed`` process group for expert parallelism (None: off).
            Each rank then holds ``E / ep_size`` experts (``w_gate_up``/``w_down`` sharded on
            dim 0) and its tokens travel to their experts' ranks by all-to-all; see
            `moe_mxfp8.expert_parallel` (checkpoint helpers there too).
        ep_payload: ``"mxfp8"`` (tokens quantized once and sent as E4M3 + E8M0 bytes; the
            default for precision "mxfp8") or ``"bf16"`` (the default for "bf16").
        ep_grad_payload: ``"bf16"`` (default) or ``"mxfp8"``: the output gradient's dispatch to
            the experts in backward. Expert outputs and input gradients return in BF16.
        check_finite: what a token with non-finite router logits (NaN/Inf in ``x`` or in
            ``router.weight``) does. ``"flag"`` (default): nothing stops; the token is routed
            to experts ``0 .. k-1`` with NaN weights (its own output and gradients are NaN, the
            other tokens' are unaffected) and ``nonfinite_tokens`` counts it, without a host
            sync. ``"raise"``: also reads that count on the host (a sync per forward; not
            CUDA-graph capturable) and raises `moe_mxfp8.NonFiniteInputError` (a ValueError)
            on every backend, in eager mode and under ``torch.compile``; with ``ep_group`` the
            count is summed over the group first, so every rank raises together. ``True`` /
            ``False`` are the older spellings of ``"raise"`` / ``"flag"``.
        cache_weights: quantize the routed expert weights once per optimizer step instead of
            in every forward and backward (mxfp8 only; `moe_mxfp8.weight_cache`): gradient
            accumulation and recomputed forwards reuse the FP8 weights of both axes while the
            parameters are unchanged, at one FP8 byte per expert parameter and axis held until
            the next optimizer step (`weight_cache_bytes`). Off by default: that memory exceeds
            what MXFP8 saves against the BF16 twin at mixtral-like shapes, and a write through
            ``param.data`` outside an optimizer step is invisible to it (then call
            `invalidate_weight_cache`).
        config: all of the options above (but ``ep_group``) as one `MXFP8MoEConfig`, instead
            of the keyword arguments (not with them): ``MXFP8MoE(config=cfg)``. ``layer.config``
            is the layer's (frozen) config, and each option above is a read-only attribute
            (``check_finite`` is assignable).
        device, dtype: of the parameters. ``dtype`` may be bfloat16 (default), float32 (e.g.
            master weights; cast to BF16 for the expert GEMMs in forward) or float16.

    Parameters (identical for both precisions; ``state_dict`` keys in brackets):
        ``router.weight`` ``(E, D)`` [``router.weight``]: an ``nn.Linear`` without bias, stored in
            ``dtype``; the router logits are float32 with fp32 accumulation (for BF16 ``x`` and
            weight on CUDA one BF16 GEMM, whose products are exact: `router_logits`).
        ``w_gate_up`` ``(E, 2H, D)``: gate rows ``[0, H)`` and up rows ``[H, 2H)`` of each expert,
            stored ``(E, N, K)`` so the forward uses ``w_gate_up.transpose(-2, -1)``.
        ``w_down`` ``(E, D, H)``.
        With ``S > 0`` shared experts (``Hs = S * H``): ``shared_w_gate_up`` ``(2 Hs, D)`` (gate
        rows ``[0, Hs)``, up rows ``[Hs, 2 Hs)``) and ``shared_w_down`` ``(D, Hs)``.

    Attributes set by each forward:
        ``aux_loss``: scalar float32 tensor (in the graph), ``None`` before the first forward.
            A copy of the layer (``copy.deepcopy``, pickle) holds it detached.
        ``tokens_per_expert``: ``(E,)`` int64, detached (routed (token, slot) pairs per expert).
        ``nonfinite_tokens``: int64 scalar on the device: tokens of this forward whose router
            logits are not finite (0 for a clean batch; read it with ``.item()`` when needed).

    Input ``x (..., D)`` in bfloat16, float16 or float32; the output has x's shape and dtype.
    Experts compute in BF16 (MXFP8 inside the routed experts' GEMMs), the router's logits in
    float32 (the same router in both precisions).
    """

    dispatcher: DS.Dispatcher  # installed by `moe_mxfp8.dispatcher.setup_layer` in __init__

    def __init__(
        self,
        dim: int | None = None,
        hidden_dim: int | None = None,
        num_experts: int | None = None,
        top_k: int | None = None,
        *,
        precision: str = "mxfp8",
        backend: str = "auto",
        score_func: str = "softmax",
        renormalize: bool = True,
        aux_loss_coef: float = 0.01,
        wgrad: str = "mxfp8",
        save_colwise: bool | None = None,
        weight_blocks: str | None = None,
        scale_blocks: str = AUTO,
        num_shared_experts: int = 0,
        ep_group=None,
        ep_payload: str | None = None,
        ep_grad_payload: str = "bf16",
        check_finite: str = "flag",
        cache_weights: bool = False,
        config: MXFP8MoEConfig | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        options = {k: v for k, v in locals().items() if k in _OPTIONS}
        self._config = cfg = _layer_config(config, options)
        check_backend_name(cfg.backend, LAYER, env=cfg.precision == "mxfp8")  # the machine
        if dtype not in PARAM_DTYPES:
            raise TypeError(f"MXFP8MoE: dtype must be one of {PARAM_DTYPES}, got {dtype}")
        self._weight_cache: WC.WeightCache | None = None  # made on first use
        self._auto_recipe = AutoScaleBlocks(LAYER)
        e_local = DS.setup_layer(self, ep_group)  # E / ep_size

        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        d, h = cfg.dim, cfg.hidden_dim
        self.router = nn.Linear(d, cfg.num_experts, bias=False, **factory)
        self.w_gate_up = nn.Parameter(torch.empty(e_local, 2 * h, d, **factory))
        self.w_down = nn.Parameter(torch.empty(e_local, d, h, **factory))
        if cfg.num_shared_experts:
            hs = cfg.shared_hidden_dim
            self.shared_w_gate_up = nn.Parameter(torch.empty(2 * hs, d, **factory))
            self.shared_w_down = nn.Parameter(torch.empty(d, hs, **factory))
        else:
            self.register_parameter("shared_w_gate_up", None)
            self.register_parameter("shared_w_down", None)
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None
        self.nonfinite_tokens: torch.Tensor | None = None
        self.reset_parameters()

    # -----------------------------------------------------------------------------------------
    # the configuration: one frozen MXFP8MoEConfig, its fields read-only attributes
    # -----------------------------------------------------------------------------------------

    @property
    def config(self) -> MXFP8MoEConfig:
        """The layer's options (frozen; `MXFP8MoEConfig`)."""
        return self._config

    dim: int = _from_config("dim")
    hidden_dim: int = _from_config("hidden_dim")
    num_experts: int = _from_config("num_experts")
    top_k: int = _from_config("top_k")
    precision: str = _from_config("precision")
    backend: str = _from_config("backend")
    score_func: str = _from_config("score_func")
    renormalize: bool = _from_config("renormalize")
    aux_loss_coef: float = _from_config("aux_loss_coef")
    wgrad: str = _from_config("wgrad")
    scale_blocks: str = _from_config("scale_blocks")  # as asked: "auto" or a recipe
    weight_blocks: str = _from_config("weight_blocks")  # the older name's view of scale_blocks
    num_shared_experts: int = _from_config("num_shared_experts")
    shared_hidden_dim: int = _from_config("shared_hidden_dim")  # torchtitan's FeedForward
    cache_weights: bool = _from_config("cache_weights")
    save_colwise: bool = _from_config("save_colwise")

    @property
    def check_finite(self) -> str:
        """``"flag"`` or ``"raise"`` (see the class doc); assignable, validated."""
        return self._config.check_finite

    @check_finite.setter
    def check_finite(self, value) -> None:
        self._config = dataclasses.replace(self._config, check_finite=check_finite_mode(value))

    @property
    def ep_group(self):
        """The expert-parallel process group, None without one: its dispatcher's
        (`moe_mxfp8.dispatcher`; copies of the layer share it)."""
        return self.dispatcher.group

    @property
    def ep_payload(self) -> str:
        """How the tokens travel to their experts under EP (``"mxfp8"`` or ``"bf16"``);
        assignable, validated, and handed to an all-to-all dispatcher."""
        return self._config.resolved_ep_payload

    @ep_payload.setter
    def ep_payload(self, value: str) -> None:
        self._replace_payloads(ep_payload=value)

    @property
    def ep_grad_payload(self) -> str:
        """How the output gradient travels back to the experts under EP; assignable."""
        return self._config.ep_grad_payload

    @ep_grad_payload.setter
    def ep_grad_payload(self, value: str) -> None:
        self._replace_payloads(ep_grad_payload=value)

    def _replace_payloads(self, **change: Any) -> None:
        """A config with the payload(s) in ``change`` (validated there), handed to an
        all-to-all dispatcher."""
        self._config = dataclasses.replace(self._config, **change)
        if isinstance(self.dispatcher, DS.AllToAllDispatcher):
            self.dispatcher.payload = self.ep_payload
            self.dispatcher.grad_payload = self.ep_grad_payload

    def reset_parameters(self) -> None:
        """Normal init with std ``fan_in^-0.5``: ``D^-0.5`` for the router, ``w_gate_up`` and
        ``shared_w_gate_up``, ``H^-0.5`` for ``w_down`` and ``(S H)^-0.5`` for ``shared_w_down``
        (unit-variance inputs give unit-variance logits/activations)."""
        with torch.no_grad():
            nn.init.normal_(self.router.weight, std=self.dim**-0.5)
            nn.init.normal_(self.w_gate_up, std=self.dim**-0.5)
            nn.init.normal_(self.w_down, std=self.hidden_dim**-0.5)
            if self.num_shared_experts:
                nn.init.normal_(self.shared_w_gate_up, std=self.dim**-0.5)
                nn.init.normal_(self.shared_w_down, std=self.shared_hidden_dim**-0.5)

    def extra_repr(self) -> str:
        s = (
            f"dim={self.dim}, hidden_dim={self.hidden_dim}, num_experts={self.num_experts}, "
            f"top_k={self.top_k}, precision={self.precision!r}, score_func={self.score_func!r}, "
            f"renormalize={self.renormalize}, aux_loss_coef={self.aux_loss_coef}"
        )
        if self.num_shared_experts:
            s += f", num_shared_experts={self.num_shared_experts} (bf16)"
        if self.precision == "mxfp8":
            s += f", backend={self.backend!r}, wgrad={self.wgrad!r}"
            if self.weight_blocks != "1x32":
                s += f", weight_blocks={self.weight_blocks!r}"
            if self.scale_blocks == AUTO:
                recipe, kind = self._auto_recipe.peek(self.w_gate_up.device)
                s += f", scale_blocks='auto' ({recipe} on {kind})"
            elif self.scale_blocks == "1x128":
                s += f", scale_blocks={self.scale_blocks!r}"
            if not self.save_colwise:
                s += ", save_colwise=False"
            if self.cache_weights:
                s += ", cache_weights=True"
        return s

    # -----------------------------------------------------------------------------------------
    # the scale-block recipe: scale_blocks="auto" resolved per kind of device
    # -----------------------------------------------------------------------------------------

    def resolved_scale_blocks(self) -> str:
        """The recipe the expert GEMMs use on the parameters' device: ``scale_blocks`` when
        given explicitly, else what ``"auto"`` resolves to there (without running anything)."""
        if self.scale_blocks != AUTO:
            return self.scale_blocks
        return self._auto_recipe.peek(self.w_gate_up.device)[0]

    def _recipe_for(self, device: torch.device) -> str:
        """The recipe of a forward on ``device`` (``"auto"``: `AutoScaleBlocks.for_forward`)."""
        if self.scale_blocks != AUTO:
            return self.scale_blocks
        return self._auto_recipe.for_forward(device)

    @property
    def group_align_rows(self) -> int:
        """Rows each expert group of the MXFP8 layout starts on (128 for the 1x128 recipe)."""
        return group_align_rows(self.resolved_scale_blocks())

    # -----------------------------------------------------------------------------------------
    # the layer as an object: copies and checkpoint configuration
    # -----------------------------------------------------------------------------------------

    # The config's fields that change what the parameters mean: `moe_mxfp8.checkpoint` loads a
    # checkpoint only into a layer that agrees on every one (and on ``expert_shard``).
    CHECKPOINT_FIELDS = MXFP8MoEConfig.MEANING_FIELDS

    # Recorded in a checkpoint, never compared on load: the recipe. ``{"requested": "auto" or a
    # recipe, "resolved": the recipe in use}``; `load_recorded_recipe` keeps an explicit one.
    RECIPE_FIELD = "scale_blocks"

    def checkpoint_config(self) -> dict:
        """The layer's record in a checkpoint: its config (`MXFP8MoEConfig.to_dict`; read back
        by `MXFP8MoEConfig.from_dict`), ``expert_shard``: ``[ep_rank, ep_size]`` when the expert
        tensors hold one rank's share of the experts, else None (all of them), and the recipe
        asked for and in use (`RECIPE_FIELD`, informational)."""
        cfg = self.config.to_dict()
        ep_size = getattr(self, "ep_size", 1)
        cfg["expert_shard"] = [self.ep_rank, ep_size] if ep_size > 1 else None
        cfg[self.RECIPE_FIELD] = {"requested": self.scale_blocks,
                                  "resolved": self.resolved_scale_blocks()}
        return cfg

    def load_recorded_recipe(self, recorded) -> None:
        """A checkpoint written with an explicit recipe keeps it in a layer asking for
        ``"auto"`` (a run resumed on another kind of GPU trains on with the same recipe); the
        layer's own explicit choice always wins. ``recorded``: the checkpoint's `RECIPE_FIELD`."""
        requested = recorded.get("requested") if isinstance(recorded, dict) else None
        if self.scale_blocks == AUTO and requested not in (None, AUTO):
            check_scale_blocks(requested, "MXFP8MoE checkpoint")
            self._config = dataclasses.replace(self._config, scale_blocks=requested)
            self._auto_recipe = AutoScaleBlocks(LAYER)

    def __setstate__(self, state: dict) -> None:
        """A whole layer pickled before `MXFP8MoEConfig` existed (its options as attributes)
        gets its config built from those attributes."""
        if "_config" not in state:
            fields = {f.name for f in dataclasses.fields(MXFP8MoEConfig)}
            old = {k: state.pop(k) for k in list(state) if k in fields}
            for private, name in (("_check_finite", "check_finite"),
                                  ("_ep_payload", "ep_payload")):
                if private in state:
                    old[name] = state.pop(private)
            state["_config"] = MXFP8MoEConfig(**old)
        super().__setstate__(state)

    def __getstate__(self) -> dict:
        """A copy (``copy.deepcopy``, pickle) takes ``aux_loss`` detached: the live tensor holds
        the last forward's autograd graph, which cannot be copied (EMA and eval copies)."""
        state = super().__getstate__()
        if isinstance(state.get("aux_loss"), torch.Tensor):
            state["aux_loss"] = state["aux_loss"].detach()
        state["_weight_cache"] = None  # a copy quantizes its own weights
        return state

    # -----------------------------------------------------------------------------------------
    # quantized expert weights kept between forwards (cache_weights=True)
    # -----------------------------------------------------------------------------------------

    def weight_cache_bytes(self) -> int:
        """Bytes of FP8 expert weights (data + scales) the weight cache holds now."""
        cache = getattr(self, "_weight_cache", None)
        return 0 if cache is None else cache.nbytes()

    def invalidate_weight_cache(self) -> None:
        """Drop the cached FP8 expert weights: needed only after writing the expert weights
        through ``.data`` outside an optimizer step (`moe_mxfp8.weight_cache`)."""
        cache = getattr(self, "_weight_cache", None)  # absent while __init__ runs
        if cache is not None:
            cache.clear()

    def _apply(self, fn, *args, **kwargs):
        self.invalidate_weight_cache()  # .to(), .cuda(), .half(): the old copies are garbage
        return super()._apply(fn, *args, **kwargs)

    def _load_from_state_dict(self, *args, **kwargs):
        self.invalidate_weight_cache()  # the version bump would miss too; this frees memory
        return super()._load_from_state_dict(*args, **kwargs)

    def _quantized_weights(self, x: torch.Tensor, recipe: str):
        """The cached `routed_experts` ``weights_q`` of a forward with the resolved scale-block
        ``recipe``, or None (no cache)."""
        if not (self.cache_weights and self.precision == "mxfp8" and WC.usable(x)):
            return None
        if self.w_gate_up.is_inference():  # made under torch.inference_mode: no version counter
            return None
        if self._weight_cache is None:
            self._weight_cache = WC.WeightCache()
        get = self._weight_cache.get
        gu_k, gu_n = get("w_gate_up", self.w_gate_up, recipe, self.backend)
        dn_k, dn_n = get("w_down", self.w_down, recipe, self.backend)
        return gu_k, dn_k, gu_n, dn_n

    # -----------------------------------------------------------------------------------------
    # checks
    # -----------------------------------------------------------------------------------------

    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"MXFP8MoE: x must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in INPUT_DTYPES:
            raise TypeError(f"MXFP8MoE: x must be one of {INPUT_DTYPES}, got {x.dtype}")
        if x.dim() < 1 or x.shape[-1] != self.dim:
            raise ValueError(
                f"MXFP8MoE: x must have shape (..., dim={self.dim}), got {tuple(x.shape)}"
            )
        if x.device != self.w_gate_up.device:
            raise ValueError(
                f"MXFP8MoE: x is on {x.device} but the parameters are on {self.w_gate_up.device}"
            )

    # -----------------------------------------------------------------------------------------
    # forward pieces
    # -----------------------------------------------------------------------------------------

    def route(self, x: torch.Tensor) -> DS.Routing:
        """``x (T, D)`` -> `Routing`: weights ``(T, k)`` fp32, expert ids ``(T, k)`` int64,
        counts ``(E,)`` int64 (pairs per global expert) and the auxiliary loss (fp32 scalar)
        (`moe_mxfp8.router`). Sets ``nonfinite_tokens``; with ``check_finite="raise"`` the
        dispatcher raises `NonFiniteInputError` first (in one process, or on every rank of
        ``ep_group`` together)."""
        dev = x.device.type
        # fp32 logits (fp32 accumulation) even under autocast (which would make them BF16).
        no_autocast = (
            torch.autocast(dev, enabled=False)
            if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev)
            else contextlib.nullcontext()
        )
        with no_autocast:
            logits = router_logits(x, self.router.weight)  # (T, E) fp32
        aux_scale = self.aux_loss_coef * self.num_experts
        bad = None
        if self.check_finite == "raise":
            bad = self.dispatcher.nonfinite_rows_or_raise(logits.detach())
        # the router's kernels where the data path's run
        routing, self.nonfinite_tokens = RTR.route(
            logits, self.top_k, self.score_func, self.renormalize, aux_scale,
            ST.use_triton(logits, self.backend), bad)
        return routing

    def _shared_experts(self, x: torch.Tensor) -> torch.Tensor:
        """Dense SwiGLU of the shared experts in BF16 for both precisions: ``x (T, D)`` ->
        ``(T, D)`` bf16 (gate and up as one ``(T, 2 Hs)`` GEMM, then down)."""
        x = x.to(COMPUTE_DTYPE)
        h = F.linear(x, self.shared_w_gate_up.to(COMPUTE_DTYPE))  # (T, 2 Hs)
        gate, up = rearrange(h, "t (two h) -> two t h", two=2)
        return F.linear(F.silu(gate) * up, self.shared_w_down.to(COMPUTE_DTYPE))  # (T, D)

    def _experts(self, x: torch.Tensor) -> DS.Experts:
        """This process's routed experts as a forward on ``x`` runs them: ``scale_blocks``
        resolved for x's device (``"auto"`` warns if that changed), its group alignment, the
        cached FP8 weights (``cache_weights=True``)."""
        if self.precision == "mxfp8":
            recipe = self._recipe_for(x.device)
            align = group_align_rows(recipe)
        else:  # the BF16 twin: nothing quantized, groups packed
            recipe, align = "1x32", 1
        return DS.Experts(
            self.w_gate_up.to(COMPUTE_DTYPE), self.w_down.to(COMPUTE_DTYPE), self.precision,
            self.backend, self.wgrad, recipe, align, self._quantized_weights(x, recipe),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x (..., dim)`` -> ``(..., dim)`` (same dtype); sets ``self.aux_loss``. One path with
        or without expert parallelism: the dispatcher (`moe_mxfp8.dispatcher`) takes the routed
        pairs to their experts and back."""
        self._check_input(x)
        x_flat = rearrange(x, "... d -> (...) d")  # (T, D)
        routing = self.route(x_flat)
        self.aux_loss = routing.aux_loss
        self.tokens_per_expert = routing.counts.detach()
        # the routed experts' output plus the shared experts' (if any), (T, D) bf16
        shared = self._shared_experts if self.num_shared_experts else None
        out = self.dispatcher.run(x_flat, routing, self._experts(x), shared)
        return out.to(x.dtype).reshape(x.shape)
