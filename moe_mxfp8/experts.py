"""`MXFP8GroupedExperts`: torchtitan's ``GroupedExperts`` interface with MXFP8 grouped GEMMs.

torchtitan's MoE (``torchtitan/models/moe/moe.py``) routes and permutes the tokens itself -- and
with expert parallelism dispatches them through its own all-to-all -- and then calls
``experts(x, num_tokens_per_expert)`` on tokens already sorted by expert. This module has that
call and torchtitan's parameter names and shapes, so it swaps in for ``GroupedExperts`` (see
``train_example/torchtitan_swap.py``); checkpoints, sharding plans and optimizers keep working::

    w1  (E, H, D)   gate projection     h = silu(x w1^T) * (x w3^T)
    w3  (E, H, D)   up projection       out = h w2^T
    w2  (E, D, H)   down projection

Forward: the expert block of `MXFP8MoE` (`moe_mxfp8.datapath.routed_experts`: dispatch with
its MXFP8 copies, the gate/up GEMM over ``[w1; w3]`` with ``N = 2H``, SwiGLU fused with the
quantization of its output, the down GEMM, the combine), each row a token routed to its own
group with weight 1, so both recipes (``scale_blocks`` "1x32", "32x32", "1x128") and the same
fused kernels and backward serve both modules. The groups are re-laid out on the device with the
recipe's group alignment (16 rows, 128 for "1x128"; the dispatch copies the rows into it while
quantizing), from the counts alone (`routing.sorted_layout`: the rows come sorted, so nothing
sorts them again), and nothing reads the counts on the host; ``out`` has ``x``'s dtype.

Rows of ``x`` past ``sum(num_tokens_per_expert)`` -- torchtitan's static-size padding after
``generate_permute_indices`` (how it fills them differs between torchtitan versions) -- are
replaced by zeros (one ``torch.where`` pass over ``x``) and join the last expert's group, where
zero rows give zero outputs and add exact zeros to its weight gradient (the same "last group
absorbs the slack" layout as `MXFP8MoE`), so whatever those rows held reaches no result.
``aligned_groups`` and ``save_colwise`` are accepted for compatibility and change nothing (the
block aligns the groups itself and keeps what its backward needs).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import checks as C
from . import datapath as DP
from . import routing as RT
from .backend import AUTO, AutoScaleBlocks
from .checks import COMPUTE_DTYPE
from .config import check_expert_options
from .moe import group_align_rows


def _local(p: torch.Tensor) -> torch.Tensor:
    """A DTensor parameter (torchtitan's EP/FSDP plans) as this rank's plain tensor."""
    to_local = getattr(p, "to_local", None)
    return to_local() if to_local is not None else p


class MXFP8GroupedExperts(nn.Module):
    """SwiGLU experts on expert-sorted tokens: ``forward(x (M, D), num_tokens_per_expert (E,))``.

    Args:
        dim, hidden_dim, num_experts: ``D``, ``H``, ``E`` (this rank's experts under EP).
            ``D`` and ``H`` multiples of 32 for ``"mxfp8"``.
        use_grouped_mm: torchtitan's argument, accepted for the same signature; the experts
            always run as grouped GEMMs (its for-loop path computes the same math).
        precision: ``"mxfp8"`` (`moe_mxfp8.grouped_mm`) or ``"bf16"`` (``torch._grouped_mm``).
        backend, wgrad, save_colwise, weight_blocks, scale_blocks: as in `MXFP8MoE` (mxfp8
            only; ``scale_blocks="auto"``, the default, is the recipe of the GPU it runs on).
        aligned_groups: accepted, changes nothing (see the module doc).
        device, dtype: of the parameters (torchtitan keeps them in float32).
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        use_grouped_mm: bool = True,
        *,
        precision: str = "mxfp8",
        backend: str = "auto",
        wgrad: str = "mxfp8",
        save_colwise: bool = True,
        weight_blocks: str = "1x32",
        scale_blocks: str = AUTO,
        aligned_groups: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        scale_blocks = check_expert_options(
            "MXFP8GroupedExperts", dim=dim, hidden_dim=hidden_dim, num_experts=num_experts,
            precision=precision, backend=backend, wgrad=wgrad, scale_blocks=scale_blocks,
            weight_blocks=weight_blocks, env=True)
        self.num_experts = num_experts
        self.use_grouped_mm = bool(use_grouped_mm)
        self.precision = precision
        self.backend = backend
        self.wgrad = wgrad
        self.save_colwise = bool(save_colwise)
        self.weight_blocks = scale_blocks if scale_blocks == "32x32" else "1x32"  # older name
        self.scale_blocks = scale_blocks  # as asked: "auto" or a recipe
        self._auto_recipe = AutoScaleBlocks("MXFP8GroupedExperts")
        self.aligned_groups = bool(aligned_groups)
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim, **factory))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim, **factory))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim, **factory))

    def init_weights(self, init_std: float) -> None:
        """torchtitan's init: truncated normal, std 0.02 for ``w1``, ``init_std`` for w2/w3."""
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w2, mean=0.0, std=init_std)
        nn.init.trunc_normal_(self.w3, mean=0.0, std=init_std)

    def extra_repr(self) -> str:
        e, h, d = self.w1.shape
        s = f"dim={d}, hidden_dim={h}, num_experts={e}, precision={self.precision!r}"
        if self.precision == "mxfp8":
            s += f", backend={self.backend!r}, wgrad={self.wgrad!r}"
            if self.scale_blocks == AUTO:
                recipe, kind = self._auto_recipe.peek(self.w1.device)
                s += f", scale_blocks='auto' ({recipe} on {kind})"
            else:
                s += f", scale_blocks={self.scale_blocks!r}"
        return s

    def _recipe(self, device: torch.device) -> str:
        if self.precision == "bf16":
            return "1x32"  # unused by the BF16 path
        return (self._auto_recipe.for_forward(device) if self.scale_blocks == AUTO
                else self.scale_blocks)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """``x (M, D)`` sorted by expert, ``num_tokens_per_expert (E,)`` -> ``(M, D)``."""
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        e, _, d = w1.shape
        if x.dim() != 2 or x.shape[1] != d:
            raise ValueError(
                f"MXFP8GroupedExperts: x must be (M, dim={d}), got {tuple(x.shape)}"
            )
        if num_tokens_per_expert.dim() != 1 or num_tokens_per_expert.numel() != e:
            raise ValueError(
                f"MXFP8GroupedExperts: num_tokens_per_expert must be ({e},), got "
                f"{tuple(num_tokens_per_expert.shape)}"
            )
        # the values only where reading them costs no device sync (a CUDA count stays there)
        if C.values_on_host(num_tokens_per_expert) and bool((num_tokens_per_expert < 0).any()):
            raise ValueError(f"MXFP8GroupedExperts: num_tokens_per_expert must be non-negative, "
                             f"got {num_tokens_per_expert.tolist()}")
        m = x.shape[0]
        ends = torch.cumsum(num_tokens_per_expert.to(torch.int64), dim=0)
        # the groups' row bounds; the last runs to M (torchtitan's padding rows, module doc)
        bounds = torch.cat([ends[:-1].clamp(max=m), ends.new_full((1,), m)])
        counts = torch.diff(bounds, prepend=bounds.new_zeros(1))
        # rows past the counts -> zeros (the last group absorbs them; see the module doc)
        xb = torch.where((torch.arange(m, device=x.device) < ends[-1])[:, None],
                         x.to(COMPUTE_DTYPE), 0.0)
        w13 = torch.cat([w1.to(COMPUTE_DTYPE), w3.to(COMPUTE_DTYPE)], dim=1)  # (E, 2H, D)
        recipe = self._recipe(x.device)
        align = group_align_rows(recipe) if self.precision == "mxfp8" else 1
        # the layer's expert block: each row a token routed to its group with weight 1; the
        # rows come sorted by expert, so their layout needs no sort
        rows, src, offs = RT.sorted_layout(counts, m, align)
        ones = torch.ones(m, 1, device=x.device, dtype=torch.float32)
        out = DP.routed_experts(xb, w13, w2.to(COMPUTE_DTYPE), ones, rows, src, offs,
                                precision=self.precision, backend=self.backend,
                                wgrad=self.wgrad, scale_blocks=recipe)
        return out.type_as(x)
