"""The stages of a model's forward pass as data: names, named dims, shapes, dtypes, bytes.

No torch here: ``attnctl shapes`` renders a plan and ``attnctl memory`` sums one. A plan
walks a :class:`~attnctl.model.describe.ModelDescription` (the seeded layer is a one-block
model) through the sublayer plans in ``attnctl/stages/``; the runner walks the same
description in torch (``attnctl/nn/``) and records the same stages, and the tests hold
the two equal, so what ``shapes`` predicts is what ``run`` does.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from attnctl.errors import AttnctlError
from attnctl.model.config import DTYPE_BYTES, LARGEST_SIZE, LayerConfig, resolve_impl, validate
from attnctl.model.describe import (
    CROSS_ATTENTION,
    Attention,
    Block,
    ModelDescription,
    Parameter,
    seeded_model,
)
from attnctl.model.device import cuda_target
from attnctl.model.gpu import CudaTarget, SdpaChoice
from attnctl.stages import MASK_CONVENTION, PlanBuilder
from attnctl.stages.attention import plan_attention
from attnctl.stages.collectives import reduced_name
from attnctl.stages.cuda import DeviceLine, cuda_lines
from attnctl.stages.embeddings import plan_context_embeddings, plan_embeddings
from attnctl.stages.feed_forward import plan_feed_forward
from attnctl.trace import Stage

__all__ = ["MASK_CONVENTION", "Parameter", "Plan", "build_plan", "build_seq2seq_plans"]

INPUTS = ("token_ids", "context_ids", "encoder_output", "padding_mask")  # made before it runs


@dataclass(frozen=True)
class Plan:
    config: LayerConfig  # the shown block's attention
    batch: int
    seq_len: int
    vocab_size: int
    sizes: dict[str, int]  # symbol -> number, e.g. {"B": 1, "L": 4, "D": 512, ...}
    stages: list[Stage] = field(default_factory=list)
    parameters: list[Parameter] = field(default_factory=list)
    # tensors the caller keeps alive past their last reader: name -> until which stage
    held_until: dict[str, str] = field(default_factory=dict)
    model: ModelDescription | None = None  # a checkpoint's, rather than the seeded layer
    layer_index: int = 0  # which of the model's blocks
    description: ModelDescription | None = None  # what was walked (the seeded layer too)
    # alive before the first stage and held to the last: the inputs, and in a T5 block
    # after the first, block 0's relative position bias
    given: tuple[str, ...] = INPUTS
    # one rank's plan of a split (``parallel.plan.rank_plan``): its TP group's size, SP
    tensor_parallel: int = 1
    sequence_parallel: bool = False
    # context parallel: the C ranks of the ring and which of them (``ring_attention``)
    context_parallel: int = 1
    context_rank: int = 0
    # on CUDA: the GPU and torch rules planned for, what CUDA allocates beside the
    # stages' tensors (``stages/cuda.py``), and the kernel of each SDPA call
    cuda: CudaTarget | None = None
    device_lines: tuple[DeviceLine, ...] = ()
    sdpa_kernels: tuple[SdpaChoice, ...] = ()

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)

    @property
    def parameter_count(self) -> int:
        return sum(p.count for p in self.parameters)

    @property
    def parameter_bytes(self) -> int:
        return self.parameter_count * DTYPE_BYTES[self.config.dtype]


def layer_parameters(config: LayerConfig, vocab_size: int) -> list[Parameter]:
    """Every learnable tensor, named as ``AttentionLayer.named_parameters()`` names it."""
    d = config.d_model
    kv = config.kv_heads * config.d_k  # narrower K and V projections under GQA
    params = [Parameter("embedding.weight", (vocab_size, d))]
    q_width = config.q_width  # H·d_k: what W_q projects to and W_o maps back to D
    for proj, shape in (
        ("W_q", (q_width, d)),
        ("W_k", (kv, d)),
        ("W_v", (kv, d)),
        ("W_o", (d, q_width)),
    ):
        params.append(Parameter(f"{proj}.weight", shape))
        if config.bias and (proj != "W_o" or config.output_bias):
            params.append(Parameter(f"{proj}.bias", shape[:1]))
    if config.pos == "learned":
        params.append(Parameter("positions.weight", (config.max_positions, d)))
    if config.norm != "none":
        params.append(Parameter("norm.weight", (d,)))
        if config.norm_type == "layer":  # RMSNorm has no bias
            params.append(Parameter("norm.bias", (d,)))
    if config.qk_norm != "none":  # over each head's d_k, or over every head at once
        per_head = config.qk_norm == "head"
        for name, width in (("q_norm", q_width), ("k_norm", kv)):
            params.append(Parameter(f"{name}.weight", (config.d_k if per_head else width,)))
            if config.norm_type == "layer":
                params.append(Parameter(f"{name}.bias", (config.d_k if per_head else width,)))
    return params


def model_parameters(model: ModelDescription) -> list[Parameter]:
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
    model: ModelDescription | None = None,
    layer_index: int = 0,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    context_parallel: int = 1,
    context_rank: int = 0,
    workspaces: bool = True,
) -> Plan:
    """Predict every stage of a forward pass over ``batch`` sequences of ``seq_len`` tokens.

    ``config``: the seeded layer, or (with ``model``) the run's dtype, kernel and device
    for a checkpoint's blocks (:meth:`ModelDescription.layer_config`).
    ``padded``: some key sequences are padded on the right and a key-padding mask is applied
    (not with a causal mask, which never lets a real token see right padding anyway).
    ``context_len``: cross-attention; keys and values come from a context of that length.
    ``model``: the stages of a checkpoint's block ``layer_index``: its embeddings, the
    block's input, then its sublayers. Blocks run one after another, so one block's peak
    is the model's.
    ``tensor_parallel``, ``sequence_parallel``: one rank's stages when the model (already
    cut to one rank's heads and columns, ``parallel/plan.py``) is split over that many
    ranks: the collectives between sublayers, and the L / T tokens between them with SP.
    ``context_parallel``, ``context_rank``: ``seq_len`` is the chunk of rank
    ``context_rank`` of that many (L/C), whose attention is ring attention.
    ``workspaces``: on CUDA, the pass makes cuBLAS's workspaces (False: the process made
    them before, as an encoder–decoder's encoder does for its decoder).
    """
    description, decoder = _described(config, vocab_size, context_len, model, layer_index)
    block = description.blocks[layer_index]
    attention = block.attention
    config = attention.config
    cross = attention.kind == "cross_attention"
    context_len = _context_length(seq_len, batch, context_len, cross, decoder)
    plan = _builder(
        config, block, seq_len, batch, vocab_size, device, context_len, cross or decoder,
        tensor_parallel, sequence_parallel, context_parallel, context_rank,
    )  # fmt: skip
    padding = _plan_inputs(plan, config, cross, decoder, padded)
    x = plan_embeddings(plan, description.embeddings, seq_len)
    context = plan_context_embeddings(plan, description.embeddings, context_len) if cross else None
    if layer_index > 0:
        x = plan.add(
            "hidden", plan.hidden, what=f"block {layer_index - 1}'s output: this block's input"
        )
    held = _plan_sublayers(plan, block, x, context, decoder, padded, padding)
    held, given = _held_until(plan, block, held)
    parameters = layer_parameters(config, vocab_size) if model is None else model_parameters(model)
    stages, lines, kernels = plan.stages, [], []
    if plan.cuda is not None:
        stages, lines, kernels = cuda_lines(stages, plan.sizes, config, plan.cuda, workspaces)
    return Plan(
        config=config,
        batch=batch,
        seq_len=seq_len,
        vocab_size=vocab_size,
        sizes=plan.sizes,
        stages=stages,
        parameters=parameters,
        held_until=held,
        model=model if model is None else description,
        layer_index=layer_index,
        description=description,
        given=given,
        tensor_parallel=tensor_parallel,
        sequence_parallel=sequence_parallel,
        context_parallel=context_parallel,
        context_rank=context_rank,
        cuda=plan.cuda,
        device_lines=tuple(lines),
        sdpa_kernels=tuple(kernels),
    )


def _described(
    config: LayerConfig,
    vocab_size: int,
    context_len: int | None,
    model: ModelDescription | None,
    layer_index: int,
) -> tuple[ModelDescription, bool]:
    """The description walked (the checkpoint's with the run's settings, or the seeded
    layer's, cross-attention when a context length is given), and whether its block
    ``layer_index`` is an encoder–decoder's decoder block."""
    description = model.with_run(resolve_impl(validate(config))) if model is not None else None
    # an encoder–decoder's decoder block: cross-attention over the encoder output (B, Lc, D)
    decoder = description is not None and any(
        s.kind == CROSS_ATTENTION for s in description.blocks[layer_index].sublayers
    )
    if context_len is not None and not decoder:
        if model is not None:
            raise AttnctlError("a context length applies to a decoder block's cross-attention")
        config = dataclasses.replace(config, cross=True)
    config = resolve_impl(validate(config))
    if description is None:
        description = seeded_model(config, vocab_size)
    return description, decoder


def _context_length(
    seq_len: int, batch: int, context_len: int | None, cross: bool, decoder: bool
) -> int | None:
    """The context's length (a cross-attention preset's is the text's own), after checking
    it and the other lengths."""
    if decoder and context_len is None:
        raise AttnctlError("a decoder block needs the source's length (context_len)")
    if cross:
        context_len = seq_len if context_len is None else context_len  # a preset says cross
    if (cross or decoder) and context_len <= 0:
        raise AttnctlError(f"context-len must be a positive integer, got {context_len}")
    for name, value in (("seq-len", seq_len), ("batch", batch), ("context-len", context_len)):
        if value is not None and value >= LARGEST_SIZE:
            raise AttnctlError(f"{name} must be below 2^63 (torch's largest size), got {value}")
    if seq_len <= 0:
        raise AttnctlError(f"seq-len must be a positive integer, got {seq_len}")
    if batch <= 0:
        raise AttnctlError(f"batch must be a positive integer, got {batch}")
    return context_len


def _builder(
    config: LayerConfig,
    block: Block,
    seq_len: int,
    batch: int,
    vocab_size: int,
    device: str,
    context_len: int | None,
    with_context: bool,
    tensor_parallel: int,
    sequence_parallel: bool,
    context_parallel: int,
    context_rank: int,
) -> PlanBuilder:
    """An empty plan of the block: the number of each named dim (Lc when ``with_context``:
    cross-attention or a decoder block), and the split it is one rank of."""
    sizes = {
        "B": batch,
        "L": seq_len,
        "D": config.d_model,
        # head_dim: the heads side by side are H·d_k wide, not D
        **({"D_q": config.q_width} if config.q_width != config.d_model else {}),
        "H": config.heads,
        "Hkv": config.kv_heads,
        "D_kv": config.kv_heads * config.d_k,
        "d_k": config.d_k,
        "V": vocab_size,
    }
    if with_context:
        sizes["Lc"] = context_len
    feed_forward = next((s for s in block.sublayers if not isinstance(s, Attention)), None)
    if feed_forward is not None:
        sizes["I"] = feed_forward.inner
    if sequence_parallel:
        sizes["L/T"] = seq_len // tensor_parallel  # between the sublayers
    if context_parallel > 1:
        sizes["L/C"] = seq_len  # this rank's chunk, in the ring attention's stages
    return PlanBuilder(
        sizes,
        config.dtype,
        device,
        cuda=cuda_target(device, config.gpu, config.torch_rules),
        tensor_parallel=tensor_parallel,
        sequence_parallel=sequence_parallel,
        context_parallel=context_parallel,
        context_rank=context_rank,
    )


def _plan_inputs(
    plan: PlanBuilder, config: LayerConfig, cross: bool, decoder: bool, padded: bool
) -> bool:
    """The inputs made before the model runs: token ids, the context's or the encoder's
    output, the padding mask. Returns whether the keys are masked for padding."""
    plan.add("token_ids", "B L", dtype="int64", what="token ids from the tokenizer")
    if cross:
        plan.add(
            "context_ids", "B Lc", dtype="int64", what="the context's token ids (keys, values)"
        )
    if decoder:
        plan.add(
            "encoder_output",
            "B Lc D",
            what="the encoder's output over the source (Lc tokens): cross-attention's K, V",
        )
    padding = padded and config.mask != "causal"
    if padding or (decoder and padded):
        key_len = "Lc" if cross or decoder else "L"
        plan.add(
            "padding_mask", f"B {key_len}", dtype="bool", what=f"key padding; {MASK_CONVENTION}"
        )
    return padding


def _plan_sublayers(
    plan: PlanBuilder,
    block: Block,
    x: str,
    context: str | None,
    decoder: bool,
    padded: bool,
    padding: bool,
) -> dict[str, str]:
    """The block's sublayers in order, reading ``x``. Returns what the caller holds past
    its last reader: each attention's W_o output (name -> until which stage)."""
    held: dict[str, str] = {}
    for sublayer in block.sublayers:
        if isinstance(sublayer, Attention) and sublayer.kind == CROSS_ATTENTION and decoder:
            prefix = sublayer.name.removesuffix("attention")  # "cross_", as nn/model.py says
            with plan.scoped(prefix):
                x = plan_attention(plan, sublayer, x, "encoder_output", padded)
            held[prefix + "output_projection"] = x  # returned with the output
        elif isinstance(sublayer, Attention):
            x = plan_attention(plan, sublayer, x, context, padding)
            held[reduced_name(plan, "output_projection")] = x  # W_o's, summed over ranks
        else:
            x = plan_feed_forward(plan, sublayer, x)
    return held


def _held_until(
    plan: PlanBuilder, block: Block, held: dict[str, str]
) -> tuple[dict[str, str], tuple[str, ...]]:
    """What is held past its last reader, and until which stage; and the inputs (with T5's
    relative bias after block 0) given before the first stage."""
    # The caller makes the inputs before the model runs and holds them throughout. An
    # attention sublayer returns its output and its W_o output: both live until it returns.
    # T5's relative bias, made in block 0, lives until the last block is done.
    end = plan.last
    given = INPUTS
    names = {s.name for s in plan.stages}
    relative = [
        s for s in block.sublayers if isinstance(s, Attention) and s.config.pos == "relative"
    ]
    if relative and not relative[0].computes_bias:  # block 0's, held since then
        given += ("position_bias",)
    held.update(dict.fromkeys(given, end))
    if relative and relative[0].computes_bias:
        held["position_bias"] = end
    held = {name: until for name, until in held.items() if name in names}
    return held, tuple(name for name in given if name in names)


def build_seq2seq_plans(
    model: ModelDescription,
    config: LayerConfig,
    src_len: int,
    tgt_len: int,
    batch: int = 1,
    padded: bool = False,
    encoder_block: int = 0,
    decoder_block: int = 0,
    device: str = "",
) -> tuple[Plan, Plan]:
    """An encoder–decoder's two plans: encoder block ``encoder_block`` over a source of
    ``src_len`` tokens (L = the source), and decoder block ``decoder_block`` over a target
    of ``tgt_len`` tokens (L = the target) whose cross-attention reads the encoder output
    (Lc = the source's length).

    ``config``: the run's dtype, kernel and device (:meth:`ModelDescription.layer_config`);
    ``padded``: some sources are padded on the right (their padded keys masked, in the
    encoder's self-attention and the decoder's cross-attention). Each plan's parameters
    are every weight of the checkpoint (count them once).
    """
    decoder = model.decoder
    if decoder is None:
        raise AttnctlError(f"{model.name} is not an encoder–decoder: it has no source and target")
    for what, index, stack in (
        ("encoder", encoder_block, model),
        ("decoder", decoder_block, decoder),
    ):
        if not 0 <= index < stack.layers:
            raise AttnctlError(
                f"{what} block {index} is out of range: the {what} has {stack.layers} blocks "
                f"(0–{stack.layers - 1})"
            )
    for what, length, stack in (("source", src_len, model), ("target", tgt_len, decoder)):
        if length <= 0:
            raise AttnctlError(f"the {what} length must be a positive integer, got {length}")
        longest = stack.longest_input()
        if longest is not None and length > longest:
            raise AttnctlError(
                f"a {what} of {length} tokens is more than the {longest} positions "
                f"{model.name} was trained with"
            )
    encoder_plan = build_plan(
        config, src_len, batch, model.vocab_size, device, padded, model=model,
        layer_index=encoder_block,
    )  # fmt: skip
    decoder_plan = build_plan(
        config, tgt_len, batch, decoder.vocab_size, device, padded, context_len=src_len,
        model=decoder, layer_index=decoder_block, workspaces=False,  # the encoder's made them
    )  # fmt: skip
    return encoder_plan, decoder_plan
