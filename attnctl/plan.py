"""The stages of one attention layer as data: names, named dims, shapes, dtypes, bytes.

No torch here: ``attnctl shapes`` renders a plan and ``attnctl memory`` sums one.
The torch layer (``layer.py``) records the same stages while it runs, and the tests
hold the two equal, so what ``shapes`` predicts is what ``run`` does.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from attnctl.config import DTYPE_BYTES, LARGEST_SIZE, LayerConfig, resolve_impl, validate
from attnctl.errors import AttnctlError
from attnctl.model import ModelSpec
from attnctl.trace import Stage

MASK_CONVENTION = "True = may attend (F.scaled_dot_product_attention convention)"


@dataclass(frozen=True)
class Parameter:
    name: str
    shape: tuple[int, ...]
    copies: int = 1  # one per block for a model's "layers.*.…" tensors

    @property
    def count(self) -> int:
        return _product(self.shape) * self.copies


@dataclass(frozen=True)
class Plan:
    config: LayerConfig
    batch: int
    seq_len: int
    vocab_size: int
    sizes: dict[str, int]  # symbol -> number, e.g. {"B": 1, "L": 4, "D": 512, ...}
    stages: list[Stage] = field(default_factory=list)
    parameters: list[Parameter] = field(default_factory=list)
    # tensors the caller keeps alive past their last reader: name -> until which stage
    held_until: dict[str, str] = field(default_factory=dict)
    model: ModelSpec | None = None  # a pretrained model's block, rather than one layer
    layer_index: int = 0  # which of the model's blocks

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)

    @property
    def parameter_count(self) -> int:
        return sum(p.count for p in self.parameters)

    @property
    def parameter_bytes(self) -> int:
        return self.parameter_count * DTYPE_BYTES[self.config.dtype]


def _product(shape: tuple[int, ...]) -> int:
    total = 1
    for n in shape:
        total *= n
    return total


def layer_parameters(config: LayerConfig, vocab_size: int) -> list[Parameter]:
    """Every learnable tensor, named as ``AttentionLayer.named_parameters()`` names it."""
    d = config.d_model
    kv = config.kv_heads * config.d_k  # narrower K and V projections under GQA
    params = [Parameter("embedding.weight", (vocab_size, d))]
    for proj, width in (("W_q", d), ("W_k", kv), ("W_v", kv), ("W_o", d)):
        params.append(Parameter(f"{proj}.weight", (width, d)))
        if config.bias and (proj != "W_o" or config.output_bias):
            params.append(Parameter(f"{proj}.bias", (width,)))
    if config.pos == "learned":
        params.append(Parameter("positions.weight", (config.max_positions, d)))
    if config.norm != "none":
        params.append(Parameter("norm.weight", (d,)))
        if config.norm_type == "layer":  # RMSNorm has no bias
            params.append(Parameter("norm.bias", (d,)))
    return params


def model_parameters(model: ModelSpec) -> list[Parameter]:
    """Every weight of the checkpoint; a block's tensors once, with ``copies``."""
    groups: dict[str, list[tuple[int, ...]]] = {}
    for key, info in model.weights().items():
        groups.setdefault(re.sub(r"\.\d+\.", ".*.", key, count=1), []).append(info.shape)
    return [Parameter(name, shapes[0], len(shapes)) for name, shapes in groups.items()]


def build_plan(
    config: LayerConfig,
    seq_len: int,
    batch: int = 1,
    vocab_size: int = 1,
    device: str = "",
    padded: bool = False,
    context_len: int | None = None,
    model: ModelSpec | None = None,
    layer_index: int = 0,
) -> Plan:
    """Predict every stage of a forward pass over ``batch`` sequences of ``seq_len`` tokens.

    ``padded``: some key sequences are padded on the right and a key-padding mask is applied
    (not with a causal mask, which never lets a real token see right padding anyway).
    ``context_len``: cross-attention; keys and values come from a context of that length.
    ``model``: the stages of a pretrained model's block ``layer_index``: its embeddings, the
    block's input, the attention layer (``config``, from :meth:`ModelSpec.layer_config`),
    then the feed-forward. Blocks run one after another, so one block's peak is the model's.
    """
    if context_len is not None:
        config = dataclasses.replace(config, cross=True)
    config = resolve_impl(validate(config))
    cross = config.cross
    if cross:
        context_len = seq_len if context_len is None else context_len  # a preset says cross
        if context_len <= 0:
            raise AttnctlError(f"context-len must be a positive integer, got {context_len}")
    for name, value in (("seq-len", seq_len), ("batch", batch), ("context-len", context_len)):
        if value is not None and value >= LARGEST_SIZE:
            raise AttnctlError(f"{name} must be below 2^63 (torch's largest size), got {value}")
    if seq_len <= 0:
        raise AttnctlError(f"seq-len must be a positive integer, got {seq_len}")
    if batch <= 0:
        raise AttnctlError(f"batch must be a positive integer, got {batch}")
    sizes = {
        "B": batch,
        "L": seq_len,
        "D": config.d_model,
        "H": config.heads,
        "Hkv": config.kv_heads,
        "D_kv": config.kv_heads * config.d_k,
        "d_k": config.d_k,
        "V": vocab_size,
    }
    if cross:
        sizes["Lc"] = context_len
    key_len = "Lc" if cross else "L"  # the keys' length: the context's, or the text's own
    stages: list[Stage] = []

    def add(name, dims, reads=(), *, dtype=config.dtype, view_of=None, what="", scratch=0):
        dim_names = tuple(dims.split())
        shape = tuple(sizes[d] for d in dim_names)
        nbytes = _product(shape) * DTYPE_BYTES[dtype]
        stages.append(
            Stage(
                name, dim_names, shape, dtype, nbytes, device, view_of, tuple(reads), what, scratch
            )
        )
        return name

    ids = add("token_ids", "B L", dtype="int64", what="token ids from the tokenizer")
    if cross:
        add("context_ids", "B Lc", dtype="int64", what="the context's token ids (keys, values)")
    padding = padded and config.mask != "causal"
    if padding:
        add("padding_mask", f"B {key_len}", dtype="bool", what=f"key padding; {MASK_CONVENTION}")

    def embed(prefix: str, length_dim: str, length: int, reads: str) -> str:
        """Embedding lookup, plus positions when they are added to the embeddings."""
        if config.pos == "learned" and length > config.max_positions:
            raise AttnctlError(
                f"length {length} is longer than the {config.max_positions} learned positions; "
                "raise max_positions or use --pos rope|sinusoidal"
            )
        x = add(
            f"{prefix}embeddings",
            f"B {length_dim} D",
            (reads,),
            what="embedding lookup: one D-vector per token",
        )
        if config.pos == "sinusoidal":
            # float32 scratch while the table is built: positions (L), frequencies (⌈D/2⌉),
            # angles (L·⌈D/2⌉) and sin(angles) (L·⌈D/2⌉) before it is written into the table
            half = (config.d_model + 1) // 2
            pos = add(
                f"{prefix}positions",
                f"{length_dim} D",
                what="sinusoidal position table",
                scratch=4 * (length + half + 2 * length * half),
            )
        elif config.pos == "learned":  # the int64 position ids live during the lookup
            pos = add(
                f"{prefix}positions",
                f"{length_dim} D",
                what="learned position table rows",
                scratch=8 * length,
            )
        else:
            return x
        return add(f"{prefix}x", f"B {length_dim} D", (x, pos), what="embeddings + positions")

    if model is None:
        x = embed("", "L", seq_len, ids)
    else:
        sizes["I"] = model.intermediate
        x = _model_embeddings(add, model, seq_len, ids)
        if layer_index > 0:
            x = add("hidden", "B L D", what=f"block {layer_index - 1}'s output: this block's input")
    context = embed("context_", "Lc", context_len, "context_ids") if cross else None

    grouped = config.kv_heads != config.heads  # grouped-query (GQA) or multi-query attention
    kv_width = f"B {key_len} {'D_kv' if grouped else 'D'}"
    kv_heads = f"B {'Hkv' if grouped else 'H'} {key_len} d_k"
    norm_name = "LayerNorm" if config.norm_type == "layer" else "RMSNorm"
    h = x  # what the projections read: x, or Norm(x) in a pre-norm layer
    if config.norm == "pre":
        h = add("norm", "B L D", (x,), what=f"{norm_name} over D, before attention (pre-norm)")
    for name in ("q", "k", "v"):
        add(
            name,
            "B L D" if name == "q" else kv_width,
            (h,) if name == "q" or not cross else (context,),
            what=f"x · W_{name}" + (" + b" if config.bias else ""),
        )
    heads = {
        name: add(
            f"{name}_heads",
            "B H L d_k" if name == "q" else kv_heads,
            (name,),
            view_of=name,
            what=f"view (B, L, {'H' if name == 'q' or not grouped else 'Hkv'}, d_k), "
            "transpose(1, 2): no copy",
        )
        for name in ("q", "k", "v")
    }
    if config.pos == "rope":
        half = config.d_k // 2
        float32_table = seq_len * config.d_k * 4
        add(
            "rope_angles",
            "L d_k",
            dtype="float32",
            what=f"RoPE angles pos·θ_i, θ_i = {config.rope_theta:g}^(-2i/d_k)"
            + ("" if config.rope_type == "default" else f", {config.rope_type} scaling"),
            scratch=4 * (half + seq_len + seq_len * half),  # frequencies, positions, outer
        )
        cast = float32_table if config.dtype != "float32" else 0  # cos() in float32, then .to
        add("rope_cos", "L d_k", ("rope_angles",), what="cos of the angles", scratch=cast)
        add("rope_sin", "L d_k", ("rope_angles",), what="sin of the angles", scratch=cast)
        for name in ("q", "k"):
            dims = "B H L d_k" if name == "q" or not grouped else "B Hkv L d_k"
            size = _product(tuple(sizes[d] for d in dims.split())) * DTYPE_BYTES[config.dtype]
            heads[name] = add(
                f"{name}_rotated",
                dims,
                (heads[name], "rope_cos", "rope_sin"),
                what="x·cos + rotate_half(x)·sin: RoPE turns each pair of dims",
                scratch=2 * size,  # rotate_half(x) and its product with sin
            )
    if grouped and config.impl == "math":  # each K/V head serves H / Hkv query heads
        for name in ("k", "v"):
            heads[name] = add(
                f"{name}_repeated",
                f"B H {key_len} d_k",
                (heads[name],),
                what=f"repeat_interleave({config.groups}, dim=1): one copy per query head",
            )

    if config.impl == "math":
        scores = add(
            "scores",
            f"B H L {key_len}",
            (heads["q"], heads["k"]),
            # the negated padding mask (B·L bools) is made after q and k are freed, so it
            # never raises this stage's peak
            what="Q · Kᵀ / √d_k, one L×L per head"
            + ("; padded keys set to -inf" if padding else ""),
        )
        if config.pos == "alibi":
            h, length = config.heads, seq_len
            # float32 scratch: exponents and slopes (H each), positions (L), |i - j| (L·L),
            # and the float32 bias itself before .to() when the dtype is narrower
            narrow = 4 * h * length * length if config.dtype != "float32" else 0
            add(
                "alibi",
                "H L L",
                what="ALiBi bias -m_h·|i - j| added to the scores in place",
                scratch=8 * h + 4 * length + 4 * length * length + narrow,
            )
        if config.mask == "causal":
            add(
                "mask",
                "L L",
                (scores,),
                dtype="bool",
                what=f"causal; {MASK_CONVENTION}; blocked scores set to -inf in place",
            )
        weights = add(
            "weights", f"B H L {key_len}", (scores,), what="softmax over keys: rows sum to 1"
        )
        if config.dropout > 0:  # training only: the plan of a --train configuration
            weights = add(
                "dropout",
                f"B H L {key_len}",
                (weights,),
                what=f"dropout p={config.dropout} on the weights (training only), seeded",
            )
        attended = add("weighted_values", "B H L d_k", (weights, heads["v"]), what="weights · V")
    else:
        attended = add(
            "weighted_values",
            "B H L d_k",
            (heads["q"], heads["k"], heads["v"]),
            what="F.scaled_dot_product_attention"
            + (" (is_causal)" if config.mask == "causal" else "")
            + ": weights never stored",
        )
    # transpose(1, 2).contiguous() copies only when the memory order really changes: not
    # when H == 1 or L == 1 (size-1 dims don't count), and not after the fused kernels,
    # which write (B, L, H, d_k) order already. The run's trace confirms each case.
    no_copy = config.impl == "sdpa" or config.heads == 1 or seq_len == 1
    concat = add(
        "concat",
        "B L D",
        (attended,),
        view_of=attended if no_copy else None,
        what="transpose(1, 2).contiguous().view: heads side by side"
        + (" (already in order: no copy)" if no_copy else " (a copy)"),
    )
    has_output_bias = config.bias and config.output_bias
    out = add(
        "output_projection",
        "B L D",
        (concat,),
        what="concat · W_o" + (" + b" if has_output_bias else ""),
    )
    if config.norm != "none":
        residual = add("residual", "B L D", (x, out), what="x + attention output")
    if config.norm == "post":
        add("norm", "B L D", (residual,), what=f"{norm_name} over D (post-norm)")

    attention_end = stages[-1].name
    if model is not None:
        _feed_forward(add, model, attention_end)
    # The caller makes the inputs before the layer runs and holds them throughout. The layer
    # returns its output and its attention output. A model's block holds its input and the
    # attention output until its attention layer returns, the feed-forward's input until
    # the feed-forward returns.
    end = stages[-1].name
    held = dict.fromkeys(("token_ids", "context_ids", "padding_mask"), end)
    held["output_projection"] = end if model is None else attention_end
    if model is not None:
        held |= {x: attention_end, attention_end: end}
    names = {s.name for s in stages}
    held = {name: until for name, until in held.items() if name in names}
    parameters = layer_parameters(config, vocab_size) if model is None else model_parameters(model)
    return Plan(
        config=config,
        batch=batch,
        seq_len=seq_len,
        vocab_size=vocab_size,
        sizes=sizes,
        stages=stages,
        parameters=parameters,
        held_until=held,
        model=model,
        layer_index=layer_index,
    )


def _model_embeddings(add, model: ModelSpec, seq_len: int, ids: str) -> str:
    """The family's embeddings, before its first block; returns the last stage's name."""
    if model.family != "llama" and seq_len > model.max_positions:
        raise AttnctlError(
            f"{seq_len} tokens are more than the {model.max_positions} positions "
            f"{model.name} was trained with"
        )
    # a sliding window changes which scores are masked, not a shape or a byte: run checks
    # the length against it (ModelSpec.check_run_length), shapes and memory need not
    x = add("embeddings", "B L D", (ids,), what="token embedding lookup")
    if model.family == "llama":  # positions come later: RoPE rotates Q and K in every block
        return x
    # learned position rows; the int64 position ids live during the lookup
    pos = add("positions", "L D", what="learned position table rows", scratch=8 * seq_len)
    if model.family == "gpt2":
        return add("x", "B L D", (x, pos), what="embeddings + positions")
    x = add("x", "B L D", (x, pos), what="embeddings + segment 0's embedding + positions")
    return add("embedding_norm", "B L D", ("x",), what="LayerNorm over D")


def _feed_forward(add, model: ModelSpec, attention_out: str) -> None:
    """The block's feed-forward, after its attention layer, with its residual and norm."""
    act = {"gelu_new": "gelu (tanh)", "gelu_pytorch_tanh": "gelu (tanh)"}.get(
        model.activation, model.activation
    )
    h = attention_out
    if model.family != "bert":  # pre-norm: the feed-forward reads Norm(x)
        norm = "RMSNorm" if model.family == "llama" else "LayerNorm"
        h = add("ffn_norm", "B L D", (attention_out,), what=f"{norm} over D, before the FFN")
    if model.family == "llama":  # SwiGLU: down(silu(gate(h)) * up(h))
        add("ffn_gate", "B L I", (h,), what="h · W_gate")
        add("ffn_act", "B L I", ("ffn_gate",), what=act)
        add("ffn_up", "B L I", (h,), what="h · W_up")
        inner = add(
            "ffn_product", "B L I", ("ffn_act", "ffn_up"), view_of="ffn_act", what="act *= up"
        )
    else:
        add("ffn_up", "B L I", (h,), what="h · W_in + b: D -> I")
        inner = add("ffn_act", "B L I", ("ffn_up",), what=act)
    add("ffn_down", "B L D", (inner,), what="· W_out: I -> D")
    add(
        "ffn_residual",
        "B L D",
        ("ffn_down", attention_out),
        view_of="ffn_down",
        what="+= the FFN's input (in place)",
    )
    if model.family == "bert":
        add("ffn_norm", "B L D", ("ffn_residual",), what="LayerNorm over D (post-norm)")
