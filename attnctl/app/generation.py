"""Greedy decoding, step by step: ``run TEXT --model DIR --generate N`` on a decoder-only
model (:func:`generation_use_case`), and ``run`` on an encoder–decoder, which always
generates (:func:`translation_use_case`).

Every refusal comes before anything is allocated: the model must have a causal LM head
(or a decoder start token) and usable generation rules, the prompt and N must fit its
positions, a decoder-only model's texts must be of one length (a batch is padded on the
right, and a decoder would generate after the padding; an encoder–decoder masks its
padded source), and the memory the whole run needs (weights, the caches and the kept
weights) must be free. Then ``app/calls.generate_tokens`` (``translate_tokens``) decodes,
and the report says what each step chose and what its cache held.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence

from attnctl.app.calls import (
    cross_kv_cache_of,
    estimate_of,
    generate_tokens,
    generation_weight_bytes,
    kv_cache_of,
    plan_for,
    seq2seq_plans_of,
    translate_tokens,
)
from attnctl.app.inputs import choose_blocks, read_texts
from attnctl.app.requests import Hooks, RunRequest
from attnctl.errors import AttnctlError
from attnctl.memory.estimate import MemoryEstimate
from attnctl.model.config import LARGEST_SIZE, LayerConfig
from attnctl.model.describe import Generation, ModelDescription
from attnctl.report.commands import Seq2SeqDtypeRow
from attnctl.report.generation import (
    GenerationReport,
    GenerationRun,
    GenerationStep,
    TranslationReport,
    TranslationRun,
    TranslationView,
    alignment_of,
    generation_report,
    stop_reason,
)
from attnctl.stages.plan import Plan
from attnctl.stats import head_stats
from attnctl.text.tokenize import (
    Batch,
    decode_pieces,
    decode_texts,
    encode_batch,
    missing_tokenizer,
)
from attnctl.trace import Token, Trace
from attnctl.window import DEFAULT_HEADS_SHOWN, choose_heads

PYTHON_FLOAT_BYTES = 36  # a weight kept for --json: a Python float and its list slot


def in_vocabulary(batch: Batch, model: ModelDescription) -> None:
    largest = max(t.id for row in batch.rows for t in row)
    if largest >= model.vocab_size:
        raise AttnctlError(
            f"token id {largest} is outside the model's vocabulary of {model.vocab_size}: "
            "is this tokenizer the model's own?"
        )


def check_new_tokens(new_tokens: int) -> None:
    if new_tokens < 1:
        raise AttnctlError(f"--generate takes a number of new tokens >= 1, got {new_tokens}")
    if new_tokens >= LARGEST_SIZE:
        raise AttnctlError(
            f"--generate must be below 2^63 (torch's largest size), got {new_tokens}"
        )


def check_generation_request(
    request: RunRequest, model: ModelDescription | None, new_tokens: int
) -> ModelDescription:
    """The options and the model that generation can take, or one line why not."""
    if model is None:
        raise AttnctlError(
            "--generate needs a pretrained model with an LM head: give --model DIR "
            "(attnctl's seeded layer has no vocabulary head)"
        )
    check_new_tokens(new_tokens)
    if request.rows:
        raise AttnctlError(
            "--rows does not apply to --generate: every row of the final sequence is shown"
        )
    if request.contexts or request.context_file is not None:
        raise AttnctlError(f"{model.name} has no cross-attention: leave out --context")
    if request.layer.options.get("impl") not in (None, "auto", "math"):
        raise AttnctlError(
            "--generate keeps every weight of every step: it runs the math path; leave out "
            f"--impl {request.layer.options['impl']}"
        )
    if model.head is None:
        if model.config.mask != "causal":
            raise AttnctlError(
                f"{model.name} is an encoder-only model (no causal mask, no LM head): "
                "it does not generate text; leave out --generate"
            )
        raise AttnctlError(
            f"{model.path} holds no LM head (lm_head.weight, and config.json does not tie "
            "it to the token embedding): a base model saved without its head cannot generate"
        )
    if model.generation is not None and model.generation.problem:
        raise AttnctlError(model.generation.problem)
    return model


def positions_limit(model: ModelDescription) -> int | None:
    """The most positions the model takes (its learned positions); None: no limit (RoPE,
    ALiBi: transformers generates past max_position_embeddings too)."""
    return model.longest_input()


def equal_lengths(batch: Batch) -> None:
    lengths = sorted({len(row) for row in batch.rows})
    if len(lengths) > 1:
        raise AttnctlError(
            f"the texts are {', '.join(map(str, lengths))} tokens long: a batch is padded on "
            "the right, and a decoder would generate after the padding; give one text, or "
            "texts of one length"
        )


def _check_digits(digits: int) -> None:
    """--digits: refused outside 0–8."""
    if not 0 <= digits <= 8:
        raise AttnctlError(f"--digits must be between 0 and 8, got {digits}")


def _shown_heads(request: RunRequest, count: int, every_block: bool) -> tuple[list[int], list[int]]:
    """Every head the run keeps (of ``count``), and the heads whose tables are printed."""
    all_heads = list(choose_heads(request.heads, count))
    heads_shown = all_heads
    if not request.heads and not request.every_weight and not every_block:
        heads_shown = all_heads[:DEFAULT_HEADS_SHOWN]  # tables printed; rows averaged over all
    return all_heads, heads_shown


def _heads_not_shown(
    request: RunRequest, count: int, every_block: bool, heads_shown: list[int]
) -> tuple[int, int] | None:
    """The first and last head of ``count`` left out of the tables; None: every one shown."""
    if not request.heads and not every_block and count > len(heads_shown):
        return (len(heads_shown), count - 1)
    return None


def _own_tokenizer_present(layer: LayerConfig, model: ModelDescription) -> None:
    """The model's own tokenizer.json, when the layer reads it, must be in its folder."""
    own_tokenizer = model.path / "tokenizer.json"
    if layer.tokenizer == str(own_tokenizer) and not own_tokenizer.is_file():
        raise AttnctlError(missing_tokenizer(model.path))


def _generation_blocks(request: RunRequest, model: ModelDescription) -> tuple[list[int], bool]:
    """The blocks whose weights are kept (default: the last), and whether --layer all."""
    chosen = choose_blocks(request.block, model)
    every_block = chosen is not None and len(chosen) > 1
    blocks = chosen if request.block is not None and chosen else [model.layers - 1]
    return blocks, every_block


def _prompt_batch(
    texts: list[str],
    layer: LayerConfig,
    model: ModelDescription,
    new_tokens: int,
    limit: int | None,
) -> Batch:
    """The prompts tokenized: of one length, fitting the positions with ``new_tokens``
    after them, and in the model's vocabulary."""
    _own_tokenizer_present(layer, model)
    batch = encode_batch(texts, layer.tokenizer)
    equal_lengths(batch)
    prompt_len = batch.seq_len
    total = prompt_len + new_tokens
    if limit is not None and total > limit:
        room = (
            f"generate at most {limit - prompt_len}"
            if prompt_len < limit
            else "the prompt alone fills them"
        )
        raise AttnctlError(
            f"the prompt's {prompt_len} tokens and --generate {new_tokens} make {total} "
            f"positions: {model.name} takes at most {limit} "
            f"({model.embeddings.limited_by}); {room}"
        )
    in_vocabulary(batch, model)
    return batch


def _generation_need(
    request: RunRequest,
    layer: LayerConfig,
    model: ModelDescription,
    plan: Plan,
    memory: MemoryEstimate,
    rows: int,
    heads: int,
    blocks: int,
    total: int,
) -> int:
    """The bytes the pre-flight asks for: the weights, the prefill's peak, the cache of
    ``total`` tokens, the weights kept and their copy, the logits, and --save's stages."""
    from attnctl.app.preflight import kept_stage_bytes

    prompt_len = plan.seq_len
    cache = sum(group.bytes for group in kv_cache_of(plan, total, model.layers))
    kept = rows * heads * total * total * blocks  # weights kept, (B, h, T, T)
    per_weight = 4 + (PYTHON_FLOAT_BYTES if request.every_weight else 0)
    logits = rows * model.vocab_size * 4 * 2  # float32 logits and the rules' copy
    need = (
        generation_weight_bytes(model, layer.dtype)
        + memory.peak_activation_bytes
        + cache
        + kept * (4 + per_weight)  # the rows as computed, then the report's copy
        + logits
    )
    keep_stages = request.save is not None
    if keep_stages:  # --save: a copy of every block's stages in the prefill stays alive
        need += kept_stage_bytes(
            [
                plan_for(layer, prompt_len, rows, model.vocab_size, model=model, layer_index=n)
                for n in range(model.layers)
            ]
        )
    return need


def generation_use_case(
    request: RunRequest,
    layer: LayerConfig,
    model: ModelDescription | None,
    hooks: Hooks,
) -> GenerationReport:
    """Check, tokenize, pre-flight, decode, report."""
    from attnctl.app.preflight import preflight

    new_tokens = request.generate if request.generate is not None else 0
    model = check_generation_request(request, model, new_tokens)
    _check_digits(request.digits)
    limit = positions_limit(model)
    if limit is not None and new_tokens >= limit:  # before any text is read
        raise AttnctlError(
            f"--generate {new_tokens} does not fit: {model.name} takes at most {limit} "
            f"positions ({model.embeddings.limited_by}), prompt included"
        )
    blocks, every_block = _generation_blocks(request, model)
    cache_block = blocks[-1]  # --layer all: the last block's row and cache in the steps
    texts = read_texts(request.texts, request.file)
    batch = _prompt_batch(texts, layer, model, new_tokens, limit)
    prompt_len = batch.seq_len
    all_heads, heads_shown = _shown_heads(request, layer.heads, every_block)
    layer = dataclasses.replace(layer, impl="math")  # generation keeps every weight
    rows = len(texts)
    # the prefill's plan: the steps after it read one query row each
    plan = plan_for(layer, prompt_len, rows, model.vocab_size, model=model, layer_index=blocks[0])
    memory = estimate_of(plan)
    total = prompt_len + new_tokens
    need = _generation_need(
        request, layer, model, plan, memory, rows, len(all_heads), len(blocks), total
    )
    keep_stages = request.save is not None
    preflight(plan, need, request.force, hooks, blocks=model.layers)
    prompt_ids = [[t.id for t in row] for row in batch.rows]
    with hooks.progress(f"generating {new_tokens} tokens with {model.name}"):
        run = generate_tokens(
            model, layer, prompt_ids, new_tokens, blocks, all_heads, cache_block, all_heads,
            keep_stages,
        )  # fmt: skip
    return _generation_report(
        request, model, layer, texts, batch, plan, memory, run, prompt_ids, new_tokens,
        blocks, (all_heads, heads_shown), every_block,
    )  # fmt: skip


def _generation_report(
    request: RunRequest,
    model: ModelDescription,
    layer: LayerConfig,
    texts: list[str],
    batch: Batch,
    plan: Plan,
    memory: MemoryEstimate,
    run: GenerationRun,
    prompt_ids: list[list[int]],
    new_tokens: int,
    blocks: list[int],
    heads: tuple[list[int], list[int]],
    every_block: bool,
) -> GenerationReport:
    """The report of a run: each step's texts and estimated cache, a Trace per block."""
    all_heads, heads_shown = heads
    pieces = decode_pieces(run.generated, layer.tokenizer, prompt_ids)
    generated_tokens = [
        _generated_tokens(ids, row) for ids, row in zip(run.generated, pieces, strict=True)
    ]
    steps = [
        dataclasses.replace(
            step,
            texts=[row[step.step] for row in pieces],
            estimated_bytes=sum(g.bytes for g in kv_cache_of(plan, step.position, model.layers)),
        )
        for step in run.steps
    ]
    final_length = batch.seq_len + len(steps)
    kv_groups = kv_cache_of(plan, final_length, model.layers)
    sequences = [p + g for p, g in zip(batch.rows, generated_tokens, strict=True)]
    traces = _generation_traces(run, batch, sequences, all_heads, blocks, final_length)
    hidden = _heads_not_shown(request, layer.heads, every_block, heads_shown)
    eos = model.generation.eos_ids if model.generation else ()
    return generation_report(
        texts=texts,
        plan=plan,
        estimate=memory,
        prompt_tokens=batch.rows,
        generated_tokens=generated_tokens,
        generated_texts=decode_texts(run.generated, layer.tokenizer, prompt_ids),
        run=run,
        steps=steps,
        traces=traces,
        blocks=blocks,
        cache_block=blocks[-1],
        heads=heads_shown,
        averaged_heads=all_heads,
        digits=request.digits,
        every_block=every_block,
        eos_ids=eos,
        requested=new_tokens,
        forced_eos=model.generation.forced_eos_id if model.generation else None,
        final_estimated_bytes=sum(g.bytes for g in kv_groups),
        kv_groups=kv_groups,
        windows=[block.attention.window for block in model.blocks],
        heads_not_shown=hidden,
    )


def _generation_traces(
    run: GenerationRun,
    batch: Batch,
    sequences: list[list[Token]],
    heads: list[int],
    blocks: list[int],
    final_length: int,
) -> list[Trace]:
    """One Trace per block shown: its weights over the final sequence, every row."""
    return [
        Trace(
            tokens=sequences,
            stages=[],
            attention=run.attention[block][0],
            attention_heads=heads,
            attention_rows=list(range(final_length)),
            top_keys=run.attention[block][1],
            device=run.device,
            tokenizer=batch.name,
            vocab_size=batch.vocab_size,
            impl="math",
            layer=block,
            sums=run.attention[block][2],
        )
        for block in blocks
    ]


def _generated_tokens(ids: list[int], pieces: list[str]) -> list[Token]:
    """The generated tokens with their text and its span in the generated text."""
    tokens, start = [], 0
    for token_id, piece in zip(ids, pieces, strict=True):
        tokens.append(Token(token_id, piece, start, start + len(piece)))
        start += len(piece)
    return tokens


DEFAULT_TRANSLATION_TOKENS = 20  # an encoder–decoder's --generate when not given


def _check_translation_request(
    request: RunRequest, model: ModelDescription, new_tokens: int
) -> Generation:
    """The options an encoder–decoder's run takes, and its decoder's rules (with a start
    token), or one line why not."""
    decoder = model.decoder
    check_new_tokens(new_tokens)
    _check_digits(request.digits)
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
    _own_tokenizer_present(layer, model)
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
    all_heads, heads_shown = _shown_heads(request, heads_count, every_block)
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
    target_tokens = [_generated_tokens(ids, row) for ids, row in zip(targets, pieces, strict=True)]
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
    hidden = _heads_not_shown(request, heads_count, every_block, heads_shown)
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
