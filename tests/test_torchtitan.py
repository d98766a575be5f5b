"""torchtitan's own MoE (torchtitan >= 0.3, ``torchtitan.models.common.moe``) with its experts'
GEMMs swapped to MXFP8 by ``train_example.torchtitan_swap`` on the CPU: forward and backward
against torchtitan's BF16 module within the SQNR floors of the MXFP8 SwiGLU experts, the same
parameters and state dict keys (checkpoints interchange), a few training steps.

torchtitan imports Triton and its own dependencies at import time: this module skips where
torchtitan is not importable (a plain CI install; `pip install torchtitan` brings it)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.compare import fwd_bwd, sqnr_db

titan = pytest.importorskip("torchtitan.models.common.moe",
                            reason="torchtitan (>= 0.3) is not importable")
from torchtitan.models.common.linear import Linear  # noqa: E402
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher  # noqa: E402

from train_example.torchtitan_swap import swap_grouped_experts  # noqa: E402

DIM, HIDDEN, EXPERTS, TOP_K = 64, 64, 8, 2
# MXFP8 SwiGLU experts vs BF16 (tests/test_expert_parallel.py's GROUPED_EXPERTS_MIN_DB: measured
# 23.1-23.6 dB on 560 tokens); the layer output adds the BF16 routing on top.
OUT_MIN_DB = 21.0
GRAD_MIN_DB = 20.0  # expert weight gradients (MXFP8 wgrad): measured 23.1-23.6 dB here


def build_moe(seed):
    torch.manual_seed(seed)
    cfg = titan.MoE.Config(
        num_experts=EXPERTS,
        routed_experts=titan.RoutedExperts.Config(
            inner_experts=titan.GroupedExperts.Config(dim=DIM, hidden_dim=HIDDEN,
                                                      num_experts=EXPERTS),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=EXPERTS, top_k=TOP_K)),
        router=titan.TokenChoiceTopKRouter.Config(
            num_experts=EXPERTS, gate=Linear.Config(in_features=DIM, out_features=EXPERTS),
            top_k=TOP_K, score_func="softmax"),
    )
    moe = cfg.build()
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    return moe


def test_swapped_torchtitan_moe_matches_its_bf16_module(gen):
    moe = build_moe(int(torch.randint(2**31, (1,), generator=gen)))
    mx = copy.deepcopy(moe)
    params = {n: p for n, p in mx.named_parameters()}
    assert swap_grouped_experts(mx, backend="reference") == 1
    assert swap_grouped_experts(mx, backend="reference") == 0  # not twice
    # the same Parameter objects and state dict keys: torchtitan checkpoints load unchanged
    assert {n: p for n, p in mx.named_parameters()} == params
    assert mx.state_dict().keys() == moe.state_dict().keys()
    mx.load_state_dict(moe.state_dict())

    x = torch.randn(4, 70, DIM, generator=gen)
    dy = torch.randn(4, 70, DIM, generator=gen)
    y_ref, dx_ref, g_ref = fwd_bwd(moe, x, dy)
    y, dx, g = fwd_bwd(mx, x, dy)
    dbs = {"y": sqnr_db(y_ref, y), "dx": sqnr_db(dx_ref, dx)}
    dbs.update({n: sqnr_db(g_ref[n], g[n]) for n in g_ref if "inner_experts" in n})
    print({k: round(v, 1) for k, v in dbs.items()})
    assert dbs["y"] >= OUT_MIN_DB and dbs["dx"] >= OUT_MIN_DB, dbs
    assert all(v >= GRAD_MIN_DB for v in dbs.values()), dbs

    # a few steps of training the swapped module lower its loss on a fixed target
    target = torch.randn(4, 70, DIM, generator=gen)
    opt = torch.optim.AdamW(mx.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = (mx(x) - target).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses
    # and its checkpoint loads back into torchtitan's BF16 module
    moe.load_state_dict(mx.state_dict())
