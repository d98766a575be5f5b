"""Helpers of the tests that spawn one process per rank (expert parallelism, FSDP2)."""

from __future__ import annotations

import os
import socket
import sys

# gloo: CPU and the reference backend (CI); nccl: one GPU per rank and the GPU kernels
DEVICE = {"gloo": "cpu", "nccl": "cuda"}
LAYER_BACKEND = {"cpu": "reference", "cuda": "auto"}


def free_port() -> int:
    """A free TCP port on the loopback interface for the process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def leave_worker() -> None:
    """End a worker whose checks all passed without running C++ static destructors. Under load a
    gloo transport thread can still be joinable at interpreter exit, even after a barrier, and a
    joinable std::thread's destructor aborts the process (SIGABRT after every check had passed,
    seen in a clean-clone CI run on 2026-11-26)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
