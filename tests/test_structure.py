"""The package's layering, read from its own imports (tools/import_graph.py; CPU, nothing run),
and the device runner's reach: every file of GPU tests belongs to one of its suites.

``moe_mxfp8/`` is the API; ``kernels/`` (``moe_mxfp8.kernels``) lives below it. A kernel module
never imports the API (it takes plain tensors and the format facts of ``kernels/mx_format.py``),
and no module imports another that imports it back, directly or through others.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import import_graph  # noqa: E402


def test_graph_sees_the_known_edges():
    """The parser finds module-level and lazy (in-function) imports, relative and absolute."""
    es = import_graph.edges()
    assert ("moe_mxfp8.grouped_gemm", "moe_mxfp8.kernels.grouped_gemm.problem") in es
    # lazy: the API imports the host classes, the launchers import a kernel module to compile
    assert ("moe_mxfp8.grouped_gemm", "moe_mxfp8.kernels.grouped_gemm.sm90_config") in es
    assert ("moe_mxfp8.kernels.quantize_launch", "moe_mxfp8.kernels.quantize") in es
    assert ("moe_mxfp8.kernels.grouped_gemm.sm90", "moe_mxfp8.kernels.grouped_gemm.schedule") in es
    assert ("moe_mxfp8.layout", "moe_mxfp8.kernels.mx_format") in es


def test_kernels_never_import_the_api_and_there_is_no_cycle():
    assert import_graph.check() == []


def test_check_reports_an_upward_import_and_a_cycle(monkeypatch):
    fake = {("moe_mxfp8.kernels.x", "moe_mxfp8.layout"), ("moe_mxfp8.a", "moe_mxfp8.b"),
            ("moe_mxfp8.b", "moe_mxfp8.a")}
    monkeypatch.setattr(import_graph, "edges", lambda: fake)
    problems = import_graph.check()
    assert any("kernels.x imports moe_mxfp8.layout" in p for p in problems)
    assert any(p.startswith("import cycle") for p in problems)


def test_every_gpu_test_file_is_in_a_device_suite():
    """`tools/gpu.sh`'s suites name every test file holding GPU-marked tests: a file
    left out would never run on the device machine, and its tests would pass CI by skipping."""
    import re

    runner = (ROOT / "tools" / "gpu.sh").read_text()
    suites = " ".join(re.findall(r'^\s*\[[\w-]+\]="([^"]*)"', runner, flags=re.M))
    named = set(suites.split())
    mark = "pytest.mark." + "gpu"  # spelled in two parts: this file holds no GPU test
    gpu_files = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                 if mark in p.read_text()}
    assert gpu_files, "no GPU test files found"
    assert sorted(gpu_files - named) == []
