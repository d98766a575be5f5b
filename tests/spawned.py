"""Helpers of the tests that spawn one process per rank (expert parallelism, FSDP2)."""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

# gloo: CPU and the reference backend (CI); nccl: one GPU per rank and the GPU kernels
DEVICE = {"gloo": "cpu", "nccl": "cuda"}
LAYER_BACKEND = {"cpu": "reference", "cuda": "auto"}


def free_port() -> int:
    """A free TCP port on the loopback interface for the process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_rank(rank: int, ws: int, port: int, pg_backend: str) -> None:
    """Join the ``ws``-rank process group as ``rank`` (nccl: on GPU ``rank``)."""
    extra = {}
    if pg_backend == "nccl":
        torch.cuda.set_device(rank)
        extra["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(pg_backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=ws, timeout=timedelta(seconds=120), **extra)


def leave_worker() -> None:
    """End a worker whose checks all passed without running C++ static destructors. Under load a
    gloo transport thread can still be joinable at interpreter exit, even after a barrier, and a
    joinable std::thread's destructor aborts the process (SIGABRT after every check had passed,
    seen in a clean-clone CI run on 2026-11-26)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
