"""``run`` on an encoder–decoder (Marian, BART, T5): the source encoded, the target
generated step by step, all three attentions of the blocks shown, and the alignment of each
generated word to the source."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence

from attnctl.app.calls import (
    cross_kv_cache_of,
    estimate_of,
    kv_cache_of,
    plan_for,
    seq2seq_plans_of,
    translate_tokens,
)
from attnctl.app.generation import (
    PYTHON_FLOAT_BYTES,
    check_digits,
    check_new_tokens,
    heads_not_shown,
    in_vocabulary,
    own_tokenizer_present,
    shown_heads,
    tokens_of,
)
from attnctl.app.inputs import read_texts
from attnctl.app.requests import Hooks, RunRequest
from attnctl.errors import AttnctlError
from attnctl.model.config import LayerConfig
from attnctl.model.describe import Generation, ModelDescription
from attnctl.report.commands import Seq2SeqDtypeRow
from attnctl.report.generation import (
    GenerationStep,
    TranslationReport,
    TranslationRun,
    TranslationView,
    alignment_of,
    stop_reason,
)
from attnctl.stages.plan import Plan
from attnctl.stats import head_stats
from attnctl.text.tokenize import (
    Batch,
    decode_pieces,
    decode_texts,
    encode_batch,
)
from attnctl.trace import Token, Trace

DEFAULT_TRANSLATION_TOKENS = 20  # an encoder–decoder's --generate when not given


def _check_translation_request(
    request: RunRequest, model: ModelDescription, new_tokens: int
) -> Generation:
    """The options an encoder–decoder's run takes, and its decoder's rules (with a start
    token), or one line why not."""
    decoder = model.decoder
    check_new_tokens(new_tokens)
    check_digits(request.digits)
    if request.rows:
        raise AttnctlError("--rows does not apply to an encoder–decoder: every row is shown")
    if request.contexts or request.context_file is not None:
        raise AttnctlError(
            f"{model.name} reads its own encoder's output as the context: leave out --context"
        )
    if request.layer.options.get("impl") not in (None, "auto", "math"):
        raise AttnctlError(
            "an encoder–decoder's generation keeps every weight: it runs the math path; "
            f"leave out --impl {request.layer.options['impl']}"
        )
    rules = decoder.generation
    if rules is not None and rules.problem:
        raise AttnctlError(rules.problem)
    if rules is None or rules.start_id is None:
        raise AttnctlError(
            f"{model.path} names no decoder_start_token_id (config.json or "
            "generation_config.json): the decoder has no first token"
        )
    target_limit = decoder.longest_input()
    if target_limit is not None and new_tokens + 1 > target_limit:
        raise AttnctlError(
            f"--generate {new_tokens} does not fit: {model.name}'s decoder takes at most "
            f"{target_limit} positions ({decoder.embeddings.limited_by}), its start token "
            "included"
        )
    return rules


def _translation_blocks(request: RunRequest, model: ModelDescription) -> tuple[bool, int, int]:
    """Whether --layer all, and the encoder's and the decoder's block shown."""
    if request.encoder_block is not None and request.encoder_block.strip().lower() == "all":
        raise AttnctlError("--encoder-layer takes a block number; --layer all shows every block")
    every_block = request.block is not None and request.block.strip().lower() == "all"
    if every_block and request.encoder_block is not None:
        raise AttnctlError(
            "--layer all shows every block of both stacks: leave out --encoder-layer"
        )  # --layer all: every block of both stacks
    # --layer N: decoder block N and encoder block N (--encoder-layer: another); default
    # each stack's last block
    layer_spec = None if every_block else request.block
    decoder_block = _one_block(layer_spec, model.decoder, "--layer", "decoder")
    encoder_spec, option = layer_spec, "--layer"
    if request.encoder_block is not None and not every_block:
        encoder_spec, option = request.encoder_block, "--encoder-layer"
    encoder_block = _one_block(encoder_spec, model, option, "encoder")
    return every_block, encoder_block, decoder_block


def _source_batch(texts: list[str], layer: LayerConfig, model: ModelDescription) -> Batch:
    """The source texts tokenized (a padded batch), fitting the encoder's positions and in
    the model's vocabulary."""
    own_tokenizer_present(layer, model)
    batch = encode_batch(texts, layer.tokenizer)
    source_limit = model.longest_input()
    if source_limit is not None and batch.seq_len > source_limit:
        raise AttnctlError(
            f"the source is {batch.seq_len} tokens: {model.name} takes at most {source_limit} "
            f"({model.embeddings.limited_by}); give a shorter text"
        )
    in_vocabulary(batch, model)
    return batch


def _translation_cache_bytes(decoder_plan: Plan, layers: int, source: int, target: int) -> int:
    """The decoder's K and V over ``target`` positions, and cross-attention's."""
    groups = kv_cache_of(decoder_plan, target, layers)
    return sum(g.bytes for g in groups + cross_kv_cache_of(decoder_plan, source))


def _translation_need(
    request: RunRequest,
    layer: LayerConfig,
    model: ModelDescription,
    batch: Batch,
    plans: tuple[Plan, Plan],
    rows: int,
    target_len: int,
    heads: int,
    every_block: bool,
    cache_bytes: Callable[[int], int],
) -> int:
    """The bytes the pre-flight asks for: the weights, the larger peak, both caches, the
    three attentions kept (and as Python floats), the logits, and --save's stages."""
    from attnctl.app.preflight import kept_stage_bytes

    decoder = model.decoder
    encoder_plan, decoder_plan = plans
    source_len = batch.seq_len
    kept = rows * heads * (source_len + target_len) ** 2  # the three, (B, h, L, L)
    if every_block:
        kept *= max(model.layers, decoder.layers)
    per_weight = 4 + PYTHON_FLOAT_BYTES  # as computed, then as Python floats
    logits = rows * decoder.vocab_size * 4 * 2
    peaks = max(
        estimate_of(encoder_plan).peak_activation_bytes,
        estimate_of(decoder_plan).peak_activation_bytes,  # the whole target at once: above
    )  # a step's
    need = encoder_plan.parameter_bytes + peaks + cache_bytes(target_len)
    need += kept * per_weight + logits
    keep_stages = request.save is not None
    if keep_stages:  # --save: every encoder block's stages, every decoder block's
        need += kept_stage_bytes(
            [
                plan_for(layer, source_len, rows, model.vocab_size, padded=batch.padded,
                         model=model, layer_index=n)
                for n in range(model.layers)
            ]
        ) + kept_stage_bytes(
            [
                plan_for(layer, target_len, rows, decoder.vocab_size, padded=batch.padded,
                         context_len=source_len, model=decoder, layer_index=n)
                for n in range(decoder.layers)
            ]
        )  # fmt: skip
    return need


def translation_use_case(
    request: RunRequest,
    layer: LayerConfig,
    model: ModelDescription,
    hooks: Hooks,
) -> TranslationReport:
    """An encoder–decoder: encode the texts (a padded batch), generate greedily from the
    decoder's start token, and report the three attentions of the blocks chosen."""
    from attnctl.app.preflight import preflight

    decoder = model.decoder
    new_tokens = DEFAULT_TRANSLATION_TOKENS if request.generate is None else request.generate
    rules = _check_translation_request(request, model, new_tokens)
    every_block, encoder_block, decoder_block = _translation_blocks(request, model)
    texts = read_texts(request.texts, request.file)
    batch = _source_batch(texts, layer, model)
    heads_count = min(model.heads, decoder.heads)
    all_heads, heads_shown = shown_heads(request, heads_count, every_block)
    layer = dataclasses.replace(layer, impl="math")
    rows, source_len, target_len = len(texts), batch.seq_len, new_tokens + 1
    # the encoder block over the source, the decoder block over the whole target at once
    encoder_plan, decoder_plan = seq2seq_plans_of(
        model, layer, source_len, target_len, rows, batch.padded, encoder_block, decoder_block
    )
    # the decoder's K and V, and cross-attention's
    cache_bytes = functools.partial(
        _translation_cache_bytes, decoder_plan, decoder.layers, source_len
    )
    need = _translation_need(
        request, layer, model, batch, (encoder_plan, decoder_plan), rows, target_len,
        len(all_heads), every_block, cache_bytes,
    )  # fmt: skip
    keep_stages = request.save is not None
    preflight(encoder_plan, need, request.force, hooks, blocks=model.layers + decoder.layers)
    pad = rules.pad_id if rules.pad_id is not None else batch.pad_id
    padded = [[t.id for t in row] + [pad] * (source_len - len(row)) for row in batch.rows]
    with hooks.progress(f"translating with {model.name}: up to {new_tokens} tokens"):
        run = translate_tokens(
            model,
            layer,
            padded,
            [len(row) for row in batch.rows],
            new_tokens,
            encoder_block,
            decoder_block,
            all_heads,
            every_block,
            keep_stages,
        )
    return _translation_report(
        request, model, layer, texts, batch, run, new_tokens, pad, encoder_plan, cache_bytes,
        (encoder_block, decoder_block), (all_heads, heads_shown), every_block,
    )  # fmt: skip


def _translation_report(
    request: RunRequest,
    model: ModelDescription,
    layer: LayerConfig,
    texts: list[str],
    batch: Batch,
    run: TranslationRun,
    new_tokens: int,
    pad: int,
    encoder_plan: Plan,
    cache_bytes: Callable[[int], int],
    blocks: tuple[int, int],
    heads: tuple[list[int], list[int]],
    every_block: bool,
) -> TranslationReport:
    """The report of a run: each step, the three attentions and their alignment, the
    statistics, and the memory of the target the run made."""
    rules = model.decoder.generation
    all_heads, heads_shown = heads
    targets = [[rules.start_id, *row] for row in run.generated]
    pieces = decode_pieces(targets, layer.tokenizer)
    target_tokens = [tokens_of(ids, row) for ids, row in zip(targets, pieces, strict=True)]
    steps = _translation_steps(run, pieces, cache_bytes)
    source_tokens = _source_tokens(batch, pad)
    view = _translation_view(
        run, source_tokens, target_tokens, targets, batch, blocks, all_heads, rules.eos_ids
    )
    fed = len(targets[0])
    cross_trace, block_traces, block_stats, shown_stats = _translation_traces(
        run, batch, all_heads, source_tokens, target_tokens, blocks
    )
    heads_count = min(model.heads, model.decoder.heads)
    hidden = heads_not_shown(request, heads_count, every_block, heads_shown)
    final_decoder_plan, memory = _final_memory(model, layer, batch, fed, blocks)
    return TranslationReport(
        kept_stages=run.kept_stages,
        texts=texts,
        model=model,
        dtype=layer.dtype,
        tokenizer=batch.name,
        vocab_size=batch.vocab_size,
        device=run.device,
        steps=steps,
        view=view,
        cross_trace=cross_trace,
        generated_texts=decode_texts(
            run.generated, layer.tokenizer, [[rules.start_id]] * len(texts)
        ),
        heads=heads_shown,
        digits=request.digits,
        stop=stop_reason(run.generated, rules.eos_ids, new_tokens, rules.forced_eos_id),
        requested=new_tokens,
        final_cache_shapes=run.final_cache_shapes,
        final_estimated_bytes=cache_bytes(fed),
        encoder_plan=encoder_plan,
        decoder_plan=final_decoder_plan,
        memory=memory,
        final_measured_bytes=run.final_measured_bytes,
        heads_not_shown=hidden,
        block_traces=block_traces,
        block_stats=block_stats,
        shown_stats=shown_stats,
    )


def _translation_steps(
    run: TranslationRun, pieces: list[list[str]], cache_bytes: Callable[[int], int]
) -> list[GenerationStep]:
    """Each step with the texts of the tokens it chose and the cache it held, estimated."""
    return [
        dataclasses.replace(
            step,
            texts=[row[step.position] for row in pieces],
            estimated_bytes=cache_bytes(step.position),
        )
        for step in run.steps
    ]


def _source_tokens(batch: Batch, pad: int) -> list[list[Token]]:
    """The source's tokens as the encoder read them: each text padded on the right, the
    padding marked."""
    return [
        row + [Token(pad, "<pad>", -1, -1, pad=True)] * (batch.seq_len - len(row))
        for row in batch.rows
    ]


def _translation_view(
    run: TranslationRun,
    source_tokens: list[list[Token]],
    target_tokens: list[list[Token]],
    targets: list[list[int]],
    batch: Batch,
    blocks: tuple[int, int],
    heads: list[int],
    eos_ids: Sequence[int],
) -> TranslationView:
    """The three attentions of the blocks shown, and the alignment of their
    cross-attention averaged over ``heads`` (ended at ``eos_ids``)."""
    encoder_block, decoder_block = blocks
    matrix, alignment = alignment_of(
        run.cross_attention,
        heads,
        heads,
        targets,
        [len(row) for row in batch.rows],
        eos_ids,
    )
    return TranslationView(
        source_tokens=source_tokens,
        target_tokens=target_tokens,
        encoder_block=encoder_block,
        decoder_block=decoder_block,
        heads=heads,
        encoder_attention=run.encoder_attention,
        decoder_attention=run.decoder_attention,
        cross_attention=run.cross_attention,
        averaged_heads=heads,
        alignment_matrix=matrix,
        alignment=alignment,
    )


def _weights_trace(
    heads: list[int],
    device: str,
    batch: Batch,
    queries: list[list[Token]],
    weights: list,
    block: int,
    context: list[list[Token]] | None = None,
    top: Iterable = (),
    sums: object = None,
) -> Trace:
    """One attention's weights (every row, every head) as a Trace: what the tables,
    heatmaps and statistics read."""
    return Trace(
        tokens=queries,
        stages=[],
        attention=weights,
        attention_heads=heads,
        attention_rows=list(range(len(queries[0]))),
        top_keys=list(top),
        device=device,
        tokenizer=batch.name,
        vocab_size=batch.vocab_size,
        impl="math",
        context_tokens=context,
        layer=block,
        sums=sums,
    )


def _translation_traces(
    run: TranslationRun,
    batch: Batch,
    heads: list[int],
    source_tokens: list[list[Token]],
    target_tokens: list[list[Token]],
    blocks: tuple[int, int],
) -> tuple[Trace, dict[str, list[Trace]], dict[str, list], dict[str, object]]:
    """The cross-attention's Trace, every block's (--layer all) of each kind with their
    statistics, and the statistics of the three attentions of the blocks shown."""
    encoder_block, decoder_block = blocks
    trace_of = functools.partial(_weights_trace, heads, run.device, batch)
    weights, top, sums = run.cross_window
    cross_trace = trace_of(target_tokens, weights, decoder_block, source_tokens, top, sums)
    block_traces: dict[str, list[Trace]] = {}
    for kind, windows in run.block_windows.items():
        queries = source_tokens if kind == "encoder" else target_tokens
        context = source_tokens if kind == "cross" else None
        block_traces[kind] = [
            trace_of(queries, weights, block, context, top, sums)
            for block, (weights, top, sums) in sorted(windows.items())
        ]
    block_stats = {
        kind: [head_stats(trace) for trace in traces] for kind, traces in block_traces.items()
    }
    # the statistics of the three attentions of the blocks shown, over the whole target
    shown_stats = {
        "encoder": head_stats(trace_of(source_tokens, run.encoder_attention, encoder_block)),
        "decoder": head_stats(trace_of(target_tokens, run.decoder_attention, decoder_block)),
        "cross": head_stats(cross_trace),
    }
    return cross_trace, block_traces, block_stats, shown_stats


def _final_memory(
    model: ModelDescription, layer: LayerConfig, batch: Batch, fed: int, blocks: tuple[int, int]
) -> tuple[Plan, Seq2SeqDtypeRow]:
    """The decoder block's plan and the run's memory, planned again for the ``fed`` target
    positions the run made (an early end makes it shorter)."""
    encoder_block, decoder_block = blocks
    rows, source_len = len(batch.rows), batch.seq_len
    final_decoder_plan = seq2seq_plans_of(
        model, layer, source_len, fed, rows, batch.padded, encoder_block, decoder_block
    )[1]
    memory = _seq2seq_memory(model, layer, source_len, fed, rows, batch.padded)
    return final_decoder_plan, memory


def _seq2seq_memory(
    model: ModelDescription, layer: LayerConfig, source: int, target: int, rows: int, padded: bool
) -> Seq2SeqDtypeRow:
    """The run's lengths as memory --src-len S --tgt-len T figures them: the weights, block
    0's peaks (T5's first block also computes the position bias: the largest) and both
    caches of every block."""
    encoder_plan, decoder_plan = seq2seq_plans_of(model, layer, source, target, rows, padded, 0, 0)
    self_groups = kv_cache_of(decoder_plan, target, model.decoder.layers)
    return Seq2SeqDtypeRow(
        parameter_bytes=encoder_plan.parameter_bytes,  # every weight of the checkpoint
        encoder=estimate_of(encoder_plan),
        decoder=estimate_of(decoder_plan),
        kv_cache_bytes=sum(g.bytes for g in self_groups),
        cross_kv_cache_bytes=sum(g.bytes for g in cross_kv_cache_of(decoder_plan, source)),
    )


def _one_block(spec: str | None, stack: ModelDescription, option: str, what: str) -> int:
    """A block of the decoder or the encoder (``what``) as --layer N or --encoder-layer N
    gives it; None: the stack's last (--layer all is read before)."""
    if spec is None:
        return stack.layers - 1
    try:
        number = int(spec)
    except ValueError:
        allowed = "a block number or 'all'" if option == "--layer" else "a block number"
        raise AttnctlError(f"{option} must be {allowed}, got {spec!r}") from None
    if not -stack.layers <= number < stack.layers:
        other = " (--encoder-layer picks the encoder's)" if option == "--layer" else ""
        raise AttnctlError(
            f"{option} {number} is out of range: the {what} has {stack.layers} "
            f"block{'s' * (stack.layers != 1)} "
            f"(0–{stack.layers - 1}, or -1 for the last){other}"
        )
    return number % stack.layers
