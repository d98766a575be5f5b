"""`benchmarks.bench_ep` runs end to end on the CPU (gloo, world size 1, reference kernels):
every step variant is timed, profiled and written to its JSON (the GPU runs use the same code)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.spawned import free_port

ROOT = Path(__file__).resolve().parents[1]


def test_bench_ep_cpu_dry_run(tmp_path):
    out = tmp_path / "ep.json"
    env = {**os.environ, "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(var, None)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_ep", "--cpu-dry-run", "--shapes", "tiny",
         "--tokens", "48", "--warmup", "0", "--reps", "1", "--profile", "--shared", "1",
         "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "input-gradient return" in proc.stdout
    (row,) = json.loads(out.read_text())["rows"]
    from benchmarks.bench_ep import RETURN_SMS_SWEEP

    assert "1 shared expert(s)" in proc.stdout and row["shared_experts"] == 1
    keys = ["one_gpu_all_experts", "ep_mxfp8", "ep_bf16", "ep_mxfp8_grad_mxfp8",
            "ep_mxfp8_shared_inline",
            *[f"ep_mxfp8_return_{n}" for n in ("after", *RETURN_SMS_SWEEP)]]
    for key in keys:
        assert row[f"step_ms_{key}"] > 0, key
        names = [r[0] for r in row[f"profile_{key}"]["kernels"]]
        assert names[-2:] == ["nccl (all)", "all kernels"] and len(names) > 2, key
    assert row["bytes_mxfp8"] == 48 * 2 * (128 + 128 // 32)  # tokens * k * (D + D/32)


def test_timeline_counts_the_exchange_hidden_behind_other_kernels():
    from benchmarks.bench_ep import timeline

    spans = [(0, 10, False), (2, 4, True), (8, 13, True), (12, 15, False), (16, 18, True),
             (9, 11, False)]
    # others [0, 11) + [12, 15); NCCL [2, 4) + [8, 13) + [16, 18): beside others 2 + (3 + 1) + 0;
    # busy [0, 15) + [16, 18)
    assert timeline(spans) == {"busy": 17, "nccl": 9, "nccl_hidden": 6}
    assert timeline([]) == {"busy": 0, "nccl": 0, "nccl_hidden": 0}
