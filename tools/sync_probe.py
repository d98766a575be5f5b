"""Find the first host-synchronising op in an MXFP8MoE forward+backward (device diagnosis)."""

import traceback

import torch

from moe_mxfp8 import MXFP8MoE

mx = MXFP8MoE(1024, 512, 8, 2, device="cuda")
x = torch.randn(4, 512, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn_like(x)
for mode in ("default", "error"):
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        y = mx(x)
        (y * dy).sum().add(mx.aux_loss).backward()
        print(mode, "ok")
    except RuntimeError:
        traceback.print_exc()
    finally:
        torch.cuda.set_sync_debug_mode("default")
