"""The GPU a kernel runs on: its operands' device, never whichever device is current.

CuTeDSL kernels (called through `native` or CuTeDSL's executor) and Triton kernels launch on
the current CUDA device, on the stream their launch names. A layer on ``cuda:1`` called while
``cuda:0`` is current would otherwise run its kernels on GPU 0's stream against GPU 1's memory,
racing the PyTorch ops that wrote the operands: wrong results, no error. Every launch site
runs inside `on_device` of its operands (and names that device's stream,
`native.current_stream`).

Imports neither CuTeDSL nor Triton.
"""

from __future__ import annotations

import contextlib

import torch

_NO_GUARD = contextlib.nullcontext()


def on_device(device: torch.device):
    """A context in which ``device`` (a CUDA ``torch.device`` with its index, as a tensor's
    ``.device`` has) is the current CUDA device; nothing for a CPU device (the Triton
    interpreter, CPU stand-ins in tests). One C call to switch the device and one to switch
    it back: cheap enough for every launch."""
    if device.type != "cuda":
        return _NO_GUARD
    return torch.cuda.device(device)
