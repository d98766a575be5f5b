"""`MXFP8MoEConfig`: the layer's options as one frozen, validated value, and the one owner of the
layer's vocabulary (CPU)."""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from pathlib import Path

import pytest
import torch

from moe_mxfp8 import MXFP8GroupedExperts, MXFP8MoE, MXFP8MoEConfig
from moe_mxfp8 import config as C

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"dim": 64, "hidden_dim": 64, "num_experts": 4, "top_k": 2}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "auto" falling back on the CPU
        yield


def _cfg(**kw) -> MXFP8MoEConfig:
    return MXFP8MoEConfig(**{**SIZES, "backend": "reference", **kw})


# ---- frozen, equal, hashable -----------------------------------------------------------------


def test_config_is_frozen_and_so_are_the_layer_attributes_it_owns():
    cfg = _cfg()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.top_k = 1  # type: ignore[misc]
    layer = MXFP8MoE(config=cfg)
    assert layer.config is cfg
    for name in ("dim", "top_k", "precision", "scale_blocks", "backend"):
        with pytest.raises(AttributeError):
            setattr(layer, name, getattr(layer, name))
    assert layer.config == cfg  # nothing changed it


def test_equality_and_hash():
    a, b = _cfg(), _cfg()
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert _cfg(check_finite=True) == _cfg(check_finite="raise")  # stored as the new spelling
    assert _cfg(aux_loss_coef=0) == _cfg(aux_loss_coef=0.0)
    assert isinstance(_cfg(aux_loss_coef=0).aux_loss_coef, float)
    c = dataclasses.replace(a, top_k=1)
    assert c != a and c.top_k == 1 and a.top_k == 2
    with pytest.raises(ValueError, match="top_k must be an int"):
        dataclasses.replace(a, top_k=9)  # a changed copy is validated again


# ---- every field's check, one line, the same as the layer's ----------------------------------


BAD = [
    ("dim", 0, ValueError, "MXFP8MoE: dim must be a positive int, got 0"),
    ("dim", True, ValueError, "MXFP8MoE: dim must be a positive int, got True"),
    ("hidden_dim", -32, ValueError, "MXFP8MoE: hidden_dim must be a positive int, got -32"),
    ("num_experts", 1.0, ValueError, "MXFP8MoE: num_experts must be a positive int, got 1.0"),
    ("dim", 48, ValueError, "MXFP8MoE: dim must be a multiple of 32 for precision='mxfp8' "
     "(MXFP8 blocks of 32 along every reduced dim), got 48"),
    ("top_k", 5, ValueError, "MXFP8MoE: top_k must be an int in [1, num_experts=4], got 5"),
    ("top_k", 2.0, ValueError, "MXFP8MoE: top_k must be an int in [1, num_experts=4], got 2.0"),
    ("precision", "fp8", ValueError,
     "MXFP8MoE: precision must be one of ('mxfp8', 'bf16'), got 'fp8'"),
    ("backend", "bogus", ValueError,
     "MXFP8MoE: backend must be one of ('auto', 'reference', 'sm90', 'sm100'), got 'bogus'"),
    ("score_func", "relu", ValueError,
     "MXFP8MoE: score_func must be one of ('softmax', 'sigmoid'), got 'relu'"),
    ("renormalize", "yes", TypeError, "MXFP8MoE: renormalize must be a bool, got 'yes'"),
    ("aux_loss_coef", -0.1, ValueError,
     "MXFP8MoE: aux_loss_coef must be a finite number >= 0, got -0.1"),
    ("aux_loss_coef", float("nan"), ValueError,
     "MXFP8MoE: aux_loss_coef must be a finite number >= 0, got nan"),
    ("wgrad", "fp8", ValueError, "MXFP8MoE: wgrad must be one of ('mxfp8', 'bf16'), got 'fp8'"),
    ("scale_blocks", "16x16", ValueError,
     "MXFP8MoE: scale_blocks must be one of ('auto', '1x32', '32x32', '1x128') (per device; "
     "exact MXFP8; 32x32 weight tiles; 1x128 activation blocks with 128x128 weight tiles), "
     "got '16x16'"),
    ("num_shared_experts", -1, ValueError,
     "MXFP8MoE: num_shared_experts must be an int >= 0, got -1"),
    ("ep_payload", "fp8", ValueError,
     "MXFP8MoE: ep_payload must be one of ('mxfp8', 'bf16'), got 'fp8'"),
    ("ep_grad_payload", None, ValueError,
     "MXFP8MoE: ep_grad_payload must be one of ('mxfp8', 'bf16'), got None"),
    ("check_finite", "warn", ValueError,
     "MXFP8MoE: check_finite must be one of ('flag', 'raise'), got 'warn'"),
    ("cache_weights", 1, TypeError, "MXFP8MoE: cache_weights must be a bool, got 1"),
    ("save_colwise", 1, TypeError, "MXFP8MoE: save_colwise must be a bool, got 1"),
]


@pytest.mark.parametrize("field, value, exc, message", BAD,
                         ids=[f"{f}={v!r}" for f, v, _, _ in BAD])
def test_every_field_is_checked_with_one_line_and_the_layer_says_the_same(field, value, exc,
                                                                          message):
    with pytest.raises(exc) as info:
        _cfg(**{field: value})
    assert str(info.value) == message
    options = {**SIZES, "backend": "reference", field: value}
    with pytest.raises(exc) as info:
        MXFP8MoE(**options)  # the keyword form: the same check, the same line
    assert str(info.value) == message


def test_every_field_is_covered_by_the_bad_values():
    assert {f.name for f in dataclasses.fields(MXFP8MoEConfig)} == {f for f, *_ in BAD}


def test_the_bf16_twin_takes_any_dims_and_the_payload_follows_the_precision():
    assert _cfg(dim=48, hidden_dim=80, precision="bf16").dim == 48
    assert _cfg().resolved_ep_payload == "mxfp8"
    assert _cfg(precision="bf16").resolved_ep_payload == "bf16"
    assert _cfg(precision="bf16", ep_payload="mxfp8").resolved_ep_payload == "mxfp8"
    assert MXFP8MoE(config=_cfg(precision="bf16")).ep_payload == "bf16"


# ---- to_dict / from_dict ---------------------------------------------------------------------


def test_round_trip_through_json():
    cfg = _cfg(precision="bf16", score_func="sigmoid", renormalize=False, aux_loss_coef=0.5,
               wgrad="bf16", scale_blocks="1x128", num_shared_experts=2, ep_payload="mxfp8",
               ep_grad_payload="mxfp8", check_finite="raise", cache_weights=True)
    d = cfg.to_dict()
    assert set(d) == {f.name for f in dataclasses.fields(MXFP8MoEConfig)}
    assert MXFP8MoEConfig.from_dict(json.loads(json.dumps(d))) == cfg
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['topk'\]"):
        MXFP8MoEConfig.from_dict({**d, "topk": 2})
    with pytest.raises(TypeError, match="expected a dict"):
        MXFP8MoEConfig.from_dict([1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="top_k must be an int"):
        MXFP8MoEConfig.from_dict({**d, "top_k": 0})  # validated like any other


def test_from_dict_reads_a_checkpoint_record():
    layer = MXFP8MoE(**SIZES, backend="reference", scale_blocks="1x128", num_shared_experts=1)
    record = json.loads(json.dumps(layer.checkpoint_config()))
    assert record["scale_blocks"] == {"requested": "1x128", "resolved": "1x128"}
    assert record["expert_shard"] is None
    assert MXFP8MoEConfig.from_dict(record) == layer.config


# ---- the two ways to build a layer -----------------------------------------------------------


def test_keyword_form_equals_config_form():
    options = {"precision": "mxfp8", "score_func": "sigmoid", "wgrad": "bf16",
               "scale_blocks": "1x128", "num_shared_experts": 1, "check_finite": True,
               "aux_loss_coef": 0.1}
    torch.manual_seed(0)
    by_kw = MXFP8MoE(*SIZES.values(), backend="reference", **options)
    torch.manual_seed(0)
    by_cfg = MXFP8MoE(config=_cfg(**options))
    assert by_kw.config == by_cfg.config == _cfg(**options)
    assert repr(by_kw) == repr(by_cfg)
    for (n, a), (m, b) in zip(by_kw.state_dict().items(), by_cfg.state_dict().items(),
                              strict=True):
        assert n == m and torch.equal(a, b)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    assert torch.equal(by_kw(x), by_cfg(x))


def test_config_with_options_or_not_a_config_is_refused():
    with pytest.raises(ValueError, match=r"pass config or the layer's options, not both "
                                         r"\(got config and precision, top_k\)"):
        MXFP8MoE(config=_cfg(), top_k=1, precision="bf16")
    with pytest.raises(ValueError, match="got config and dim"):
        MXFP8MoE(64, config=_cfg())
    with pytest.raises(TypeError, match="config must be an MXFP8MoEConfig, got dict"):
        MXFP8MoE(config=_cfg().to_dict())  # type: ignore[arg-type]
    # placement is not configuration: device, dtype and ep_group go beside it
    layer = MXFP8MoE(config=_cfg(), dtype=torch.float32, device="cpu")
    assert layer.w_down.dtype == torch.float32


def test_check_finite_stays_assignable_and_updates_the_config():
    layer = MXFP8MoE(config=_cfg())
    layer.check_finite = True
    assert layer.check_finite == "raise" and layer.config == _cfg(check_finite="raise")
    with pytest.raises(ValueError, match="check_finite must be one of"):
        layer.check_finite = "off"
    assert layer.config.check_finite == "raise"


def test_deprecated_options():
    """``weight_blocks`` is no field (``scale_blocks`` holds its recipes); ``save_colwise=False``
    warns in the config form too."""
    with pytest.warns(DeprecationWarning, match="MXFP8MoE: weight_blocks is deprecated"):
        cfg = MXFP8MoEConfig.from_options(**SIZES, weight_blocks="32x32")
    assert cfg.scale_blocks == "32x32" and cfg.weight_blocks == "32x32"
    with pytest.warns(DeprecationWarning, match="MXFP8MoE: save_colwise is deprecated"):
        assert not _cfg(save_colwise=False).save_colwise
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        MXFP8MoEConfig.from_dict(_cfg().to_dict())  # defaults never warn


def test_a_recorded_recipe_updates_the_config():
    layer = MXFP8MoE(config=_cfg())
    layer.load_recorded_recipe({"requested": "1x128", "resolved": "1x128"})
    assert layer.scale_blocks == "1x128" and layer.config == _cfg(scale_blocks="1x128")
    with pytest.raises(ValueError, match="MXFP8MoE checkpoint: scale_blocks must be one of"):
        MXFP8MoE(config=_cfg()).load_recorded_recipe({"requested": "64x64"})


# ---- one owner ---------------------------------------------------------------------------------


def test_grouped_experts_check_their_options_with_the_same_owner():
    with pytest.raises(ValueError, match=re.escape(
            "MXFP8GroupedExperts: precision must be one of ('mxfp8', 'bf16'), got 'fp8'")):
        MXFP8GroupedExperts(64, 64, 4, precision="fp8")
    # it left the backend to the first forward before; now it refuses a bad name when built
    with pytest.raises(ValueError, match="MXFP8GroupedExperts: backend must be one of"):
        MXFP8GroupedExperts(64, 64, 4, backend="bogus")
    with pytest.raises(ValueError, match="MXFP8GroupedExperts: dim must be a multiple of 32"):
        MXFP8GroupedExperts(48, 64, 4)
    assert MXFP8GroupedExperts(64, 64, 4, weight_blocks="32x32").scale_blocks == "32x32"


VOCABULARY = {  # the literal tuples config.py owns
    "precision / wgrad / payloads": ("mxfp8", "bf16"),
    "weight_blocks": ("1x32", "32x32"),
    "score_func": ("softmax", "sigmoid"),
    "check_finite": ("flag", "raise"),
}


def test_each_vocabulary_is_spelled_once():
    """No module of the package or the training example spells a vocabulary tuple again (in
    either order): they import it from `moe_mxfp8.config`."""
    files = [*(ROOT / "moe_mxfp8").rglob("*.py"), *(ROOT / "train_example").rglob("*.py")]
    for what, (a, b) in VOCABULARY.items():
        literal = re.compile(rf"""\(\s*["']({a}|{b})["']\s*,\s*["']({a}|{b})["']\s*,?\s*\)""")
        where = [f"{p.relative_to(ROOT)}" for p in files for _ in literal.finditer(p.read_text())]
        assert where == ["moe_mxfp8/config.py"], (what, where)
    assert C.WGRAD_MODES is C.PRECISIONS and C.EP_PAYLOADS is C.PRECISIONS


def test_a_layer_pickled_before_the_config_loads():
    """A whole layer pickled before `MXFP8MoEConfig` existed kept its options as attributes
    (``check_finite`` as ``_check_finite``): unpickling builds its config from them."""
    import pickle

    layer = MXFP8MoE(64, 96, 4, 2, scale_blocks="1x128", check_finite="raise")
    state = layer.__getstate__()
    old = dict(state)
    cfg = old.pop("_config")
    old.update({k: v for k, v in cfg.to_dict().items() if k != "check_finite"})
    old["_check_finite"] = cfg.check_finite
    restored = MXFP8MoE.__new__(MXFP8MoE)
    restored.__setstate__(old)
    assert restored.config == layer.config
    assert restored.check_finite == "raise" and restored.scale_blocks == "1x128"
    again = pickle.loads(pickle.dumps(restored))
    assert again.config == layer.config
