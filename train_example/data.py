"""Real text with no download: the Python standard library's own ``*.py`` source files.

* Tokens are bytes (vocabulary 256); files are joined with a ``\\x00`` end-of-document byte, which
  does not occur in ordinary Python source.
* Train/validation split **by file**: a file is in validation when the SHA-1 of its relative
  path (posix form) falls in the first ``val_permille`` of 1000 buckets. The split depends only
  on the path, never on the seed or the byte cap.
* Order: the sorted file list of each split is shuffled by ``random.Random(seed)``; files are read
  in that order until the split's byte cap is reached (the last file is cut).
* Batches: random windows ``x = data[s : s + T]``, ``y = data[s + 1 : s + T + 1]``. Training batch
  ``step`` draws its starts from a `torch.Generator` seeded with ``(seed, step)`` alone, so any
  two runs with the same seed (BF16 and MXFP8, or a run and its resumption) see identical batches
  without carrying generator state. Validation uses one fixed set of windows.

The standard library differs between Python versions, so losses are comparable across runs on
the same interpreter, not across machines with different Pythons.
"""

from __future__ import annotations

import hashlib
import os
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

VOCAB_SIZE = 256
EOD_BYTE = 0
# Directories under the stdlib path that are not the standard library (installed packages) or
# hold no source.
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
# Seed offsets that separate the generator streams of training steps and of validation.
_TRAIN_STREAM = 0x5EED_0001
_VAL_STREAM = 0x5EED_0002


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_source_files(root: Path | None = None) -> list[str]:
    """Relative posix paths of every ``*.py`` file under ``root`` (default: the stdlib), sorted."""
    root = Path(root) if root is not None else stdlib_dir()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        rel = Path(dirpath).relative_to(root)
        out.extend((rel / f).as_posix() for f in filenames if f.endswith(".py"))
    return sorted(out)


def is_validation(relpath: str, val_permille: int) -> bool:
    digest = hashlib.sha1(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") % 1000 < val_permille


def _load(root: Path, files: list[str], seed: int, max_bytes: int) -> torch.Tensor:
    order = list(files)
    random.Random(seed).shuffle(order)
    chunks, total = [], 0
    for rel in order:
        if total >= max_bytes:
            break
        try:
            raw = (root / rel).read_bytes()
        except OSError:  # unreadable file (permissions, broken link): skip it
            continue
        piece = raw[: max_bytes - total - 1] + bytes([EOD_BYTE])
        chunks.append(piece)
        total += len(piece)
    if not chunks:
        raise RuntimeError(f"no readable *.py files under {root}")
    buf = bytearray(b"".join(chunks))
    return torch.frombuffer(buf, dtype=torch.uint8).clone()


@dataclass
class TextData:
    """Train and validation byte streams (uint8 tensors on the CPU)."""

    train: torch.Tensor
    val: torch.Tensor
    root: str
    num_train_files: int
    num_val_files: int

    def describe(self) -> str:
        return (
            f"data: {self.root} *.py — train {self.train.numel() / 1e6:.2f} MB "
            f"(of {self.num_train_files} files), val {self.val.numel() / 1e6:.2f} MB "
            f"(of {self.num_val_files} files), byte tokens"
        )


def load_stdlib_text(
    seed: int, max_train_bytes: int, max_val_bytes: int, val_permille: int = 50,
    root: Path | None = None,
) -> TextData:
    root = Path(root) if root is not None else stdlib_dir()
    files = list_source_files(root)
    val_files = [f for f in files if is_validation(f, val_permille)]
    train_files = [f for f in files if not is_validation(f, val_permille)]
    if not val_files or not train_files:
        raise RuntimeError(f"cannot split {len(files)} files under {root} into train/validation")
    return TextData(
        train=_load(root, train_files, seed, max_train_bytes),
        val=_load(root, val_files, seed, max_val_bytes),
        root=str(root),
        num_train_files=len(train_files),
        num_val_files=len(val_files),
    )


def _windows(data: torch.Tensor, starts: torch.Tensor, seq_len: int):
    idx = starts[:, None] + torch.arange(seq_len + 1)
    chunk = data[idx].long()
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


def _generator(*parts: int) -> torch.Generator:
    # Mix the parts into one 63-bit seed; hashing keeps (seed, step) pairs from colliding.
    key = hashlib.sha256(b"".join(p.to_bytes(8, "little", signed=True) for p in parts)).digest()
    return torch.Generator().manual_seed(int.from_bytes(key[:8], "little") >> 1)


def train_batch(data: TextData, step: int, batch_size: int, seq_len: int, seed: int):
    """Batch of training step ``step``: ``(x, y)`` int64 ``(batch_size, seq_len)`` on the CPU."""
    n = data.train.numel() - seq_len - 1
    if n <= 0:
        raise ValueError(f"train data ({data.train.numel()} bytes) shorter than seq_len + 1")
    starts = torch.randint(0, n, (batch_size,), generator=_generator(_TRAIN_STREAM, seed, step))
    return _windows(data.train, starts, seq_len)


def val_batches(data: TextData, num_batches: int, batch_size: int, seq_len: int, seed: int):
    """The fixed validation set: a list of ``num_batches`` ``(x, y)`` pairs."""
    n = data.val.numel() - seq_len - 1
    if n <= 0:
        raise ValueError(f"validation data ({data.val.numel()} bytes) shorter than seq_len + 1")
    g = _generator(_VAL_STREAM, seed)
    return [
        _windows(data.val, torch.randint(0, n, (batch_size,), generator=g), seq_len)
        for _ in range(num_batches)
    ]
