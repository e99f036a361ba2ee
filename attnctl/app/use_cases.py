"""One function per command: from a request to a report, doing all the command does.

Resolve the layer or the model, read the texts, choose blocks, heads and rows, plan, check
memory and time before allocating, run or measure. Nothing here prints or exits: progress
and warnings go through the :class:`Hooks` the CLI passes; errors are AttnctlError.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from attnctl.app.calls import (
    compare_implementations,
    estimate_of,
    kv_cache_of,
    load_model,
    measure_peak,
    model_layer,
    model_weight_bytes,
    padding_mask_needed,
    plan_for,
    run_traces,
    training_estimate_of,
)
from attnctl.app.inputs import choose_blocks, parse_lengths, read_contexts, read_texts
from attnctl.app.memory_seq2seq import check_length_options, seq2seq_memory, seq2seq_shapes
from attnctl.app.planned_gpu import (
    budget_bytes as planned_budget,
)
from attnctl.app.planned_gpu import (
    cuda_need,
    measure_need,
    on_this_machine,
    refuse_planned_gpu,
)
from attnctl.app.preflight import kept_stage_bytes, preflight
from attnctl.app.requests import (
    CheckReport,
    CheckRequest,
    Hooks,
    LayerRequest,
    MemoryRequest,
    RunRequest,
    ShapesRequest,
)
from attnctl.errors import AttnctlError
from attnctl.memory.estimate import (
    MemoryEstimate,
    allowed_impls,
    fit,
    longest_input,
)
from attnctl.model.config import LARGEST_SIZE, LayerConfig, build_config, resolve_impl
from attnctl.model.describe import ModelDescription
from attnctl.model.device import planned_device
from attnctl.model.layout import Layout
from attnctl.report.commands import (
    LengthReport,
    MemoryCommandReport,
    RunReport,
    Seq2SeqMemoryReport,
    Seq2SeqShapes,
    length_report,
    memory_command_report,
    run_report,
)
from attnctl.stages.plan import Plan
from attnctl.text.tokenize import Batch, encode_batch, missing_tokenizer, vocab_size
from attnctl.window import DEFAULT_HEADS_SHOWN, choose_heads, choose_rows

if TYPE_CHECKING:  # run's other reports: their use case is imported when it runs
    from attnctl.report.generation import GenerationReport, TranslationReport

# options that still apply to a model
MODEL_KEEPS = ("dtype", "device", "impl", "tokenizer", "gpu", "torch_rules")


def resolve_layer(request: LayerRequest) -> tuple[LayerConfig, ModelDescription | None]:
    """The validated layer: a preset with overrides, or a model's config.json (and the
    model), on its device resolved: the one place ``--device auto`` is decided (a named
    --gpu is planned for on CUDA, and its name and torch rules checked here)."""
    layer, model = _requested_layer(request)
    device = planned_device(layer.device, layer.gpu, layer.torch_rules)
    return dataclasses.replace(layer, device=device), model


def _requested_layer(request: LayerRequest) -> tuple[LayerConfig, ModelDescription | None]:
    values = dict(request.options)
    if request.model_dir is None:
        return build_config(values.pop("config", None), **values), None
    clashing = [k for k, v in values.items() if v is not None and k not in MODEL_KEEPS]
    if clashing:
        option = "--" + clashing[0].replace("_", "-")
        raise AttnctlError(
            f"{option} comes from the model's config.json; with --model only "
            + ", ".join(f"--{k}" for k in MODEL_KEEPS)
            + " may be given"
        )
    model = load_model(request.model_dir)
    return model_layer(model, {k: values.get(k) for k in MODEL_KEEPS}), model


def run_use_case(
    request: RunRequest, hooks: Hooks | None = None
) -> RunReport | GenerationReport | TranslationReport:
    """``run``: read the texts, choose blocks, heads and rows, plan, pre-flight, run;
    with ``--generate N``, generate (``app/generation.py``)."""
    hooks = hooks or Hooks()
    layer, model = resolve_layer(request.layer)
    if layer.dropout:
        raise AttnctlError("dropout acts only in training; see memory --train")
    layout = Layout(tp=request.tp, sp=request.sp)
    if layout.is_split:  # what a split does not run yet, refused before anything starts
        refuse_split(request, layout, layer, model)
    if layer.gpu:
        refuse_planned_gpu(request, layout, model)
    if model is not None and model.is_encoder_decoder:  # it always generates
        from attnctl.app.translation import translation_use_case

        return translation_use_case(request, layer, model, hooks)
    if request.encoder_block is not None:
        raise AttnctlError(
            "--encoder-layer picks a block of an encoder–decoder's encoder (Marian, BART, "
            "T5); this model's blocks are picked with --layer"
        )
    if request.generate is not None:
        from attnctl.app.generation import generation_use_case

        return generation_use_case(request, layer, model, hooks)
    return _layer_run(request, layer, model, layout, hooks)


def _layer_run(
    request: RunRequest,
    layer: LayerConfig,
    model: ModelDescription | None,
    layout: Layout,
    hooks: Hooks,
) -> RunReport:
    """``run`` of the seeded layer or a model's blocks: read the texts, choose blocks,
    heads and rows, plan, pre-flight, run (over ``layout``'s processes when it splits)."""
    if not 0 <= request.digits <= 8:
        raise AttnctlError(f"--digits must be between 0 and 8, got {request.digits}")
    blocks = choose_blocks(request.block, model)
    texts, contexts, batch, cross = _run_batches(request, layer, model)
    seq_len = batch.seq_len
    heads = choose_heads(request.heads, layer.heads)  # a range until the run is afforded
    every_block = blocks is not None and len(blocks) > 1  # --layer all: a summary of each
    if not request.heads and not request.every_weight and not every_block:
        heads = heads[:DEFAULT_HEADS_SHOWN]  # compute only the tables printed
    query_rows = choose_rows(request.rows, seq_len)
    layer = resolve_impl(layer, shows_every_weight=len(query_rows) == seq_len)

    context_len = cross.seq_len if cross else None
    vocab = batch.vocab_size if model is None else model.vocab_size
    shown_block = blocks[0] if blocks and len(blocks) == 1 else 0
    block_plan = functools.partial(
        plan_for, layer, seq_len, len(texts), vocab, model=model,
        padded=padding_mask_needed(cross or batch, layer), context_len=context_len,
    )  # fmt: skip
    plan = block_plan(layer_index=shown_block)  # for --gpu NAME's GPU: the memory shown
    memory = estimate_of(plan)
    local = on_this_machine(request.layer, layer)  # where it runs
    if local is not layer:
        block_plan = functools.partial(block_plan.func, local, *block_plan.args[1:],
                                       **block_plan.keywords)  # fmt: skip
    # the weights shown become Python floats: about 32 bytes each, beside the 4 of float32
    per_block = len(texts) * len(heads) * len(query_rows) * (context_len or seq_len) * 36
    shown_bytes = per_block * (len(blocks) if blocks else 1)
    if layout.is_split:
        need = _run_need(request, layer, model, plan, memory, blocks, shown_bytes, block_plan)
        return split_run(request, layout, layer, model, batch, heads, query_rows, plan,
                         memory, shown_block, texts, hooks, shown_bytes)  # fmt: skip
    here = plan if local is layer else block_plan(layer_index=shown_block)
    need = _run_need(request, local, model, here, estimate_of(here), blocks, shown_bytes,
                     block_plan)  # fmt: skip
    preflight(here, need, request.force, hooks, blocks=max(blocks) + 1 if blocks else 1)
    what = "the layer" if model is None else model.name
    keep_stages = request.save is not None
    with hooks.progress(f"running {what} over {len(texts)} x {seq_len} tokens"):
        traces = run_traces(batch, local, heads, query_rows, cross, model, blocks, keep_stages)
    hidden = None
    if not request.heads and not every_block and layer.heads > len(heads):
        hidden = (len(heads), layer.heads - 1)
    return run_report(
        texts, contexts, plan, memory, traces, heads, request.digits, every_block, hidden
    )


def _run_batches(
    request: RunRequest, layer: LayerConfig, model: ModelDescription | None
) -> tuple[list[str], list[str], Batch, Batch | None]:
    """The texts and the contexts (cross-attention's keys), tokenized in one vocabulary:
    the texts' batch, and the contexts' (None without any)."""
    texts = read_texts(request.texts, request.file)
    contexts = read_contexts(request.contexts, request.context_file, len(texts))
    if model is not None and contexts:
        raise AttnctlError(f"{model.name} has no cross-attention: leave out --context")
    if layer.cross and not contexts:
        raise AttnctlError("this layer is cross-attention: give --context TEXT (or --context-file)")
    own_tokenizer = None if model is None else model.path / "tokenizer.json"
    if own_tokenizer and layer.tokenizer == str(own_tokenizer) and not own_tokenizer.is_file():
        raise AttnctlError(missing_tokenizer(model.path))
    both = encode_batch(texts + contexts, layer.tokenizer)  # one vocabulary for both
    batch, context_batch = both.split(len(texts))
    cross = context_batch if contexts else None
    return texts, contexts, batch, cross


def _run_need(
    request: RunRequest,
    layer: LayerConfig,
    model: ModelDescription | None,
    plan: Plan,
    memory: MemoryEstimate,
    blocks: list[int] | None,
    shown_bytes: int,
    block_plan: Callable[..., Plan],
) -> int:
    """The bytes the pre-flight asks for: the weights loaded, the peak, the weights shown,
    and with --save a copy of every stage recorded (``block_plan``: a block's plan)."""
    every_block = blocks is not None and len(blocks) > 1
    weights = memory.parameter_bytes  # a model: only the blocks up to the one shown load
    if model is not None:
        weights = model_weight_bytes(model, max(blocks) + 1, layer.dtype)
    need = weights + memory.peak_activation_bytes + shown_bytes
    keep_stages = request.save is not None
    if keep_stages:  # --save: a copy of every recorded stage (views too) stays alive
        if every_block:  # each block's stages (the inputs and embeddings once)
            need += kept_stage_bytes([block_plan(layer_index=n) for n in blocks])
        else:
            need += kept_stage_bytes([plan])
    return need


def refuse_split(
    request: RunRequest, layout: Layout, layer: LayerConfig, model: ModelDescription | None
) -> None:
    """``run --tp``: the options a split does not run, each refused by name (exit 2)."""
    from attnctl.model.layout import check_layout

    check_layout(layout, train=False)
    if model is not None and model.is_encoder_decoder:
        raise AttnctlError(
            "run --tp splits decoder-only models and the seeded layer; "
            f"{model.name} is an encoder–decoder"
        )
    for given, option in (
        (request.generate is not None, "--generate"),
        (request.encoder_block is not None, "--encoder-layer"),
        (request.block == "all", "--layer all"),
        (request.save is not None, "--save"),
        (bool(request.contexts) or request.context_file is not None, "--context"),
    ):
        if given:
            raise AttnctlError(f"run --tp does not run {option} yet: leave one of them out")


def split_run(
    request: RunRequest,
    layout: Layout,
    layer: LayerConfig,
    model: ModelDescription | None,
    batch,
    heads,
    query_rows: list[int],
    plan: Plan,
    memory,
    block: int,
    texts: list[str],
    hooks: Hooks,
    shown_bytes: int,
) -> RunReport:
    """``run --tp T [--sp]``: the same run over T processes (``run_split.run_split``),
    reported as one device's run is, with the heads each rank holds."""
    from attnctl.parallel.distributed import (
        check_devices,
        check_split_run,
        estimated_ranks,
        preflight_split,
        split_timeout,
        whole_weight_bytes,
    )
    from attnctl.parallel.run_split import run_split

    seq_len, vocab = batch.seq_len, (batch.vocab_size if model is None else model.vocab_size)
    whole = check_split_run(layout, layer, model, [seq_len], vocab)
    _, rank_estimate, rank_weights = estimated_ranks(
        layer, seq_len, len(texts), vocab, layout, model, block
    )
    peak = rank_weights + rank_estimate.peak_activation_bytes + shown_bytes
    from attnctl.nn.layer import resolve_device

    device = resolve_device(layer.device)
    check_devices(device, layout.tp)
    preflight_split([peak] * layout.tp, whole_weight_bytes(whole, layer), device, request.force)
    what = "the layer" if model is None else model.name
    with hooks.progress(
        f"running {what} over {len(texts)} x {seq_len} tokens on {layout.tp} processes"
    ):
        split = run_split(batch, layer, model, block, list(heads), query_rows, layout,
                          padding_mask_needed(batch, layer),
                          split_timeout(plan, device, block + 1))  # fmt: skip
    hidden = None
    if not request.heads and layer.heads > len(heads):
        hidden = (len(heads), layer.heads - 1)
    report = run_report(texts, [], plan, memory, split.traces, heads, request.digits, False, hidden)
    return dataclasses.replace(report, split=split)


def shapes_use_case(request: ShapesRequest) -> Plan | Seq2SeqShapes:
    """``shapes``: the plan of every stage (an encoder–decoder's encoder and decoder block)."""
    layer, model = resolve_layer(request.layer)
    if layer.dropout:
        raise AttnctlError("dropout acts only in training; see memory --train")
    check_length_options(model, request.seq_len, request.src_len, request.tgt_len)
    if model is not None and model.is_encoder_decoder:
        if request.context_len is not None:
            raise AttnctlError("--context-len is --src-len on an encoder–decoder")
        return seq2seq_shapes(layer, model, request.src_len, request.tgt_len, request.batch)
    seq_len = 16 if request.seq_len is None else request.seq_len
    return sized_plan(layer, seq_len, request.batch, request.context_len, model)


def memory_use_case(
    request: MemoryRequest, hooks: Hooks | None = None
) -> MemoryCommandReport | Seq2SeqMemoryReport:
    """``memory``: estimate each length (measure it with --measure), then what fits a budget."""
    hooks = hooks or Hooks()
    layer, model = resolve_layer(request.layer)
    if request.measure and layer.gpu:
        raise AttnctlError(
            f"--gpu {layer.gpu} plans for a GPU that is not here; --measure measures this "
            "machine's device: leave out one of them"
        )
    check_length_options(model, request.seq_len, request.src_len, request.tgt_len)
    if request.layout.is_split:  # per device, beside the whole model on one
        from attnctl.app.memory_parallel import parallel_memory_use_case

        whole = functools.partial(memory_use_case, hooks=hooks)
        return parallel_memory_use_case(request, layer, model, whole, hooks)
    if model is not None and model.is_encoder_decoder:
        return seq2seq_memory(request, layer, model, hooks)
    generate = request.generate
    if generate is not None:
        check_generate(request, layer, model)
    lengths = parse_lengths(_lengths_asked(request, layer, model))
    stack, kv_layers = _memory_stack(request, model)
    _check_memory_options(request, layer)
    peak_of = functools.partial(_peak_of, request.train, request.layers, stack)
    reports = [
        _length_memory(request, layer, model, length, (stack, kv_layers), peak_of, hooks)
        for length in lengths
    ]
    budget_bytes = planned_budget(request, layer)
    fits = None
    if budget_bytes is not None:
        if layer.device.startswith("cuda"):  # the pre-flight's figure (resources.preflight)
            peak_of = functools.partial(cuda_need, request.train, peak_of, kv_layers)
        fits = {}
        for impl in allowed_impls(layer):  # not sdpa with dropout or alibi
            variant = dataclasses.replace(layer, impl=impl)
            sizer = functools.partial(
                sized_plan, variant, context_len=request.context_len, model=model
            )
            longest = longest_input(layer, model)  # learned positions end the search
            fits[impl] = fit(sizer, lengths[0], request.batch, budget_bytes, peak_of, longest)
    return memory_command_report(reports, fits, budget_bytes)


def _lengths_asked(
    request: MemoryRequest, layer: LayerConfig, model: ModelDescription | None
) -> str:
    """--seq-len as given, or 2048, or all a model's (or layer's) learned positions, less
    the tokens --generate adds."""
    seq_len, generate = request.seq_len, request.generate
    if seq_len is None:  # 2048, or all a model's (or layer's) learned positions
        longest = longest_input(layer, model)
        if longest is not None and generate:  # leaving room for the tokens generated
            if generate >= longest:
                raise AttnctlError(
                    f"--generate {generate} leaves no room for a prompt in the {longest} "
                    f"positions {model.name} was trained with"
                )
            longest -= generate
        seq_len = str(min(2048, longest or 2048))
    return seq_len


def _memory_stack(request: MemoryRequest, model: ModelDescription | None) -> tuple[int, int]:
    """The blocks the weights count and those whose K and V the cache counts: --layers
    of this layer, or a model's (its plan holds every weight; K and V per block)."""
    layers, context_len = request.layers, request.context_len
    stack, kv_layers = layers, layers  # --layers: weights and K/V of a stack of this layer
    if model is not None:
        clash = {"--layers": layers != 1, "--context-len": context_len}
        for option, given in clash.items():
            if given:
                raise AttnctlError(f"{option} does not apply to --model (a whole model's memory)")
        stack, kv_layers = 1, model.layers  # the plan holds every weight; K and V per block
    return stack, kv_layers


def _check_memory_options(request: MemoryRequest, layer: LayerConfig) -> None:
    """--kv-cache, --layers, --budget with --fit, and dropout without --train: refused."""
    layers, kv_cache = request.layers, request.kv_cache
    if kv_cache is not None and kv_cache < 0:
        raise AttnctlError(f"--kv-cache must be a number of tokens >= 0, got {kv_cache}")
    for option, value in (("--layers", layers), ("--kv-cache", kv_cache)):
        if value is not None and value >= LARGEST_SIZE:
            raise AttnctlError(f"{option} must be below 2^63 (torch's largest size), got {value}")
    if request.budget is not None and request.fit_device:
        raise AttnctlError("give --budget SIZE or --fit, not both")
    if layer.dropout and not request.train:
        raise AttnctlError("dropout acts only in training; add --train")


def _peak_of(train: bool, layers: int, stack: int, plan: Plan) -> int:
    """The plan's peak: a training step's of ``layers`` blocks, or a forward pass's of a
    stack of ``stack``."""
    if train:
        return training_estimate_of(plan, layers).peak_bytes
    return estimate_of(plan, stack).peak_bytes


def _length_memory(
    request: MemoryRequest,
    layer: LayerConfig,
    model: ModelDescription | None,
    length: int,
    stacks: tuple[int, int],
    peak_of: Callable[[Plan], int],
    hooks: Hooks,
) -> LengthReport:
    """One length: its estimate, the KV cache, a training step's (--train), what was
    measured (--measure, after the pre-flight) and the cache after --generate N."""
    stack, kv_layers = stacks
    layers, kv_cache, train = request.layers, request.kv_cache, request.train
    context_len = request.context_len
    plan = sized_plan(layer, length, request.batch, context_len, model)
    result = estimate_of(plan, stack)
    tokens = kv_cache if kv_cache is not None else context_len or length  # K/V's length
    training = training_estimate_of(plan, layers) if train else None
    measured = None
    if request.measure:
        need = measure_need(plan, train, peak_of, kv_layers)
        blocks = model.layers if model else layers  # a training step: the whole stack
        if not train:  # one pass through block 0, then one through every block
            blocks = 1 + (model.layers if model else 1)
        preflight(plan, need, request.force, hooks, blocks=blocks, passes=3 if train else 1)
        what = "a training step" if train else "a forward pass"
        with hooks.progress(f"measuring {what} over {length} tokens"):
            measured = measure_peak(plan, model, train, layers)
    kv_groups = kv_cache_of(plan, tokens, kv_layers)
    report = length_report(plan, result, tokens, kv_groups, measured, training)
    if request.generate is not None:
        report = generated_cache(report, request.generate, request, hooks)
    return report


def check_generate(request: MemoryRequest, layer: LayerConfig, model: ModelDescription | None):
    """``memory --generate N``: a decoder-only checkpoint's cache after N more tokens."""
    generate = request.generate
    if model is None:
        raise AttnctlError("--generate needs --model DIR: a decoder-only checkpoint generates")
    if layer.mask != "causal":
        raise AttnctlError(f"{model.name} is an encoder (no causal mask): it generates nothing")
    if generate < 1:
        raise AttnctlError(f"--generate takes a number of new tokens >= 1, got {generate}")
    if generate >= LARGEST_SIZE:
        raise AttnctlError(f"--generate must be below 2^63 (torch's largest size), got {generate}")
    if request.kv_cache is not None:
        raise AttnctlError("give --kv-cache N or --generate N, not both")
    if request.train:
        raise AttnctlError("--generate is inference: leave out --train")
    longest = longest_input(layer, model)
    lengths = parse_lengths(request.seq_len) if request.seq_len is not None else []
    for length in lengths:
        if longest is not None and length + generate > longest:
            raise AttnctlError(
                f"--seq-len {length} + --generate {generate} = {length + generate} tokens are "
                f"more than the {longest} positions {model.name} was trained with"
            )


def generated_cache(
    report: LengthReport, generate: int, request: MemoryRequest, hooks: Hooks
) -> LengthReport:
    """The cache after ``generate`` more tokens than the prompt (the plan's L): estimated
    by kind of block, and (--measure) by really generating them."""
    plan = report.plan
    tokens = plan.seq_len + generate
    groups = kv_cache_of(plan, tokens, plan.description.layers)
    measured = None
    if request.measure:
        from attnctl.app.calls import measure_generated_cache_of, require_trained_weights

        require_trained_weights(plan)  # a header-only folder: refused before any warning
        need = report.estimate.peak_bytes + sum(g.bytes for g in groups)
        blocks = plan.description.layers * (1 + generate)
        preflight(plan, need, request.force, hooks, blocks=blocks)
        with hooks.progress(f"generating {generate} tokens after {plan.seq_len}"):
            measured = measure_generated_cache_of(plan, generate)
    return dataclasses.replace(
        report,
        generate=generate,
        generated_kv_cache=groups,
        measured_generated_kv_cache_bytes=measured,
    )


def check_use_case(request: CheckRequest, hooks: Hooks | None = None) -> CheckReport:
    """``check``: compare the implementations and gradcheck, after the pre-flight."""
    hooks = hooks or Hooks()
    layer, _ = resolve_layer(request.layer)
    if layer.dropout:
        raise AttnctlError("dropout acts only in training; check compares inference")
    plan = sized_plan(layer, request.seq_len, request.batch)  # sizes checked before torch
    # three copies of the layer (math, sdpa, nn.MultiheadAttention), each with its outputs
    preflight(plan, 3 * estimate_of(plan).peak_bytes, request.force, hooks, passes=3)
    with hooks.progress("comparing implementations and running gradcheck"):
        result = compare_implementations(layer, request.batch, request.seq_len, plan.vocab_size)
    return CheckReport(result, plan)


# ---------------------------------------------------------------- plans and the pre-flight


def sized_plan(
    config: LayerConfig,
    seq_len: int,
    batch: int,
    context_len: int | None = None,
    model: ModelDescription | None = None,
) -> Plan:
    """The plan ``shapes``, ``memory`` and ``check`` evaluate: no text, so no padding."""
    if model is not None:  # block 0 of the model stands for every block: they are alike
        return plan_for(config, seq_len, batch, model.vocab_size, config.device, model=model)
    vocab = vocab_size(config.tokenizer, seq_len + (context_len or 0))
    return plan_for(config, seq_len, batch, vocab, config.device, context_len=context_len)
