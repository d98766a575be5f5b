"""Timing helpers shared by the benchmarks: CUDA-graph replays, rotating inputs, medians."""

from __future__ import annotations

import datetime
import statistics
import time
from collections.abc import Callable, Sequence

import torch


def device_info() -> dict:
    p = torch.cuda.get_device_properties(0)
    return {
        "gpu": p.name,
        "sms": p.multi_processor_count,
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
    }


def bench_us(
    fn: Callable[[], object], *, warmup: int = 5, reps: int = 30, rounds: int = 5,
    use_graph: bool = True,
) -> float:
    """Median microseconds of one ``fn()`` call.

    ``fn`` is captured in a CUDA graph ``reps`` times (launch gaps vanish) when ``use_graph``;
    the median is over ``rounds`` timed replays. Callers rotate their inputs inside ``fn`` (cold
    L2) by closing over an iterator of several input sets.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if use_graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=s):
                for _ in range(reps):
                    fn()
        torch.cuda.current_stream().wait_stream(s)
        run = g.replay
    else:
        def run():
            for _ in range(reps):
                fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(times)


def collective_ms(fn: Callable[[], object], warmup: int, reps: int, cuda: bool) -> float:
    """Median milliseconds of one ``fn()`` that every rank of the default process group calls
    together (eager: expert parallelism reads its split sizes on the host, no CUDA graphs): a
    barrier before each timed call, CUDA events around it (``cuda``), else the host clock."""
    import torch.distributed as dist  # noqa: PLC0415

    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        dist.barrier()
        if not cuda:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


class Rotating:
    """Cycle through ``n`` input sets so repeated calls do not hit a warm L2."""

    def __init__(self, sets: Sequence):
        self.sets = list(sets)
        self.i = 0

    def next(self):
        item = self.sets[self.i % len(self.sets)]
        self.i += 1
        return item
