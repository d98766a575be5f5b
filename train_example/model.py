"""A small decoder-only byte-level transformer whose feed-forward layers are `MXFP8MoE`.

Precision recipe (the usual MXFP8 training recipe):

* Master weights are fp32 (the optimizer updates fp32), the forward runs under
  ``torch.autocast(dtype=torch.bfloat16)``: attention projections, attention itself and the
  tied output head compute in BF16, the residual stream stays fp32.
* RMSNorm computes in fp32 and hands BF16 to what follows, so every `MXFP8MoE` receives BF16
  activations (checked in `Block.forward`). The MoE itself runs with autocast *off*: it manages
  its own precision (router in fp32, its fp32 master weights cast to BF16 -- or quantized to
  MXFP8 -- for the expert GEMMs); autocast would otherwise push its router matmul to BF16.
* Only the MoE expert GEMMs (fprop, dgrad, wgrad) run in MXFP8 when ``precision="mxfp8"``;
  embeddings, norms, attention, router and head are identical in both precisions.
* The cross-entropy is computed in fp32 from the BF16 logits.

Positions: rotary embeddings (RoPE, computed in fp32). Attention:
`F.scaled_dot_product_attention` with ``is_causal=True``. Input and output embeddings are tied.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from moe_mxfp8.config import MXFP8MoEConfig

COMPUTE_DTYPE = torch.bfloat16
INIT_STD = 0.02  # GPT-2 style initialisation of embeddings and projections


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    hidden_dim: int = 256  # per expert
    num_experts: int = 4
    top_k: int = 2
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    aux_loss_coef: float = 0.01

    def to_dict(self) -> dict:
        return asdict(self)


# Model sizes per preset. Training hyperparameters of the same presets live in train.py.
MODEL_PRESETS: dict[str, ModelConfig] = {
    # For the CPU smoke test: a few seconds for a handful of steps.
    "micro": ModelConfig(dim=32, n_layers=1, n_heads=2, hidden_dim=64, num_experts=4, top_k=2,
                         max_seq_len=32),
    # The default: both precisions in a few minutes on a 2-core CPU with the reference backend.
    "cpu-tiny": ModelConfig(dim=128, n_layers=2, n_heads=4, hidden_dim=256, num_experts=4,
                            top_k=2, max_seq_len=128),
    # ~250M parameters (~80M active per token), for one GPU.
    "gpu": ModelConfig(dim=768, n_layers=8, n_heads=12, hidden_dim=1536, num_experts=8,
                       top_k=2, max_seq_len=1024),
}


def model_config(preset: str, **overrides) -> ModelConfig:
    if preset not in MODEL_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(MODEL_PRESETS)}")
    return replace(MODEL_PRESETS[preset], **overrides)


def _moe_class():
    import moe_mxfp8

    cls = getattr(moe_mxfp8, "MXFP8MoE", None)
    if cls is None:
        from moe_mxfp8.moe import MXFP8MoE as cls  # noqa: N813
    return cls


def _to_compute(x: torch.Tensor) -> torch.Tensor:
    """BF16 under autocast (the training recipe), else the input dtype (fp32 debugging)."""
    if torch.is_autocast_enabled(x.device.type):
        return x.to(torch.get_autocast_dtype(x.device.type))
    return x


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return _to_compute(y)


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    ang = torch.arange(seq_len, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x (B, H, T, D)``: rotate pairs (first half, second half) of the head dim, in fp32."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.dim % cfg.n_heads or (cfg.dim // cfg.n_heads) % 2:
            raise ValueError(f"dim {cfg.dim} must split into {cfg.n_heads} heads of even size")
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


def moe_config(cfg: ModelConfig, precision: str = "mxfp8", backend: str = "auto",
               wgrad: str = "mxfp8", scale_blocks: str = "auto") -> MXFP8MoEConfig:
    """The `MXFP8MoEConfig` of the model's MoE layers (the one place the training options
    become layer options): sizes and ``aux_loss_coef`` from ``cfg``; ``wgrad`` and
    ``scale_blocks`` apply to ``precision="mxfp8"`` only (the BF16 twin keeps the defaults)."""
    numerics = {"wgrad": wgrad, "scale_blocks": scale_blocks} if precision == "mxfp8" else {}
    return MXFP8MoEConfig(cfg.dim, cfg.hidden_dim, cfg.num_experts, cfg.top_k,
                          precision=precision, backend=backend,
                          aux_loss_coef=cfg.aux_loss_coef, **numerics)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, moe: MXFP8MoEConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.moe_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        # fp32 master weights: the MoE casts them to BF16 (or quantizes them) in its forward.
        self.moe = _moe_class()(config=moe, dtype=torch.float32)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        h = self.moe_norm(x)
        dev = h.device.type
        if torch.is_autocast_enabled(dev) and h.dtype != COMPUTE_DTYPE:
            raise RuntimeError(f"MXFP8MoE must get {COMPUTE_DTYPE} activations, got {h.dtype}")
        # Autocast off inside the MoE: it manages its own precision (fp32 router, BF16 or MXFP8
        # expert GEMMs); autocast would otherwise run the router and the reference GEMMs'
        # matmuls in BF16.
        with torch.autocast(dev, enabled=False):
            return x + self.moe(h)


class MoETransformer(nn.Module):
    """Byte-level LM: ``forward(idx (B, T) int64) -> logits (B, T, vocab)``.

    After a forward, `aux_loss` is the sum of the MoE layers' load-balancing losses (already
    weighted by ``aux_loss_coef``), to be added to the training loss.
    """

    def __init__(self, cfg: ModelConfig, precision: str = "mxfp8", backend: str = "auto",
                 wgrad: str = "mxfp8", scale_blocks: str = "auto"):
        super().__init__()
        moe = moe_config(cfg, precision, backend, wgrad, scale_blocks)  # validates them
        self.cfg = cfg
        self.precision = precision
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg, moe) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        cos, sin = rope_tables(cfg.max_seq_len, cfg.dim // cfg.n_heads // 2 * 2, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._init_weights()
        self.aux_loss: torch.Tensor | None = None

    @torch.no_grad()
    def _init_weights(self) -> None:
        """Embedding and attention: N(0, 0.02); residual output projections scaled by
        1/sqrt(2 n_layers) (GPT-2). The MoE keeps its own initialisation."""
        nn.init.normal_(self.embed.weight, std=INIT_STD)
        for blk in self.blocks:
            nn.init.normal_(blk.attn.qkv.weight, std=INIT_STD)
            nn.init.normal_(blk.attn.proj.weight, std=INIT_STD / math.sqrt(2 * self.cfg.n_layers))

    def num_parameters(self) -> tuple[int, int]:
        """(total, active per token): active counts top_k of num_experts expert weights."""
        total = sum(p.numel() for p in self.parameters())
        expert = sum(p.numel() for n, p in self.named_parameters()
                     if ".moe." in n and p.dim() == 3)  # expert weights are (E, ., .)
        active = total - expert + expert * self.cfg.top_k // self.cfg.num_experts
        return total, active

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {t} > max_seq_len {self.cfg.max_seq_len}")
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = self.embed(idx)  # fp32 residual stream
        aux = x.new_zeros(())
        for blk in self.blocks:
            x = blk(x, cos, sin)
            if blk.moe.aux_loss is not None:
                aux = aux + blk.moe.aux_loss.float()
        self.aux_loss = aux
        h = self.norm(x)
        return F.linear(h, _to_compute(self.embed.weight))  # tied output head


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy in fp32 (nats). As log-softmax + gather + mean rather than
    ``F.cross_entropy``, whose CUDA NLL reduction has no deterministic version."""
    logp = logits.float().view(-1, logits.shape[-1]).log_softmax(-1)
    return -logp.gather(1, targets.reshape(-1, 1)).mean()
