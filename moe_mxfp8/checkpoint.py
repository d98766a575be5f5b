"""Safetensors checkpoints that record the configuration of every `MXFP8MoE` layer.

A state dict alone does not say how its weights are meant: a ``top_k=2`` checkpoint has the same
tensors as a ``top_k=4`` one. `save_file` writes the model's state dict (any ``nn.Module``; tied
weights are stored once, as ``safetensors.torch.save_model`` does) plus, in the safetensors
metadata, each `MXFP8MoE` submodule's `MXFP8MoE.checkpoint_config` (its `MXFP8MoEConfig`, as
``to_dict`` writes it and ``from_dict`` reads it back, and which experts an expert-parallel shard
holds) under its qualified name.
`load_file` compares the fields that change what the weights mean (`COMPARED_FIELDS`) with the
model before loading any tensor and refuses a mismatch with one line naming the layer, the field
and both values. The layer's scale-block recipe is recorded
too (asked for and in use) but not compared: the BF16 twin and every recipe share the weights; a
layer asking for ``"auto"`` takes over a recorded explicit recipe::

    from moe_mxfp8 import checkpoint

    checkpoint.save_file(model, "model.safetensors", metadata={"step": "100"})
    checkpoint.load_file(model, "model.safetensors")        # strict=True, device="cpu"
    checkpoint.read_metadata("model.safetensors")           # {"step": "100"}

The metadata also records the SHA-256 of every tensor's bytes; `load_file` verifies each
before loading and refuses a damaged file with one line naming the file and the tensor (a
flipped byte in the data would otherwise load as silently wrong, e.g. NaN, parameters). Files
written before the checksums were recorded still load, with a one-time warning that they are
unverified.

Plain ``model.load_state_dict(safetensors.torch.load_file(path))`` still loads these files (the
configuration lives in the metadata only), and `load_file` with ``strict=False`` loads files
written without it.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import warnings

import torch
from torch import nn

from .config import MXFP8MoEConfig
from .moe import MXFP8MoE

LAYERS_KEY = "moe_mxfp8.layers"  # metadata: JSON {qualified layer name: {field: value}}
CHECKSUMS_KEY = "moe_mxfp8.sha256"  # metadata: JSON {tensor name: SHA-256 hex of its bytes}
FORMAT_KEY = "moe_mxfp8.format"
FORMAT_VERSION = "1"
RESERVED_KEYS = (LAYERS_KEY, CHECKSUMS_KEY, FORMAT_KEY)
# Compared on load: what the weights mean (`MXFP8MoEConfig.MEANING_FIELDS`) and which experts
# they hold. The rest of a layer's record (its whole `MXFP8MoEConfig.to_dict`, the recipe asked
# for and in use) is informational: the BF16 twin and every recipe share the weights.
COMPARED_FIELDS = (*MXFP8MoEConfig.MEANING_FIELDS, "expert_shard")
_READ_CHUNK = 1 << 24  # bytes per read while hashing a file's tensor data
_warned_unverified: set[str] = set()

PathLike = str | os.PathLike


def layer_configs(model: nn.Module) -> dict[str, dict]:
    """``{qualified name: layer.checkpoint_config()}`` of every `MXFP8MoE` in ``model``
    (``""`` when ``model`` is itself one)."""
    return {
        name: mod.checkpoint_config()
        for name, mod in model.named_modules()
        if isinstance(mod, MXFP8MoE)
    }


def tensor_sha256(t: torch.Tensor) -> str:
    """SHA-256 (hex) of a tensor's bytes as safetensors stores them (contiguous, little-endian,
    on the CPU)."""
    data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(data.numpy().data).hexdigest()


def save_file(model: nn.Module, path: PathLike, *, metadata: dict[str, str] | None = None) -> None:
    """Write ``model``'s state dict, its layers' configuration and each tensor's SHA-256 to
    ``path`` (safetensors).

    ``metadata``: extra ``str -> str`` entries (e.g. the step), returned by `read_metadata`.
    """
    from safetensors.torch import save_model  # noqa: PLC0415  (optional at import time)

    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"save_file: {path}: the directory {folder} does not exist")
    if os.path.isdir(path):
        raise IsADirectoryError(f"save_file: {path} is a directory, not a file name")
    meta = dict(metadata or {})
    for key, value in meta.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"save_file: metadata must map str to str, got {key!r}: {value!r}")
        if key in RESERVED_KEYS:
            raise ValueError(f"save_file: metadata key {key!r} is reserved by moe_mxfp8")
    meta[LAYERS_KEY] = json.dumps(layer_configs(model), sort_keys=True)
    # every state-dict name (a tied duplicate that save_model drops is never looked up)
    meta[CHECKSUMS_KEY] = json.dumps(
        {name: tensor_sha256(t) for name, t in model.state_dict().items()}, sort_keys=True)
    meta[FORMAT_KEY] = FORMAT_VERSION
    save_model(model, path, metadata=meta)


def _raw_metadata(path: PathLike) -> dict[str, str]:
    from safetensors import SafetensorError, safe_open  # noqa: PLC0415

    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(f"checkpoint {path}: is a directory, not a checkpoint file")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path}: no such file")
    try:
        with safe_open(path, framework="pt") as f:
            return dict(f.metadata() or {})
    except SafetensorError as e:
        raise ValueError(f"checkpoint {path}: not a readable safetensors file ({e})") from None


def read_metadata(path: PathLike) -> dict[str, str]:
    """A checkpoint's metadata without moe_mxfp8's own entries: the caller's ``metadata`` (and
    ``save_model``'s ``{dropped name: kept name}`` records of tied tensors)."""
    return {k: v for k, v in _raw_metadata(path).items() if k not in RESERVED_KEYS}


def _json_mapping(path: PathLike, key: str) -> dict | None:
    """The metadata entry ``key`` of ``path`` as a JSON mapping, None when absent; anything
    else is one error line naming the file and the entry."""
    raw = _raw_metadata(path).get(key)
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"checkpoint {os.fspath(path)}: {key} is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"checkpoint {os.fspath(path)}: {key} is not a mapping")
    return value


def read_layer_configs(path: PathLike) -> dict[str, dict] | None:
    """The recorded layer configurations, or None for a file written without them."""
    configs = _json_mapping(path, LAYERS_KEY)
    if configs is None:
        return None
    for name, cfg in configs.items():
        if not isinstance(cfg, dict):
            raise ValueError(f"checkpoint {os.fspath(path)}: {LAYERS_KEY} entry {name!r} is not "
                             f"a mapping of fields (got {type(cfg).__name__})")
    return configs


def _tensor_ranges(path: str) -> dict[str, tuple[int, int]]:
    """``{name: (start, end)}`` byte offsets of each tensor's data in a safetensors file (an
    8-byte little-endian header length, the JSON header, then the data)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    base = 8 + n
    return {name: (base + info["data_offsets"][0], base + info["data_offsets"][1])
            for name, info in header.items() if name != "__metadata__"}


def verify_checksums(path: PathLike) -> bool:
    """Compare every tensor's bytes in ``path`` with the SHA-256 recorded when it was saved;
    a difference is a ValueError naming the file and the tensor. Returns False (nothing to
    compare) for a file written without checksums."""
    path = os.fspath(path)
    want = _json_mapping(path, CHECKSUMS_KEY)
    if want is None:
        return False
    with open(path, "rb") as f:
        for name, (start, end) in sorted(_tensor_ranges(path).items(), key=lambda kv: kv[1]):
            if name not in want:
                raise ValueError(f"checkpoint {path}: tensor {name!r} has no recorded checksum")
            h = hashlib.sha256()
            f.seek(start)
            left = end - start
            while left:
                chunk = f.read(min(left, _READ_CHUNK))
                if not chunk:
                    break
                h.update(chunk)
                left -= len(chunk)
            if h.hexdigest() != want[name]:
                raise ValueError(f"checkpoint {path}: tensor {name!r} is corrupted (its bytes "
                                 "differ from the SHA-256 recorded when it was saved)")
    return True


def _layer_name(name: str) -> str:
    return f"layer {name!r}" if name else "(the model itself)"


def check_layer_configs(model: nn.Module, saved: dict[str, dict] | None, *, strict: bool = True,
                        source: str = "checkpoint") -> None:
    """Refuse a checkpoint whose recorded configuration differs from ``model``'s layers.

    Differing values are always an error. With ``strict``, so are a file without the record and
    layers present on one side only.
    """
    have = layer_configs(model)
    if saved is None:
        if strict and have:
            raise ValueError(
                f"{source} records no MXFP8MoE configuration (not written by "
                "moe_mxfp8.checkpoint.save_file); pass strict=False to load it unchecked"
            )
        return
    if strict:
        extra = sorted(set(saved) - set(have))
        if extra:
            raise ValueError(f"{source} has MXFP8MoE {_layer_name(extra[0])}, which the model "
                             f"lacks ({len(extra)} such layer(s))")
        lacking = sorted(set(have) - set(saved))
        if lacking:
            raise ValueError(f"{source} has no configuration for the model's MXFP8MoE "
                             f"{_layer_name(lacking[0])} ({len(lacking)} such layer(s))")
    for name in sorted(set(have) & set(saved)):
        diffs = [
            f"{field}={saved[name][field]!r} but the model has {field}={have[name][field]!r}"
            for field in COMPARED_FIELDS
            if field in saved[name] and saved[name][field] != have[name][field]
            # all experts (None) load into an expert-parallel shard too (sliced on load)
            and not (field == "expert_shard" and saved[name][field] is None)
        ]
        if diffs:
            raise ValueError(f"{source}: MXFP8MoE {_layer_name(name)} was saved with "
                             + "; ".join(diffs))


def load_file(model: nn.Module, path: PathLike, *, strict: bool = True,
              device: str | int | torch.device = "cpu") -> tuple[list[str], list[str]]:
    """Check the recorded configuration against ``model``, then load the tensors into it.

    ``strict``: refuse missing or unexpected keys and a file without the configuration record
    (``strict=False`` loads what matches and returns the rest). ``device``: where the tensors are
    read to before being copied into the parameters. Every tensor's bytes are checked against
    the SHA-256 recorded by `save_file` first (`verify_checksums`); a file without checksums
    loads unverified (one warning). Returns ``(missing, unexpected)`` keys.
    """
    from safetensors.torch import load_model  # noqa: PLC0415

    source = f"checkpoint {os.fspath(path)}"
    try:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"load_file: device must be a torch device, got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"load_file: device={device!r}, but no CUDA GPU is visible to torch")
    saved = read_layer_configs(path)
    check_layer_configs(model, saved, strict=strict, source=source)
    if not verify_checksums(path) and source not in _warned_unverified:
        _warned_unverified.add(source)
        warnings.warn(f"{source} records no tensor checksums (written by an older "
                      "moe_mxfp8.checkpoint); loading it unverified", RuntimeWarning,
                      stacklevel=2)
    if isinstance(device, torch.device):
        device = str(device)
    missing, unexpected = load_model(model, os.fspath(path), strict=strict, device=device)
    for name, mod in model.named_modules():
        if isinstance(mod, MXFP8MoE) and name in (saved or {}):
            mod.load_recorded_recipe(saved[name].get(MXFP8MoE.RECIPE_FIELD))
    return sorted(missing), sorted(unexpected)
