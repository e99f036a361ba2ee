"""Layer configuration: defaults, TOML presets, command-line overrides, validation.

Standard library only, so ``shapes`` and ``memory`` start without torch.
Precedence: defaults < preset file (``--config``) < options given on the command line.
"""

from __future__ import annotations

import dataclasses
import json
import math
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnctl.errors import AttnctlError
from attnctl.model.device import DEVICE_PATTERN
from attnctl.model.rope import Rope

POSITIONS = ("sinusoidal", "learned", "rope", "alibi", "none")
# T5's relative position bias: a checkpoint's bucket table biases the scores (no seeded layer)
MODEL_POSITIONS = (*POSITIONS, "relative")
MASKS = ("none", "causal")
NORMS = ("post", "pre", "none")
NORM_TYPES = ("layer", "rms")
QK_NORMS = ("none", "head", "all")
IMPLS = ("auto", "math", "sdpa")
ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")
DTYPES = ("float32", "float16", "bfloat16")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "bool": 1}
# one float32 value: what training keeps in float32 whatever the run's dtype (Adam's
# moments, statistics, gradients of float32 weights)
FP32 = DTYPE_BYTES["float32"]

_PACKAGE_DIR = Path(__file__).resolve().parent.parent  # attnctl/
# Installed wheels carry the presets inside the package; a source checkout has them at the top.
PRESET_DIRS = (_PACKAGE_DIR / "configs", _PACKAGE_DIR.parent / "configs")


@dataclass(frozen=True)
class LayerConfig:
    """One embedding + multi-head attention layer, as `attnctl` builds it."""

    tokenizer: str = "bundled"  # "bundled", "char", or a path to a tokenizer.json
    d_model: int = 512  # width of every token vector (D)
    heads: int = 8  # attention heads (H); d_k = d_model // heads unless head_dim says
    head_dim: int = 0  # d_k, the width of each head; 0 = d_model // heads (Qwen3: 128 of 1024/16)
    kv_heads: int = 0  # key/value heads (Hkv) for grouped-query attention; 0 = heads
    bias: bool = True  # bias in W_q, W_k, W_v, W_o
    output_bias: bool = True  # with bias: W_o's too (Qwen2 has biases in W_q, W_k, W_v only)
    pos: str = "sinusoidal"  # added to the embeddings (sinusoidal, learned), rotating Q and K
    # (rope), or biasing the scores (alibi)
    max_positions: int = 2048  # rows of the learned position table
    mask: str = "none"  # "causal": a query may attend only to itself and earlier keys
    # sliding window (with the causal mask): query i sees keys j with i - window < j <= i,
    # its own and the window - 1 before it (transformers' sliding_window); 0 = no window
    window: int = 0
    # which layers of a stack (memory --layers N) slide over `window`, repeated over them:
    # "s" slides, "f" sees every earlier key (Gemma 3: "sssssf", Gemma 2: "sf"); "" = all.
    # run, shapes and check show layer 0 of the pattern
    window_pattern: str = ""
    cross: bool = False  # cross-attention: keys and values from a second text, the context
    # pos "relative" (T5): distances are bucketed into relative_buckets, exactly below half
    # of them, on a log scale up to relative_distance
    relative_buckets: int = 32
    relative_distance: int = 128
    norm: str = "post"  # post: Norm(x + attn(x)); pre: x + attn(Norm(x)); none: attn(x)
    norm_type: str = "layer"  # LayerNorm, or RMSNorm (no mean, no bias)
    norm_eps: float = 1e-5  # added to the variance (LayerNorm) or mean square (RMSNorm)
    # q/k norms of norm_type: "head" normalises each head's q and k over d_k (Qwen3, Gemma 3),
    # "all" the whole projections over H·d_k and Hkv·d_k before the head split (OLMo 2)
    qk_norm: str = "none"
    rope_theta: float = 10000.0  # RoPE base: θ_i = rope_theta^(-2i/d_k)
    # RoPE for long contexts: "linear" divides every θ_i by rope_factor; "llama3" divides
    # the slow ones (wavelength > original / low_freq_factor), keeps the fast ones
    # (< original / high_freq_factor) and blends in between (Llama 3.1's rope_scaling)
    # "dynamic" raises the base past rope_original_max_positions tokens (NTK); "yarn" ramps
    # between θ_i and θ_i / factor over the pairs turning between rope_beta_slow and
    # rope_beta_fast times in the original length; "longrope" divides θ_i by one factor
    # per pair (short, or long past the original length). yarn and longrope multiply cos and
    # sin by rope_attention_factor (0: their own formula; yarn's from rope_mscale and
    # rope_mscale_all_dim when both are set). As transformers computes them (attnctl/model/rope.py)
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 0.0  # 0 = unset
    rope_mscale_all_dim: float = 0.0
    rope_truncate: bool = True  # yarn: floor and ceil the ramp's ends
    rope_attention_factor: float = 0.0
    rope_short_factor: tuple[float, ...] = ()  # longrope: one per pair, d_k/2 of them
    rope_long_factor: tuple[float, ...] = ()
    # what Q·Kᵀ is multiplied by; 0 = 1/√d_k (Gemma 2: query_pre_attn_scalar^-0.5)
    query_scale: float = 0.0
    # soft-capping: scores = softcap·tanh(scores/softcap) before masks and biases; 0 = off
    # (Gemma 2's attn_logit_softcapping). Not additive: SDPA cannot, the math path does
    softcap: float = 0.0
    impl: str = "auto"  # "math" builds (B, H, L, L) weights; "sdpa" the fused kernel; see below
    dropout: float = 0.0  # on the attention weights, in training only (math path)
    seed: int = 42  # torch.manual_seed before the weights are created
    device: str = "auto"  # auto = cuda, else mps, else cpu
    dtype: str = "float32"
    # a CUDA plan for a named GPU (model/gpu.py's profiles: h200, h100, ...) rather than
    # this machine's, under the memory rules of torch ``torch_rules`` ("2.11"; "" = the
    # installed torch's)
    gpu: str = ""
    torch_rules: str = ""

    @property
    def d_k(self) -> int:
        return self.head_dim or self.d_model // self.heads

    @property
    def q_width(self) -> int:
        """H·d_k: what W_q projects D to and W_o maps back (D unless head_dim says else)."""
        return self.heads * self.d_k

    @property
    def rope(self) -> Rope:
        """The RoPE of this layer as ``attnctl.model.rope`` computes it."""
        return Rope(
            theta=self.rope_theta,
            rope_type=self.rope_type,
            factor=self.rope_factor,
            max_positions=self.rope_original_max_positions,  # dynamic's trained length
            original_max_positions=self.rope_original_max_positions,
            low_freq_factor=self.rope_low_freq_factor,
            high_freq_factor=self.rope_high_freq_factor,
            beta_fast=self.rope_beta_fast,
            beta_slow=self.rope_beta_slow,
            mscale=self.rope_mscale or None,
            mscale_all_dim=self.rope_mscale_all_dim or None,
            attention_factor=self.rope_attention_factor or None,
            truncate=self.rope_truncate,
            short_factor=self.rope_short_factor,
            long_factor=self.rope_long_factor,
        )

    @property
    def groups(self) -> int:
        """Query heads per key/value head (1 = ordinary multi-head attention)."""
        return self.heads // self.kv_heads

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values: the longrope factor tuples as lists."""
        return {
            key: list(value) if isinstance(value, tuple) else value
            for key, value in dataclasses.asdict(self).items()
        }


_CHOICES: dict[str, tuple[str, ...]] = {
    "pos": MODEL_POSITIONS,
    "mask": MASKS,
    "norm": NORMS,
    "norm_type": NORM_TYPES,
    "qk_norm": QK_NORMS,
    "impl": IMPLS,
    "dtype": DTYPES,
    "rope_type": ROPE_TYPES,
}
_FIELD_TYPES: dict[str, type] = {f.name: type(f.default) for f in dataclasses.fields(LayerConfig)}


def resolve_impl(config: LayerConfig, shows_every_weight: bool = True) -> LayerConfig:
    """``auto`` becomes ``math`` when every weight is shown (short inputs), else ``sdpa``.

    With sdpa, ``run`` computes weights only for the heads and rows it shows, so a long
    input never builds the (B, H, L, L) matrices. ``shapes`` and ``memory`` describe the
    textbook path for auto, as if every weight were shown.
    """
    if config.impl != "auto":
        return config
    # dropout is modelled on math only; alibi's bias would make SDPA build the weights anyway
    # soft-capping is the math path's alone
    math = (
        shows_every_weight
        or config.dropout > 0
        or config.pos in ("alibi", "relative")
        or config.softcap > 0
    )
    return dataclasses.replace(config, impl="math" if math else "sdpa")


LARGEST_SIZE = 2**63  # a tensor dimension is an int64: nothing this large or larger exists
SUGGESTED_UP_TO = 4096  # head counts suggested in an error: the divisors up to this


def divisors(n: int, up_to: int | None = None) -> list[int]:
    """The divisors of n (only those <= ``up_to``: the loop never runs past it)."""
    return [d for d in range(1, min(n, up_to or n) + 1) if n % d == 0]


def _counts_that_work(n: int, what: str) -> str:
    """'head counts that work: 1, 2, 4' (bounded, so a huge or prime n answers at once)."""
    listed = ", ".join(map(str, divisors(n, SUGGESTED_UP_TO)))
    bound = f" up to {SUGGESTED_UP_TO}" if n > SUGGESTED_UP_TO else ""
    return f"{what}{bound} that work: {listed}"


def validate(config: LayerConfig) -> LayerConfig:
    """Reject values no layer can be built from; returns the config (kv_heads 0 made H)."""
    config = _checked_sizes(config)
    _check_values(config)
    _check_positions(config)
    return config


def _checked_sizes(config: LayerConfig) -> LayerConfig:
    """d_model, heads, head_dim and kv_heads: positive, below torch's largest size, and
    dividing as attention needs."""
    if config.d_model <= 0:
        raise AttnctlError(f"d_model must be a positive integer, got {config.d_model}")
    if config.heads <= 0:
        raise AttnctlError(f"heads must be a positive integer, got {config.heads}")
    if config.d_model >= LARGEST_SIZE:
        raise AttnctlError(
            f"d_model must be below 2^63 (torch's largest size), got {config.d_model}"
        )
    if config.head_dim < 0 or config.head_dim >= LARGEST_SIZE:
        raise AttnctlError(
            f"head_dim must be 0 (= d_model/heads) or a positive integer below 2^63, "
            f"got {config.head_dim}"
        )
    if config.head_dim and config.heads * config.head_dim >= LARGEST_SIZE:
        raise AttnctlError(
            f"heads·head_dim must be below 2^63 (torch's largest size), got "
            f"{config.heads}·{config.head_dim}"
        )
    if not config.head_dim and config.d_model % config.heads:
        raise AttnctlError(
            f"heads={config.heads} does not divide d_model={config.d_model}; "
            + _counts_that_work(config.d_model, "head counts")
        )
    if config.kv_heads == 0:
        config = dataclasses.replace(config, kv_heads=config.heads)
    if config.kv_heads < 0 or config.heads % config.kv_heads:
        raise AttnctlError(
            f"kv-heads={config.kv_heads} does not divide heads={config.heads}; "
            + _counts_that_work(config.heads, "kv-head counts")
            + " (1 = multi-query)"
        )
    return config


def _check_values(config: LayerConfig) -> None:
    """Finite numbers, known choices, and the options that exclude one another."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise AttnctlError(f"{field.name} must be a finite number, got {value}")
    for key, allowed in _CHOICES.items():
        value = getattr(config, key)
        if value not in allowed:
            raise AttnctlError(f"{key} must be one of {', '.join(allowed)}; got {value!r}")
    if not DEVICE_PATTERN.match(config.device):
        raise AttnctlError(f"unknown device {config.device!r}; use auto, cpu, cuda, cuda:N or mps")
    if not 0.0 <= config.dropout < 1.0:
        raise AttnctlError(f"dropout must be at least 0 and below 1, got {config.dropout}")
    if config.pos == "relative" and config.impl == "sdpa":
        raise AttnctlError(
            "T5's relative position bias is added to the scores: it needs --impl math"
        )
    if config.cross and config.mask == "causal":
        raise AttnctlError(
            "cross-attention has no causal mask: every query may see the whole context"
        )
    if config.cross and config.pos in ("rope", "alibi"):
        raise AttnctlError(
            f"--pos {config.pos} relates positions within one sequence; with a context use "
            "sinusoidal, learned or none"
        )
    if config.pos == "alibi" and config.impl == "sdpa":
        raise AttnctlError(
            "alibi adds a (H, L, L) bias that CPU SDPA handles by building the weights "
            "out of sight; use --impl math (auto picks it)"
        )
    if not 0 <= config.window < LARGEST_SIZE:
        raise AttnctlError(
            f"window must be 0 (none) or a positive integer below 2^63, got {config.window}"
        )
    if config.window_pattern:
        if len(config.window_pattern) > 4096 or set(config.window_pattern) - {"s", "f"}:
            raise AttnctlError(
                "window_pattern must be up to 4096 letters s (a layer slides) and f (a full "
                f"layer), e.g. sssssf, got {config.window_pattern[:40]!r}"
            )
        if not config.window:
            raise AttnctlError("window_pattern says which layers slide: give --window W too")
    if config.window and config.mask != "causal":
        raise AttnctlError(
            f"a sliding window (window={config.window}) slides over earlier keys: "
            "it needs --mask causal"
        )
    if config.softcap < 0:
        raise AttnctlError(f"softcap must be positive (0 = off), got {config.softcap}")
    if config.softcap and config.impl == "sdpa":
        raise AttnctlError(
            "softcap (cap·tanh(scores/cap)) is no additive mask: "
            "F.scaled_dot_product_attention cannot apply it; use --impl math (auto picks it)"
        )
    if config.dropout and config.impl == "sdpa":
        raise AttnctlError("dropout is modelled on the math path only; use --impl math")


def _check_positions(config: LayerConfig) -> None:
    """RoPE and its scaling, positions, the tokenizer and the seed."""
    if config.pos == "rope" and config.d_k % 2:
        raise AttnctlError(f"rope rotates pairs of dims: d_k={config.d_k} must be even")
    if config.query_scale < 0:
        raise AttnctlError(f"query_scale must be positive (0 = 1/√d_k), got {config.query_scale}")
    if not config.norm_eps > 0:
        raise AttnctlError(f"norm_eps must be positive, got {config.norm_eps}")
    if not config.rope_theta > 1:
        raise AttnctlError(f"rope_theta must be above 1, got {config.rope_theta}")
    if not config.rope_factor > 0:
        raise AttnctlError(
            f"rope_factor (--rope-factor) must be positive, got {config.rope_factor}"
        )
    if config.rope_original_max_positions <= 0:
        raise AttnctlError(
            "rope_original_max_positions (--rope-length) must be a positive integer, got "
            f"{config.rope_original_max_positions}"
        )
    if config.pos != "rope" and config.rope_type != "default":
        raise AttnctlError(
            f"rope_type {config.rope_type} scales RoPE, and pos is {config.pos}: add --pos rope"
        )
    if config.rope_type == "default" and config.rope_factor != 1.0:
        raise AttnctlError(
            f"rope_factor {config.rope_factor:g} scales nothing without a rope_type "
            "(--rope-type linear, llama3, dynamic, yarn or longrope)"
        )
    if not 0 < config.rope_low_freq_factor < config.rope_high_freq_factor:
        raise AttnctlError("rope scaling needs 0 < rope_low_freq_factor < rope_high_freq_factor")
    _validate_rope_scaling(config)
    if config.max_positions <= 0:
        raise AttnctlError(f"max_positions must be positive, got {config.max_positions}")
    if not config.tokenizer:
        raise AttnctlError("tokenizer must be 'bundled', 'char' or a path to a tokenizer.json")
    if not -(2**63) <= config.seed < 2**64:
        raise AttnctlError(f"seed must fit in 64 bits, got {config.seed}")


def _validate_rope_scaling(config: LayerConfig) -> None:
    """yarn's, longrope's and dynamic's keys in range; longrope's factors one per pair."""
    for key in ("rope_beta_fast", "rope_beta_slow"):
        if not getattr(config, key) > 0:
            raise AttnctlError(f"{key} must be positive, got {getattr(config, key)}")
    for key in ("rope_mscale", "rope_mscale_all_dim", "rope_attention_factor"):
        if getattr(config, key) < 0:
            raise AttnctlError(f"{key} must be positive (0 = unset), got {getattr(config, key)}")
    longrope = config.rope_type == "longrope"
    for key in ("rope_short_factor", "rope_long_factor"):
        factors = getattr(config, key)
        if factors and not longrope:
            raise AttnctlError(f"{key} is read by rope_type longrope only, not {config.rope_type}")
        if not all(math.isfinite(f) and f > 0 for f in factors):
            raise AttnctlError(f"{key} must hold positive finite numbers")
        if longrope and config.pos == "rope" and len(factors) != config.d_k // 2:
            raise AttnctlError(
                f"{key} must hold one factor per rotated pair: d_k/2 = {config.d_k // 2}, "
                f"got {len(factors)}"
            )
    if longrope and config.rope_original_max_positions < 2:  # ln(L₀) divides
        raise AttnctlError("rope_original_max_positions must be at least 2 for longrope")
    if config.rope_type == "dynamic" and config.pos == "rope" and config.d_k == 2:
        raise AttnctlError("rope_type dynamic needs d_k >= 4 (its base has the power r/(r-2))")


def _check_value(key: str, value: Any, source: str) -> Any:
    if key not in _FIELD_TYPES:
        known = ", ".join(_FIELD_TYPES)
        raise AttnctlError(f"{source}: unknown key {key!r} (known keys: {known})")
    expected = _FIELD_TYPES[key]
    if expected is float and type(value) is int:  # dropout = 0 in TOML is fine
        value = float(value)
    if expected is tuple:  # a list of numbers (longrope's factors)
        numbers = isinstance(value, list | tuple) and all(type(n) in (int, float) for n in value)
        if not numbers:
            raise AttnctlError(f"{source}: {key} must be a list of numbers")
        value = tuple(float(n) for n in value)
    # bool is a subclass of int in Python; a TOML `true` is no head count.
    if type(value) is not expected:
        raise AttnctlError(
            f"{source}: {key} must be {expected.__name__}, got {type(value).__name__} {value!r}"
        )
    if key == "kv_heads" and value < 1:  # 0 is only the unset default, meaning "= heads"
        raise AttnctlError(f"{source}: kv_heads must be at least 1, got {value} (1 = multi-query)")
    return value


def regular_file(path: Path, what: str, shown: str | None = None) -> Path:
    """``path`` if it is a regular file; else one line saying what it is instead.

    A pipe or a device is refused before it is opened: opening a FIFO without a writer
    blocks, and /dev/zero never ends. ``shown``: the path as the user wrote it.
    """
    shown = shown or str(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise AttnctlError(f"{what} not found: {shown}") from None
    except OSError as error:
        raise AttnctlError(f"cannot read {what} {shown}: {error.strerror or error}") from None
    if stat.S_ISDIR(mode):
        raise AttnctlError(f"cannot read {what} {shown}: it is a folder, not a file")
    if not stat.S_ISREG(mode):
        raise AttnctlError(f"cannot read {what} {shown}: not a regular file (a pipe or device)")
    return path


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """A JSON file holding an object (a tokenizer, a model's config); errors name ``what``."""
    regular_file(path, what)
    try:
        text = path.read_bytes()
    except IsADirectoryError:
        raise AttnctlError(f"cannot read {what} {path}: it is a folder, not a file") from None
    except OSError as error:  # permission denied, a vanished file, an I/O error
        raise AttnctlError(f"cannot read {what} {path}: {error.strerror or error}") from None
    try:
        data = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        reason = "nested too deeply" if isinstance(error, RecursionError) else error
        raise AttnctlError(f"malformed {what} {path}: {reason}") from None
    if not isinstance(data, dict):
        raise AttnctlError(f"malformed {what} {path}: expected a JSON object")
    return data


def preset_names() -> list[str]:
    names = {p.stem for d in PRESET_DIRS if d.is_dir() for p in d.glob("*.toml")}
    return sorted(names)


def resolve_preset(name_or_path: str) -> Path:
    """A preset name (``cat-eats-fish``) or a path to a TOML file."""
    path = Path(name_or_path).expanduser()
    if not name_or_path.strip():
        raise AttnctlError(f"--config needs a preset name or a TOML path, got {name_or_path!r}")
    if path.suffix == ".toml" or path.parent != Path(".") or path.exists():
        return regular_file(path, "config file", name_or_path)
    for directory in PRESET_DIRS:
        candidate = directory / f"{name_or_path}.toml"
        if candidate.is_file():
            return candidate
    raise AttnctlError(
        f"unknown preset {name_or_path!r}; presets: {', '.join(preset_names()) or 'none found'}"
    )


def load_preset(name_or_path: str) -> dict[str, Any]:
    """Read and type-check a preset; returns only the keys it sets."""
    import tomllib  # only a preset read needs it

    path = resolve_preset(name_or_path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        raise AttnctlError(f"cannot read config {path}: {error}") from error
    except tomllib.TOMLDecodeError as error:
        raise AttnctlError(f"malformed config {path}: {error}") from error
    return {key: _check_value(key, value, str(path)) for key, value in data.items()}


def build_config(preset: str | None = None, **overrides: Any) -> LayerConfig:
    """Defaults, then the preset, then every override that is not None; validated."""
    values: dict[str, Any] = load_preset(preset) if preset is not None else {}
    values.update({k: _check_value(k, v, "option") for k, v in overrides.items() if v is not None})
    return validate(LayerConfig(**values))
