"""README.md says what it does: every ``python`` block runs as written on a CPU, every documented
``python -m train_example...`` command line is accepted by its parser, and the install section
matches pyproject.toml."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS_WITH_COMMANDS = (README, ROOT / "train_example" / "README.md")
if str(ROOT) not in sys.path:  # from a checkout without `pip install`
    sys.path.insert(0, str(ROOT))


def code_blocks(path: Path, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", path.read_text(), flags=re.M | re.S)


PYTHON_BLOCKS = code_blocks(README, "python")


def test_readme_has_python_blocks():
    assert len(PYTHON_BLOCKS) >= 2


@pytest.mark.filterwarnings("ignore:moe_mxfp8. tensors on cpu:RuntimeWarning")
@pytest.mark.parametrize("i", range(len(PYTHON_BLOCKS)))
def test_readme_python_block_runs_as_written_on_cpu(i, capsys):
    """Each block on its own, in a fresh namespace (a reader may copy any one of them). One
    torch thread: on a 2-core machine shared with other jobs, OpenMP's spinning wait makes the
    layer block several times slower with 2."""
    torch.manual_seed(i)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = compile(PYTHON_BLOCKS[i], f"README.md python block {i}", "exec")
        exec(code, {"__name__": "readme"})
    finally:
        torch.set_num_threads(threads)


def _commands() -> list[tuple[str, str, list[str]]]:
    """``(doc, module, args)`` of every ``python -m train_example.*`` line in the docs' bash
    blocks (comments and ``[optional]`` parts dropped)."""
    out = []
    for doc in DOCS_WITH_COMMANDS:
        for block in code_blocks(doc, "bash"):
            for line in block.splitlines():
                line = re.sub(r"\s*\[[^\]]*\]", "", line.split("#")[0]).strip()
                if line.startswith("python -m train_example."):
                    words = shlex.split(line)
                    out.append((doc.name, words[2], words[3:]))
    return out


COMMANDS = _commands()


def test_docs_show_the_main_job():
    main = ("README.md", "train_example.parity", ["--device", "cpu", "--out", "runs/parity"])
    assert main in COMMANDS


@pytest.mark.parametrize("doc, module, args", COMMANDS,
                         ids=[f"{d}: {m} {' '.join(a)}" for d, m, a in COMMANDS])
def test_documented_command_line_is_accepted(doc, module, args, monkeypatch):
    from train_example import parity, train

    # --device cuda lines must parse on this CPU machine too.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    parser = {"train_example.parity": parity, "train_example.train": train}[module].build_parser()
    ns = parser.parse_args(args)
    assert ns.out


def test_install_section_matches_pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    deps = project["project"]["dependencies"]
    torch_req = next(d for d in deps if re.match(r"torch\b", d))
    minimum = re.search(r">=\s*([\d.]+)", torch_req).group(1)
    text = README.read_text()
    assert f"torch >= {minimum}" in text
    # A CPU machine gets the CPU build, not the multi-GB CUDA wheels.
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in text
    # numpy: safetensors' torch save needs it and does not declare it.
    assert any(re.match(r"numpy\b", d) for d in deps)
    # The main job runs after a non-editable install: train_example is a package.
    assert "train_example" in project["tool"]["setuptools"]["packages"]
    assert 'pip install ".[plot]"' in text
