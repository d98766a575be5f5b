"""`moe_mxfp8.checkpoint`: the layer configuration travels in the safetensors metadata and a
mismatch is refused with one line naming the layer, the field and both values; plain
``load_state_dict`` keeps loading the same files."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file as st_load_file
from safetensors.torch import save_file as st_save_file
from torch import nn

from moe_mxfp8 import MXFP8MoE, MXFP8MoEConfig, checkpoint

BF16 = torch.bfloat16
BASE = {"dim": 64, "hidden_dim": 64, "num_experts": 4, "top_k": 2}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _moe(**kw):
    args = {**BASE, "backend": "reference", **kw}
    return MXFP8MoE(args.pop("dim"), args.pop("hidden_dim"), args.pop("num_experts"),
                    args.pop("top_k"), **args)


class Tiny(nn.Module):
    """A model with two MoE layers and a tied embedding/head (shared storage)."""

    def __init__(self, **moe_kw):
        super().__init__()
        self.emb = nn.Embedding(16, 64, dtype=BF16)
        self.layers = nn.ModuleList([_moe(**moe_kw), _moe(**moe_kw)])
        self.head = nn.Linear(64, 16, bias=False, dtype=BF16)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)


def test_roundtrip_records_configuration_and_metadata(tmp_path):
    torch.manual_seed(0)
    a = Tiny()
    path = tmp_path / "m.safetensors"
    checkpoint.save_file(a, path, metadata={"step": "7"})
    # the caller's entries plus safetensors' record of the tied tensor it stored once
    assert checkpoint.read_metadata(path) == {"step": "7", "head.weight": "emb.weight"}
    cfgs = checkpoint.read_layer_configs(path)
    assert set(cfgs) == {"layers.0", "layers.1"}
    # the layer's whole config (its to_dict), which experts it holds and the recipe
    assert cfgs["layers.1"] == {**a.layers[1].config.to_dict(), "expert_shard": None,
                                "scale_blocks": {"requested": "auto", "resolved": "1x32"}}
    assert cfgs["layers.1"]["backend"] == "reference" and cfgs["layers.1"]["top_k"] == 2
    assert MXFP8MoEConfig.from_dict(cfgs["layers.1"]) == a.layers[1].config  # read back
    torch.manual_seed(1)
    b = Tiny()
    assert checkpoint.load_file(b, path) == ([], [])
    for (n, t), (n2, u) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert n == n2 and torch.equal(t, u), n
    assert b.head.weight is b.emb.weight  # the tie survives
    ids = torch.randint(0, 16, (2, 5))
    with torch.no_grad():
        assert torch.equal(a(ids), b(ids))


@pytest.mark.parametrize(
    "saved,loaded,field",
    [
        ({"top_k": 2}, {"top_k": 4}, "was saved with top_k=2 but the model has top_k=4"),
        ({"score_func": "softmax"}, {"score_func": "sigmoid"}, "score_func='softmax'"),
        ({"renormalize": True}, {"renormalize": False}, "renormalize=True"),
        ({"num_shared_experts": 1}, {"num_shared_experts": 0}, "num_shared_experts=1"),
        ({"num_experts": 4}, {"num_experts": 8}, "num_experts=4"),
    ],
)
def test_mismatch_is_one_clear_line(tmp_path, saved, loaded, field):
    path = tmp_path / "m.safetensors"
    checkpoint.save_file(_moe(**saved), path)
    model = _moe(**loaded)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=field) as info:
        checkpoint.load_file(model, path)
    msg = str(info.value)
    assert "\n" not in msg and str(path) in msg
    name = next(iter(loaded))
    assert f"but the model has {name}={loaded[name]!r}" in msg
    for k, v in model.state_dict().items():  # nothing was loaded
        assert torch.equal(v, before[k])


def test_precision_backend_and_dtype_are_not_part_of_the_configuration(tmp_path):
    path = tmp_path / "m.safetensors"
    src = _moe(precision="mxfp8", wgrad="bf16", aux_loss_coef=0.1)
    checkpoint.save_file(src, path)
    dst = _moe(precision="bf16", dtype=torch.float32, backend="auto", weight_blocks="32x32")
    checkpoint.load_file(dst, path)
    assert torch.equal(dst.w_down, src.w_down.float())


# A layer record as the format wrote it before it held the whole config: the fields that change
# what the weights mean, the expert shard and the recipe.
OLDER_RECORD = {**BASE, "num_shared_experts": 0, "score_func": "softmax", "renormalize": True,
                "expert_shard": None, "scale_blocks": {"requested": "1x128", "resolved": "1x128"}}


def test_older_records_still_load_and_read_back(tmp_path):
    """A file whose layer record holds only the compared fields loads (checked on those), its
    explicit recipe is taken over by a layer asking for "auto", and `from_dict` reads it with
    the other fields at their defaults."""
    src = _moe()
    path = tmp_path / "older.safetensors"
    st_save_file(src.state_dict(), str(path),
                 metadata={checkpoint.LAYERS_KEY: json.dumps({"": OLDER_RECORD})})
    dst = _moe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # no checksums recorded
        checkpoint.load_file(dst, path)
    assert torch.equal(dst.w_down, src.w_down)
    assert dst.scale_blocks == "1x128" and dst.config.scale_blocks == "1x128"
    cfg = MXFP8MoEConfig.from_dict(OLDER_RECORD)
    assert cfg == MXFP8MoEConfig(**BASE, scale_blocks="1x128")
    with pytest.raises(ValueError, match="top_k=2 but the model has top_k=1"):
        checkpoint.load_file(_moe(top_k=1), path)


def test_plain_load_state_dict_still_works(tmp_path):
    path = tmp_path / "m.safetensors"
    src = _moe()
    checkpoint.save_file(src, path)
    dst = _moe()
    dst.load_state_dict(st_load_file(str(path)))
    assert torch.equal(dst.w_gate_up, src.w_gate_up)


def test_files_without_the_record(tmp_path):
    path = tmp_path / "plain.safetensors"
    src = _moe()
    st_save_file(src.state_dict(), str(path))
    with pytest.raises(ValueError, match="records no MXFP8MoE configuration.*strict=False"):
        checkpoint.load_file(_moe(), path)
    dst = _moe()
    assert checkpoint.load_file(dst, path, strict=False) == ([], [])
    assert torch.equal(dst.router.weight, src.router.weight)
    plain = nn.Linear(4, 4)  # a model without MXFP8MoE layers needs no record
    st_save_file(plain.state_dict(), str(tmp_path / "lin.safetensors"))
    checkpoint.load_file(nn.Linear(4, 4), tmp_path / "lin.safetensors")


def test_layer_sets_must_match_under_strict(tmp_path):
    path = tmp_path / "m.safetensors"
    checkpoint.save_file(Tiny(), path)
    one = nn.ModuleDict({"layers": nn.ModuleList([_moe()])})
    with pytest.raises(ValueError, match="'layers.1', which the model lacks"):
        checkpoint.load_file(one, path)
    missing, unexpected = checkpoint.load_file(one, path, strict=False)
    assert missing == [] and "emb.weight" in unexpected
    three = nn.ModuleDict({"layers": nn.ModuleList([_moe(), _moe(), _moe()])})
    with pytest.raises(ValueError, match="no configuration for the model's MXFP8MoE "
                                         "layer 'layers.2'"):
        checkpoint.load_file(three, path)


def test_strict_false_still_refuses_a_differing_value(tmp_path):
    path = tmp_path / "m.safetensors"
    checkpoint.save_file(_moe(top_k=1), path)
    with pytest.raises(ValueError, match="MXFP8MoE \\(the model itself\\) was saved with top_k=1"):
        checkpoint.load_file(_moe(), path, strict=False)


def test_unreadable_files_and_bad_metadata(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        checkpoint.load_file(_moe(), tmp_path / "nope.safetensors")
    good = tmp_path / "good.safetensors"
    checkpoint.save_file(_moe(), good)
    data = good.read_bytes()
    for name, content in [("garbage", b"\x00\x01garbage"), ("empty", b""),
                          ("truncated", data[: len(data) // 2])]:
        bad = tmp_path / f"{name}.safetensors"
        bad.write_bytes(content)
        with pytest.raises(ValueError, match="not a readable safetensors file") as info:
            checkpoint.load_file(_moe(), bad)
        assert "\n" not in str(info.value) and str(bad) in str(info.value)
    with pytest.raises(ValueError, match="reserved"):
        checkpoint.save_file(_moe(), tmp_path / "x.safetensors",
                             metadata={checkpoint.LAYERS_KEY: "{}"})
    with pytest.raises(TypeError, match="str to str"):
        checkpoint.save_file(_moe(), tmp_path / "x.safetensors", metadata={"step": 3})
    raw = tmp_path / "raw.safetensors"
    st_save_file({"w": torch.zeros(1)}, str(raw), metadata={checkpoint.LAYERS_KEY: "[1]"})
    with pytest.raises(ValueError, match="not a mapping"):
        checkpoint.read_layer_configs(raw)
    assert json.loads(json.dumps(_moe().checkpoint_config())) == _moe().checkpoint_config()


def test_expert_parallel_shards_are_told_apart(tmp_path):
    """Rank 1's expert shard has the shapes of rank 0's: only the record tells them apart. (The
    EP attributes are set by hand here; tests/test_expert_parallel.py runs real groups.)"""
    def shard(rank):
        layer = _moe()
        layer.ep_size, layer.ep_rank = 2, rank
        return layer

    path = tmp_path / "rank1.safetensors"
    checkpoint.save_file(shard(1), path)
    assert checkpoint.read_layer_configs(path)[""]["expert_shard"] == [1, 2]
    with pytest.raises(ValueError, match=r"expert_shard=\[1, 2\] but the model has "
                                         r"expert_shard=\[0, 2\]"):
        checkpoint.load_file(shard(0), path)
    checkpoint.load_file(shard(1), path)
    with pytest.raises(ValueError, match="expert_shard=None"):  # a shard into a full layer
        checkpoint.load_file(_moe(), path)
    # A full checkpoint (all experts) is accepted by a shard: the EP layer slices it on load.
    full = {"": _moe().checkpoint_config()}
    checkpoint.check_layer_configs(shard(1), full)


# --- damaged data, unusable paths and devices -------------------------------------------------


def _corrupt(path, where: int, n: int = 100) -> None:
    """Overwrite ``n`` bytes at ``where`` (an offset into the tensor data) with 0xFF (NaN in
    BF16 and float32)."""
    data = bytearray(path.read_bytes())
    data[where:where + n] = b"\xff" * n
    path.write_bytes(bytes(data))


def test_corrupted_tensor_data_is_one_line_naming_file_and_tensor(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "m.safetensors"
    checkpoint.save_file(Tiny(), path)
    start, end = checkpoint._tensor_ranges(str(path))["layers.1.w_down"]
    _corrupt(path, start + (end - start) // 2)
    model = Tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="tensor 'layers.1.w_down' is corrupted") as info:
        checkpoint.load_file(model, path)
    msg = str(info.value)
    assert "\n" not in msg and str(path) in msg
    for k, v in model.state_dict().items():  # nothing was loaded
        assert torch.equal(v, before[k])
    # the metadata is intact and a plain load would have taken NaN parameters without a word
    assert st_load_file(str(path))["layers.1.w_down"].isnan().any()


def test_checksums_cover_every_stored_tensor_and_a_clean_file_loads_silently(tmp_path):
    path = tmp_path / "m.safetensors"
    a = Tiny()
    checkpoint.save_file(a, path)
    stored = checkpoint._tensor_ranges(str(path))
    assert "head.weight" not in stored  # the tied duplicate is stored once
    assert checkpoint.verify_checksums(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checkpoint.load_file(Tiny(), path)
    assert checkpoint.RESERVED_KEYS == (checkpoint.LAYERS_KEY, checkpoint.CHECKSUMS_KEY,
                                        checkpoint.FORMAT_KEY)
    with pytest.raises(ValueError, match="reserved"):
        checkpoint.save_file(a, path, metadata={checkpoint.CHECKSUMS_KEY: "{}"})


def test_file_without_checksums_loads_with_one_warning(tmp_path):
    """A checkpoint written before checksums were recorded still loads (unverified), and says
    so once."""
    src = _moe()
    path = tmp_path / "old.safetensors"
    meta = {checkpoint.LAYERS_KEY: json.dumps({"": src.checkpoint_config()}),
            checkpoint.FORMAT_KEY: checkpoint.FORMAT_VERSION}
    st_save_file(src.state_dict(), str(path), metadata=meta)
    assert not checkpoint.verify_checksums(path)
    dst = _moe()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        checkpoint.load_file(dst, path)
        checkpoint.load_file(dst, path)
    msgs = [str(w.message) for w in seen if "checksums" in str(w.message)]
    assert len(msgs) == 1 and "unverified" in msgs[0] and str(path) in msgs[0]
    assert torch.equal(dst.w_down, src.w_down)


def test_bad_checksum_record_is_one_line(tmp_path):
    path = tmp_path / "m.safetensors"
    src = _moe()
    for raw, match in (("[1]", "not a mapping"), ("{", "not JSON"), ("{}", "no recorded checksum")):
        meta = {checkpoint.LAYERS_KEY: json.dumps({"": src.checkpoint_config()}),
                checkpoint.CHECKSUMS_KEY: raw}
        st_save_file(src.state_dict(), str(path), metadata=meta)
        with pytest.raises(ValueError, match=match):
            checkpoint.load_file(_moe(), path)


def test_layer_entry_that_is_not_a_mapping_is_one_line(tmp_path):
    raw = tmp_path / "raw.safetensors"
    st_save_file({"w": torch.zeros(1)}, str(raw), metadata={checkpoint.LAYERS_KEY: '{"": [1]}'})
    with pytest.raises(ValueError, match="entry '' is not a mapping of fields .got list."):
        checkpoint.load_file(_moe(), raw)


def test_directory_paths_are_one_line(tmp_path):
    with pytest.raises(IsADirectoryError, match="is a directory, not a checkpoint file"):
        checkpoint.load_file(_moe(), tmp_path)
    with pytest.raises(IsADirectoryError, match="is a directory, not a file name"):
        checkpoint.save_file(_moe(), tmp_path)
    missing = tmp_path / "no" / "such" / "m.safetensors"
    with pytest.raises(FileNotFoundError, match=f"the directory {tmp_path / 'no' / 'such'} "
                                                "does not exist") as info:
        checkpoint.save_file(_moe(), missing)
    assert ".tmp" not in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_cuda_device_without_cuda_is_one_line(tmp_path):
    path = tmp_path / "m.safetensors"
    checkpoint.save_file(_moe(), path)
    for device in ("cuda", "cuda:1", 0, torch.device("cuda")):
        with pytest.raises(ValueError, match="no CUDA GPU is visible"):
            checkpoint.load_file(_moe(), path, device=device)
    with pytest.raises(ValueError, match="device must be a torch device"):
        checkpoint.load_file(_moe(), path, device="gpu")
