"""docs/interop.md and docs/install.md say what the code does: every ``python`` block of
interop.md that is not marked as needing several processes runs as written on a CPU (in a
subprocess: a block may start a process group), and the install page names the extras that
pyproject.toml defines."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INTEROP = ROOT / "docs" / "interop.md"
INSTALL = ROOT / "docs" / "install.md"


def runnable_blocks() -> list[str]:
    blocks = re.findall(r"^```python\n(.*?)^```", INTEROP.read_text(), flags=re.M | re.S)
    # the multi-process sketch starts with a torchrun comment
    return [b for b in blocks if not b.startswith("# torchrun")]


def test_interop_page_has_runnable_blocks():
    assert len(runnable_blocks()) >= 3


@pytest.mark.parametrize("i", range(len(runnable_blocks())))
def test_interop_block_runs_as_written_on_cpu(i):
    block = runnable_blocks()[i]
    if "from transformers import" in block and importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (the [hf] extra)")
    res = subprocess.run([sys.executable, "-W", "ignore::RuntimeWarning", "-c",
                          block], cwd=ROOT, capture_output=True, text=True,
                         timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]


def test_install_page_names_the_extras():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = project["project"]["optional-dependencies"]
    text = INSTALL.read_text()
    for extra in ("gpu", "gpu-cu13", "kernels", "hf"):
        assert f'.[{extra}' in text or f"[{extra}]" in text, extra
    assert any("nvidia-cutlass-dsl[cu13]" in d for d in extras["gpu-cu13"])
    # a CPU install pulls no CUDA package
    assert not any("cutlass" in d for d in project["project"]["dependencies"])
    ci = (ROOT / ".ci" / "run").read_text()
    ci_extras = re.search(r'pip install -q -e "\.\[([^\]]*)\]"', ci).group(1).split(",")
    assert "kernels" in ci_extras and "hf" in ci_extras  # CI runs the transformers tests
