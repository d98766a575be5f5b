"""`MXFP8MoEConfig`: the options of an `MXFP8MoE` layer as one frozen, validated value, and the
one owner of the layer's vocabulary and of its checks.

Every name a user passes to the layer (``precision``, ``wgrad``, ``scale_blocks`` and its older
``weight_blocks``, ``score_func``, ``check_finite``, the expert-parallel payloads) is defined
here once, with the check that gives its one-line error; `MXFP8MoE`, `MXFP8GroupedExperts`,
`moe_mxfp8.grouped_mm` and the data path call these checks instead of keeping copies. Two
vocabularies live with what they describe and are imported here: the kernel backends
(`moe_mxfp8.backend.BACKENDS`, with the environment variable that can replace ``"auto"``) and
the scale-block recipes (`SCALE_BLOCKS`, in `moe_mxfp8.kernels.mx_format`, which the kernels
read and which cannot import the API).

A config holds what the layer *is*, not where it lives: the parameters' ``device`` and
``dtype`` and the expert-parallel process group ``ep_group`` are arguments of `MXFP8MoE`
beside ``config``. ``to_dict`` / ``from_dict`` round-trip it through JSON (`moe_mxfp8.checkpoint`
records it for every layer)::

    cfg = MXFP8MoEConfig(dim=1024, hidden_dim=2048, num_experts=8, top_k=2)
    layer = MXFP8MoE(config=cfg)            # the same layer as MXFP8MoE(1024, 2048, 8, 2)
    layer.config == cfg                     # frozen, hashable
    MXFP8MoEConfig.from_dict(cfg.to_dict()) == cfg
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

from .backend import AUTO, check_backend_name
from .kernels.mx_format import BLOCK_SIZE, SCALE_BLOCKS

PRECISIONS = ("mxfp8", "bf16")  # the routed experts' GEMMs: MXFP8, or the BF16 twin
WGRAD_MODES = PRECISIONS  # the weight gradients' GEMMs: the same two formats
EP_PAYLOADS = PRECISIONS  # what expert parallelism's all-to-all sends: the same two formats
WEIGHT_BLOCKS = ("1x32", "32x32")  # the older `weight_blocks` name of two of SCALE_BLOCKS
SCORE_FUNCS = ("softmax", "sigmoid")
CHECK_FINITE_MODES = ("flag", "raise")
LAYER = "MXFP8MoE"  # the name a layer's (and its config's) errors start with
MXFP8_DIMS_WHY = " (MXFP8 blocks of 32 along every reduced dim)"


# ---------------------------------------------------------------------------------------------
# The checks (one line each, naming the caller ``who`` and the argument)
# ---------------------------------------------------------------------------------------------


def check_choice(who: str, name: str, value, names: tuple) -> None:
    """``value`` one of ``names``."""
    if not isinstance(value, str) or value not in names:
        raise ValueError(f"{who}: {name} must be one of {names}, got {value!r}")


def check_flag(who: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{who}: {name} must be a bool, got {value!r}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_layer_dims(dim, hidden_dim, num_experts, who: str) -> None:
    """A layer's sizes: positive ints."""
    for name, v in (("dim", dim), ("hidden_dim", hidden_dim), ("num_experts", num_experts)):
        if not _is_int(v) or v < 1:
            raise ValueError(f"{who}: {name} must be a positive int, got {v!r}")


def check_mxfp8_dims(precision, dim, hidden_dim, who: str, why: str = "") -> None:
    """precision="mxfp8": both reduced dims whole MXFP8 blocks (``why``: said after the rule)."""
    if precision == "mxfp8":
        for name, v in (("dim", dim), ("hidden_dim", hidden_dim)):
            if v % BLOCK_SIZE:
                raise ValueError(
                    f"{who}: {name} must be a multiple of {BLOCK_SIZE} for "
                    f"precision='mxfp8'{why}, got {v}"
                )


def check_weight_blocks(weight_blocks, who: str = "grouped_mm") -> None:
    if not isinstance(weight_blocks, str) or weight_blocks not in WEIGHT_BLOCKS:
        raise ValueError(
            f"{who}: weight_blocks must be one of {WEIGHT_BLOCKS} (1x32 blocks, or one scale "
            f"per 32x32 weight tile), got {weight_blocks!r}"
        )


def check_scale_blocks(scale_blocks, who: str = "grouped_mm", *, auto: bool = False) -> None:
    """A recipe of `SCALE_BLOCKS` (or ``"auto"`` where ``auto``)."""
    names = (AUTO, *SCALE_BLOCKS) if auto else SCALE_BLOCKS
    if not isinstance(scale_blocks, str) or scale_blocks not in names:
        raise ValueError(
            f"{who}: scale_blocks must be one of {names} ({'per device; ' if auto else ''}exact "
            f"MXFP8; 32x32 weight tiles; 1x128 activation blocks with 128x128 weight tiles), "
            f"got {scale_blocks!r}"
        )


def resolve_scale_blocks(scale_blocks, weight_blocks, who: str = "grouped_mm") -> str:
    """The recipe (or ``"auto"``) from ``scale_blocks`` and the older ``weight_blocks`` (None or
    "1x32": not given; "32x32" agrees only with ``scale_blocks`` "auto", "1x32" or "32x32")."""
    check_scale_blocks(scale_blocks, who, auto=True)
    if weight_blocks is None:
        return scale_blocks
    check_weight_blocks(weight_blocks, who)
    if weight_blocks == "1x32":
        return scale_blocks
    if scale_blocks not in (AUTO, "1x32", weight_blocks):
        raise ValueError(f"{who}: pass scale_blocks or weight_blocks, not both "
                         f"({scale_blocks!r} vs {weight_blocks!r})")
    return weight_blocks


def check_finite_mode(value, who: str = LAYER) -> str:
    """``check_finite`` as one of `CHECK_FINITE_MODES`; the older bools mean ``False`` ->
    ``"flag"`` (no error) and ``True`` -> ``"raise"`` (an error on non-finite input)."""
    if isinstance(value, bool):
        return "raise" if value else "flag"
    check_choice(who, "check_finite", value, CHECK_FINITE_MODES)
    return value


def check_expert_options(who: str, *, dim, hidden_dim, num_experts, precision, backend, wgrad,
                         scale_blocks, weight_blocks=None, env: bool = False) -> str:
    """The options `MXFP8MoE` and `MXFP8GroupedExperts` share. Returns the recipe (``"auto"``
    or one of `SCALE_BLOCKS`) of ``scale_blocks`` and the older ``weight_blocks``. ``env``:
    also check the machine for the backend (`check_backend_name`), for a module being built."""
    check_layer_dims(dim, hidden_dim, num_experts, who)
    check_choice(who, "precision", precision, PRECISIONS)
    check_choice(who, "wgrad", wgrad, WGRAD_MODES)
    recipe = resolve_scale_blocks(scale_blocks, weight_blocks, who)
    check_backend_name(backend, who, env=env and precision == "mxfp8")
    check_mxfp8_dims(precision, dim, hidden_dim, who, MXFP8_DIMS_WHY)
    return recipe


def warn_deprecated(name: str, use: str, stacklevel: int = 3) -> None:
    """The one `DeprecationWarning` of a deprecated layer option."""
    warnings.warn(f"{LAYER}: {name} is deprecated ({use})", DeprecationWarning,
                  stacklevel=stacklevel)


# ---------------------------------------------------------------------------------------------
# The layer's configuration
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MXFP8MoEConfig:
    """The options of an `MXFP8MoE` layer (their meaning: `MXFP8MoE`'s doc), validated on
    construction with the layer's one-line errors. Frozen and hashable; ``dataclasses.replace``
    makes a changed copy (validated again).

    ``check_finite`` is stored as ``"flag"`` or ``"raise"`` (the bools are its older spelling);
    ``aux_loss_coef`` as a float; ``ep_payload=None`` means the precision's own format
    (`resolved_ep_payload`). ``save_colwise`` is deprecated (``False`` warns; still honoured by
    expert parallelism's eager path); ``weight_blocks`` is not a field: ``scale_blocks`` holds
    its recipes.
    """

    dim: int
    hidden_dim: int
    num_experts: int
    top_k: int
    precision: str = "mxfp8"
    backend: str = "auto"
    score_func: str = "softmax"
    renormalize: bool = True
    aux_loss_coef: float = 0.01
    wgrad: str = "mxfp8"
    scale_blocks: str = AUTO
    num_shared_experts: int = 0
    ep_payload: str | None = None
    ep_grad_payload: str = "bf16"
    check_finite: str = "flag"
    cache_weights: bool = False
    save_colwise: bool = True

    # The fields that change what the parameters mean: `moe_mxfp8.checkpoint` loads a
    # checkpoint only into a layer that agrees on every one. The others (precision, backend,
    # wgrad, scale_blocks, aux_loss_coef, ...) do not: the BF16 twin loads an MXFP8 checkpoint.
    MEANING_FIELDS: ClassVar[tuple[str, ...]] = (
        "dim", "hidden_dim", "num_experts", "top_k", "num_shared_experts", "score_func",
        "renormalize",
    )

    def __post_init__(self) -> None:
        who = LAYER
        check_expert_options(who, dim=self.dim, hidden_dim=self.hidden_dim,
                             num_experts=self.num_experts, precision=self.precision,
                             backend=self.backend, wgrad=self.wgrad,
                             scale_blocks=self.scale_blocks)
        if not _is_int(self.top_k) or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"{who}: top_k must be an int in [1, num_experts="
                             f"{self.num_experts}], got {self.top_k!r}")
        check_choice(who, "score_func", self.score_func, SCORE_FUNCS)
        for name in ("renormalize", "save_colwise", "cache_weights"):
            check_flag(who, name, getattr(self, name))
        coef = self.aux_loss_coef
        if not isinstance(coef, (int, float)) or isinstance(coef, bool) or not (
                math.isfinite(coef) and coef >= 0):
            raise ValueError(f"{who}: aux_loss_coef must be a finite number >= 0, got {coef!r}")
        if not _is_int(self.num_shared_experts) or self.num_shared_experts < 0:
            raise ValueError(f"{who}: num_shared_experts must be an int >= 0, got "
                             f"{self.num_shared_experts!r}")
        if self.ep_payload is not None:
            check_choice(who, "ep_payload", self.ep_payload, EP_PAYLOADS)
        check_choice(who, "ep_grad_payload", self.ep_grad_payload, EP_PAYLOADS)
        # the stored spellings (frozen: set through object.__setattr__, once, here)
        object.__setattr__(self, "check_finite", check_finite_mode(self.check_finite, who))
        object.__setattr__(self, "aux_loss_coef", float(coef))
        if self.save_colwise is False:
            warn_deprecated("save_colwise", "omit it", stacklevel=4)

    @property
    def shared_hidden_dim(self) -> int:
        """Hidden size of the shared experts' FFN, torchtitan's ``hidden_dim * S``."""
        return self.num_shared_experts * self.hidden_dim

    @property
    def resolved_ep_payload(self) -> str:
        """``ep_payload``, or for None the precision's own format."""
        return self.precision if self.ep_payload is None else self.ep_payload

    @property
    def weight_blocks(self) -> str:
        """The older name's view of ``scale_blocks``: ``"32x32"`` or ``"1x32"``."""
        return "32x32" if self.scale_blocks == "32x32" else "1x32"

    # ---- construction from the layer's keyword arguments, and from JSON -----------------------

    @classmethod
    def from_options(cls, *, weight_blocks: str | None = None, save_colwise: bool | None = None,
                     **options: Any) -> MXFP8MoEConfig:
        """The config of `MXFP8MoE`'s keyword arguments: the deprecated ``weight_blocks`` folded
        into ``scale_blocks`` and ``save_colwise`` given or not (each warns once when given)."""
        if weight_blocks is not None:
            warn_deprecated("weight_blocks", "use scale_blocks", stacklevel=5)
            options["scale_blocks"] = resolve_scale_blocks(
                options.get("scale_blocks", AUTO), weight_blocks, LAYER)
        if save_colwise is not None:
            if save_colwise is not False:  # False: the config's own check warns
                warn_deprecated("save_colwise", "omit it", stacklevel=5)
            options["save_colwise"] = save_colwise
        return cls(**options)

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-ready (plain str, int, float, bool, None)."""
        return dataclasses.asdict(self)

    # keys of a checkpoint's layer record that are not fields (`MXFP8MoE.checkpoint_config`)
    RECORD_ONLY_KEYS: ClassVar[tuple[str, ...]] = ("expert_shard",)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MXFP8MoEConfig:
        """The config of a `to_dict` mapping, or of a layer record of `moe_mxfp8.checkpoint`
        (older records hold only `MEANING_FIELDS`: the others take their defaults; the recorded
        recipe ``{"requested", "resolved"}`` gives the requested one)."""
        if not isinstance(d, dict):
            raise TypeError(f"MXFP8MoEConfig.from_dict: expected a dict, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names - set(cls.RECORD_ONLY_KEYS))
        if unknown:
            raise ValueError(f"MXFP8MoEConfig.from_dict: unknown field(s) {unknown}")
        values = {k: v for k, v in d.items() if k in names}
        recipe = values.get("scale_blocks")
        if isinstance(recipe, dict):
            values["scale_blocks"] = recipe.get("requested", AUTO)
        return cls(**values)
