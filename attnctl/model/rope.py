"""RoPE as transformers 5.24 reads it from config.json and computes it, without torch.

A :class:`Rope` holds everything that fixes the rotation of one layer kind. ``rope_from_config``
reads it the way the family's transformers config class does (``convention``: "standard" for
Llama, Mistral, Qwen2, Qwen3, Gemma 2 and OLMo 2; "phi3"; "gemma3" with one RoPE per layer
type), checks every value by type and range, and refuses by name what transformers would not
honour. ``inverse_frequencies`` gives the frequency f_i of each rotated pair (i, i + r/2),
r = int(head_dim · partial_rotary_factor): a token at position p turns pair i by p·f_i, and
cos and sin are multiplied by ``attention_scaling``. The math is float64 here; transformers
computes its tables in float32 (agreement ≈ 1e-7 relative).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from attnctl.errors import AttnctlError

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
Convention = Literal["standard", "phi3", "gemma3"]
LAYER_TYPES = ("full_attention", "sliding_attention")  # Gemma 3's per-layer-type RoPE
GEMMA3_DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
GEMMA3_THETA_KEY = {"full_attention": "rope_theta", "sliding_attention": "rope_local_base_freq"}
PHI3_ORIGINAL_MAX_POSITIONS = 4096  # Phi3Config's default original_max_position_embeddings
DEFAULT_THETA = 10_000.0


@dataclass(frozen=True)
class Rope:
    """The parameters transformers reads for one RoPE (unused ones keep their defaults).

    ``factor`` is resolved: yarn's null factor and longrope's missing one are
    max_position_embeddings / original_max_position_embeddings, as transformers computes them.
    ``mscale``, ``mscale_all_dim`` and ``attention_factor`` are None where unset.
    """

    theta: float = DEFAULT_THETA
    rope_type: str = "default"
    factor: float = 1.0  # linear, dynamic, llama3, yarn, longrope
    partial_rotary_factor: float = 1.0
    max_positions: int = 0  # max_position_embeddings: dynamic's original length
    original_max_positions: int = 0  # llama3, yarn, longrope
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    attention_factor: float | None = None  # yarn, longrope
    truncate: bool = True  # yarn
    short_factor: tuple[float, ...] = ()  # longrope, one per rotated pair
    long_factor: tuple[float, ...] = ()  # longrope


def rotary_dim(rope: Rope, head_dim: int) -> int:
    """r = int(head_dim · partial_rotary_factor): the leading dims of a head that turn."""
    return int(head_dim * rope.partial_rotary_factor)


def _default_frequencies(theta: float, dim: int) -> list[float]:
    """f_i = θ^(-2i/r) for i < r/2."""
    return [1.0 / theta ** (2 * i / dim) for i in range(dim // 2)]


def inverse_frequencies(rope: Rope, head_dim: int, seq_len: int) -> list[float]:
    """The r/2 frequencies f_i of one forward pass over positions 0 … seq_len - 1.

    seq_len is transformers' max(position_ids) + 1. default: θ^(-2i/r); linear: that / factor;
    llama3: wavelength λ = 2π/f kept below L₀/high, divided by factor above L₀/low, blended
    between; yarn: a ramp between f and f/factor over the pairs that turn fewer than beta_fast
    and more than beta_slow times in L₀; dynamic: when seq_len > max_position_embeddings M,
    the base is θ·(factor·seq_len/M − (factor − 1))^(r/(r−2)); longrope: f_i/ext_i, ext =
    long_factor when seq_len > L₀ else short_factor. (L₀ = original_max_position_embeddings.)
    This is a fresh rotary module's one forward pass: transformers' dynamic module keeps a
    grown table for later, shorter calls until one is shorter than M.
    """
    dim = rotary_dim(rope, head_dim)
    kind = rope.rope_type
    if kind == "default":
        return _default_frequencies(rope.theta, dim)
    if kind == "linear":
        return [f / rope.factor for f in _default_frequencies(rope.theta, dim)]
    if kind == "dynamic":
        base = rope.theta
        if seq_len > rope.max_positions:  # below it transformers keeps the unscaled table
            stretch = rope.factor * seq_len / rope.max_positions - (rope.factor - 1)
            base = rope.theta * stretch ** (dim / (dim - 2))
        return _default_frequencies(base, dim)
    if kind == "longrope":
        long = seq_len > rope.original_max_positions
        ext = rope.long_factor if long else rope.short_factor
        return [f / e for f, e in zip(_default_frequencies(rope.theta, dim), ext, strict=True)]
    if kind == "llama3":
        return [_llama3(f, rope) for f in _default_frequencies(rope.theta, dim)]
    if kind == "yarn":
        return _yarn(rope, dim)
    raise AssertionError(kind)  # rope_from_config admits no other type


def _llama3(frequency: float, rope: Rope) -> float:
    """Llama 3.1: λ < L₀/high kept, λ > L₀/low divided by factor, blended in between."""
    original, low, high = rope.original_max_positions, rope.low_freq_factor, rope.high_freq_factor
    wavelength = 2 * math.pi / frequency
    if wavelength < original / high:
        return frequency
    if wavelength > original / low:
        return frequency / rope.factor
    smooth = (original / wavelength - low) / (high - low)
    return (1 - smooth) * frequency / rope.factor + smooth * frequency


def _yarn(rope: Rope, dim: int) -> list[float]:
    """YaRN: f_i·(1 − e_i) / factor + f_i·e_i, e_i = 1 − clamp((i − lo)/(hi − lo), 0, 1).

    lo and hi are the pair indices d(n) = r·ln(L₀/(2πn)) / (2 ln θ) for n = beta_fast and
    beta_slow (floor and ceil when truncate), clamped to [0, r − 1].
    """

    def correction(rotations: float) -> float:
        return (dim * math.log(rope.original_max_positions / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta)
        )

    low, high = correction(rope.beta_fast), correction(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    frequencies = []
    for i, frequency in enumerate(_default_frequencies(rope.theta, dim)):
        extrapolation = 1 - min(max((i - low) / (high - low), 0.0), 1.0)
        interpolated = frequency / rope.factor
        frequencies.append(interpolated * (1 - extrapolation) + frequency * extrapolation)
    return frequencies


def _mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's 0.1·m·ln(s) + 1 (1 when s ≤ 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_scaling(rope: Rope) -> float:
    """The factor on cos and sin; in transformers 5.24 it never depends on the length.

    yarn: attention_factor, else mscale(factor, mscale)/mscale(factor, mscale_all_dim) when
    both are set (non-zero), else 0.1·ln(factor) + 1; longrope: attention_factor, else
    √(1 + ln(factor)/ln(L₀)) (1 when factor ≤ 1); every other type: 1.
    """
    if rope.rope_type == "yarn":
        if rope.attention_factor is not None:
            return rope.attention_factor
        if rope.mscale and rope.mscale_all_dim:
            return _mscale(rope.factor, rope.mscale) / _mscale(rope.factor, rope.mscale_all_dim)
        return _mscale(rope.factor)
    if rope.rope_type == "longrope":
        if rope.attention_factor is not None:
            return rope.attention_factor
        if rope.factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(rope.factor) / math.log(rope.original_max_positions))
    return 1.0


def describe(rope: Rope) -> str:
    """One short line, e.g. "RoPE θ=1e+06, yarn ×4 from 32768"."""
    text = f"RoPE θ={rope.theta:g}"
    kind = rope.rope_type
    if kind in ("linear", "dynamic", "llama3", "yarn", "longrope"):
        text += f", {kind} ×{rope.factor:g}"
    if kind == "dynamic":
        text += f" beyond {rope.max_positions}"
    elif kind in ("llama3", "yarn", "longrope"):
        text += f" from {rope.original_max_positions}"
    if rope.partial_rotary_factor != 1.0:
        text += f", {rope.partial_rotary_factor:.0%} of each head"
    return text


# ---------------------------------------------------------------- reading config.json


def _brief(value: Any, limit: int = 60) -> str:
    """A value from a file as it reads there, cut short: an error line stays one line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


class _Source:
    """The merged RoPE keys with the name each came from, checked as they are read."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.values: dict[str, tuple[str, Any]] = {}  # key -> (where it came from, value)
        # a top-level original_max_position_embeddings that overrides the dict's
        self.original: tuple[str, Any] | None = None

    def error(self, label: str, text: str) -> AttnctlError:
        return AttnctlError(f"{self.file}: {label} {text}")

    def has(self, key: str) -> bool:
        return key in self.values

    def label(self, key: str) -> str:
        return self.values[key][0]

    def number(self, key: str, *, minimum: float = 0.0, closed: bool = False) -> float:
        """A finite int or float above ``minimum`` (or at least it, when ``closed``)."""
        label, value = self.values[key]
        number = type(value) in (int, float) and math.isfinite(value)
        if not number or not (value >= minimum if closed else value > minimum):
            bound = "at least" if closed else "above"
            raise self.error(
                label, f"must be a finite number {bound} {minimum:g}, got {_brief(value)}"
            )
        return float(value)

    def optional(self, key: str, **bounds: Any) -> float | None:
        return None if self.values.get(key, ("", None))[1] is None else self.number(key, **bounds)

    def integer(self, key: str) -> int:
        label, value = self.values[key]
        if type(value) is not int or value < 1:  # bool is an int in Python: not here
            raise self.error(label, f"must be an integer >= 1, got {_brief(value)}")
        return value

    def factors(self, key: str, count: int) -> tuple[float, ...]:
        label, value = self.values[key]
        good = isinstance(value, list) and all(
            type(x) in (int, float) and math.isfinite(x) and x > 0 for x in value
        )
        if not good:
            raise self.error(
                label, f"must be a list of finite numbers above 0, got {_brief(value)}"
            )
        if len(value) != count:
            raise self.error(label, f"has {len(value)} numbers; this head turns {count} pairs")
        return tuple(float(x) for x in value)


def _object(config: Mapping[str, Any], source: _Source, key: str) -> dict[str, Any] | None:
    value = config.get(key)
    if value is not None and not isinstance(value, dict):
        raise source.error(key, f"must be an object, got {_brief(value)}")
    return value


def rope_from_config(
    config: Mapping[str, Any],
    file: str,
    *,
    head_dim: int,
    max_positions: int,
    convention: Convention = "standard",
    layer_type: str | None = None,
) -> Rope:
    """The RoPE of one layer kind as transformers' config class and rotary embedding read it.

    ``file`` starts each error line; ``max_positions`` is the model's (already checked)
    max_position_embeddings; ``layer_type`` ("full_attention" or "sliding_attention") is
    required with the "gemma3" convention and refused otherwise.
    """
    if head_dim < 1 or max_positions < 1:
        raise ValueError("head_dim and max_positions are checked integers >= 1")
    source = _Source(file)
    if convention == "gemma3":
        if layer_type not in LAYER_TYPES:
            raise ValueError(f"Gemma 3's RoPE needs a layer_type in {LAYER_TYPES}")
        _gemma3_keys(config, source, layer_type)
    else:
        if layer_type is not None:
            raise ValueError(f"the {convention} convention has one RoPE for every layer")
        _flat_keys(config, source, convention)
    return _rope(source, head_dim, max_positions, convention)


def _flat_keys(config: Mapping[str, Any], source: _Source, convention: Convention) -> None:
    """One dict: rope_scaling whole when it is non-empty, else rope_parameters; the dict's own
    rope_theta and partial_rotary_factor win over the top-level ones."""
    scaling, parameters = (
        _object(config, source, "rope_scaling"),
        _object(config, source, "rope_parameters"),
    )
    prefix = "rope_scaling" if scaling else "rope_parameters"
    rope = scaling or parameters or {}
    for key, value in rope.items():
        source.values[key] = (f"{prefix}.{key}", value)
        if isinstance(value, dict):
            raise source.error(f"{prefix}.{key}", "is a per-layer RoPE; this family reads one")
    # rope_theta: a top-level null is read (and refused); partial_rotary_factor: Phi3Config
    # reads a null too, the others skip it
    if not source.has("rope_theta") and "rope_theta" in config:
        source.values["rope_theta"] = ("rope_theta", config["rope_theta"])
    partial = "partial_rotary_factor"
    if (
        not source.has(partial)
        and partial in config
        and (config[partial] is not None or convention == "phi3")
    ):
        source.values[partial] = (partial, config[partial])
    original = "original_max_position_embeddings"
    if convention == "phi3":  # Phi3Config's own field wins over the dict's, 4096 by default
        source.original = (original, config.get(original, PHI3_ORIGINAL_MAX_POSITIONS))
    elif original in config:  # set as an attribute, it wins when the RoPE is computed
        source.original = (original, config[original])


def _gemma3_keys(config: Mapping[str, Any], source: _Source, layer_type: str) -> None:
    """Gemma 3: rope_parameters[layer_type], rope_scaling merged into full_attention's, the
    base from rope_theta (full, 1e6) or rope_local_base_freq (sliding, 1e4) when unset."""
    parameters, scaling = (
        _object(config, source, "rope_parameters"),
        _object(config, source, "rope_scaling"),
    )
    if parameters is not None:
        for key, value in parameters.items():
            if key not in LAYER_TYPES:
                raise source.error(
                    f"rope_parameters.{key}",
                    "is unread: transformers' Gemma 3 reads rope_parameters.full_attention and "
                    "rope_parameters.sliding_attention only",
                )
            if value is not None and not isinstance(value, dict):
                raise source.error(
                    f"rope_parameters.{key}", f"must be an object, got {_brief(value)}"
                )
        if scaling is not None and parameters.get("full_attention") is None:
            raise source.error("rope_scaling", "needs rope_parameters.full_attention beside it")
    rope = (parameters or {}).get(layer_type) or {"rope_type": "default"}  # transformers' fill-in
    for key, value in rope.items():
        source.values[key] = (f"rope_parameters.{layer_type}.{key}", value)
    if layer_type == "full_attention" and scaling is not None:
        for key, value in scaling.items():
            source.values[key] = (f"rope_scaling.{key}", value)
    theta_key = GEMMA3_THETA_KEY[layer_type]
    if not source.has("rope_theta"):
        source.values["rope_theta"] = (
            theta_key,
            config.get(theta_key, GEMMA3_DEFAULT_THETA[layer_type]),
        )
    if config.get("partial_rotary_factor") is not None and not source.has("partial_rotary_factor"):
        source.values["partial_rotary_factor"] = (
            "partial_rotary_factor",
            config["partial_rotary_factor"],
        )
    if source.has("truncate") and source.values["truncate"][1] is not True:
        raise source.error(
            source.label("truncate"), "is unread in a per-layer-type RoPE: transformers truncates"
        )


def _rope(source: _Source, head_dim: int, max_positions: int, convention: Convention) -> Rope:
    """Check the merged keys for their rope_type and build the Rope."""
    kind_label, kind = _rope_kind(source, convention)
    if not source.has("rope_theta"):
        source.values["rope_theta"] = ("rope_theta", DEFAULT_THETA)
    values: dict[str, Any] = {"theta": source.number("rope_theta", minimum=1.0), "rope_type": kind}
    dim = _rotated_dims(source, head_dim, kind, convention, values)
    if kind == "default":
        return Rope(**values)
    if kind in ("llama3", "yarn", "longrope"):
        implicit = _original_positions(source, kind, max_positions, values)
    if kind in ("linear", "dynamic", "llama3", "yarn"):
        _required(source, kind_label, kind, "factor")
    if kind == "yarn" and source.values["factor"][1] is None:
        values["factor"] = implicit  # transformers: max_position_embeddings / L₀
    elif kind == "longrope" and source.values.get("factor", ("", None))[1] is None:
        values["factor"] = implicit
    else:
        values["factor"] = source.number("factor")
    _type_values(source, kind_label, kind, dim, max_positions, values)
    return Rope(**values)


def _rope_kind(source: _Source, convention: Convention) -> tuple[str, str]:
    """The RoPE type the keys name (rope_type, or the older type; Phi-3's old names of
    longrope renamed), checked against the family's. Returns (its key's label, it)."""
    if source.has("rope_type"):
        kind_label, kind = source.values["rope_type"]
        if source.has("type") and source.values["type"][1] != kind:
            raise source.error(
                source.label("type"),
                f"is {source.values['type'][1]!r} but rope_type is {kind!r}, which wins",
            )
    elif source.has("type"):
        kind_label, kind = source.values["type"]
    else:
        kind_label, kind = "rope_type", "default"
    if convention == "phi3" and kind in ("su", "yarn"):  # Phi3Config's old names of longrope
        if kind == "su" and not source.has("original_max_position_embeddings"):
            raise source.error(
                kind_label,
                "is 'su' without original_max_position_embeddings beside it, "
                "which transformers' Phi-3 refuses",
            )
        kind = "longrope"
    allowed = ("default", "longrope") if convention == "phi3" else ROPE_TYPES
    if kind not in allowed:
        raise source.error(
            kind_label, f"is {_brief(kind)}; this family supports RoPE types " + ", ".join(allowed)
        )
    return kind_label, kind


def _rotated_dims(
    source: _Source, head_dim: int, kind: str, convention: Convention, values: dict[str, Any]
) -> int:
    """The dims of a head RoPE turns (``partial_rotary_factor``, into ``values``, where the
    family reads it), checked: an even number of at least 2."""
    partial = convention == "phi3" or kind != "default"  # the default RoPE reads it in Phi-3 only
    if partial and source.has("partial_rotary_factor"):
        fraction = source.number("partial_rotary_factor")
        if fraction > 1:
            raise source.error(
                source.label("partial_rotary_factor"), f"must be at most 1, got {fraction:g}"
            )
        if fraction != 1 and convention != "phi3":
            raise source.error(
                source.label("partial_rotary_factor"),
                f"is {fraction:g}: this family's attention turns every dim of a head",
            )
        values["partial_rotary_factor"] = fraction
    dim = int(head_dim * values.get("partial_rotary_factor", 1.0))
    if dim < 2 or dim % 2:
        raise source.error(
            source.label("partial_rotary_factor")
            if source.has("partial_rotary_factor")
            else "head_dim",
            f"gives {dim} rotated dims of a head of {head_dim}; RoPE turns an even number >= 2",
        )
    return dim


def _required(source: _Source, kind_label: str, kind: str, key: str) -> None:
    """Refuse a RoPE type without a key it needs."""
    if not source.has(key):
        raise source.error(kind_label, f"{kind!r} needs {key}")


def _original_positions(
    source: _Source, kind: str, max_positions: int, values: dict[str, Any]
) -> float:
    """The length the scaling starts from (into ``values``): the rope's own, else
    max_position_embeddings. Returns the factor it implies, max_positions / it."""
    original = "original_max_position_embeddings"
    if source.original is not None:
        source.values[original] = source.original
    elif not source.has(original):
        source.values[original] = ("max_position_embeddings", max_positions)
    values["original_max_positions"] = source.integer(original)
    if kind == "longrope" and values["original_max_positions"] < 2:  # ln(L₀) divides
        raise source.error(source.label(original), "must be at least 2 for longrope, got 1")
    return max_positions / values["original_max_positions"]


def _type_values(
    source: _Source,
    kind_label: str,
    kind: str,
    dim: int,
    max_positions: int,
    values: dict[str, Any],
) -> None:
    """The keys of each scaled RoPE type besides its factor, checked, into ``values``."""
    if kind == "dynamic":
        if dim == 2:
            raise source.error(kind_label, "'dynamic' needs at least 4 rotated dims (r/(r-2))")
        values["max_positions"] = max_positions
    elif kind == "llama3":
        _required(source, kind_label, kind, "low_freq_factor")
        _required(source, kind_label, kind, "high_freq_factor")
        values["low_freq_factor"] = source.number("low_freq_factor")
        values["high_freq_factor"] = source.number("high_freq_factor")
        if not values["low_freq_factor"] < values["high_freq_factor"]:
            raise source.error(source.label("high_freq_factor"), "must be above low_freq_factor")
    elif kind == "yarn":
        for key, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):  # null or 0: the default
            given = source.optional(key, closed=True)
            values[key] = given or default
        values["mscale"] = source.optional("mscale", closed=True)
        values["mscale_all_dim"] = source.optional("mscale_all_dim", closed=True)
        if source.has("truncate"):
            label, truncate = source.values["truncate"]
            if type(truncate) is not bool:
                raise source.error(label, f"must be true or false, got {_brief(truncate)}")
            values["truncate"] = truncate
    if kind in ("yarn", "longrope"):
        values["attention_factor"] = source.optional("attention_factor")
    if kind == "longrope":
        _required(source, kind_label, kind, "short_factor")
        _required(source, kind_label, kind, "long_factor")
        values["short_factor"] = source.factors("short_factor", dim // 2)
        values["long_factor"] = source.factors("long_factor", dim // 2)
