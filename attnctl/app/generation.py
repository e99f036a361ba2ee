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

from attnctl.app.calls import (
    estimate_of,
    generate_tokens,
    generation_weight_bytes,
    kv_cache_of,
    plan_for,
)
from attnctl.app.inputs import choose_blocks, read_texts
from attnctl.app.requests import Hooks, RunRequest
from attnctl.errors import AttnctlError
from attnctl.memory.estimate import MemoryEstimate
from attnctl.model.config import LARGEST_SIZE, LayerConfig
from attnctl.model.describe import ModelDescription
from attnctl.report.generation import (
    GenerationReport,
    GenerationRun,
    generation_report,
)
from attnctl.stages.plan import Plan
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


def check_digits(digits: int) -> None:
    """--digits: refused outside 0–8."""
    if not 0 <= digits <= 8:
        raise AttnctlError(f"--digits must be between 0 and 8, got {digits}")


def shown_heads(request: RunRequest, count: int, every_block: bool) -> tuple[list[int], list[int]]:
    """Every head the run keeps (of ``count``), and the heads whose tables are printed."""
    all_heads = list(choose_heads(request.heads, count))
    heads_shown = all_heads
    if not request.heads and not request.every_weight and not every_block:
        heads_shown = all_heads[:DEFAULT_HEADS_SHOWN]  # tables printed; rows averaged over all
    return all_heads, heads_shown


def heads_not_shown(
    request: RunRequest, count: int, every_block: bool, heads_shown: list[int]
) -> tuple[int, int] | None:
    """The first and last head of ``count`` left out of the tables; None: every one shown."""
    if not request.heads and not every_block and count > len(heads_shown):
        return (len(heads_shown), count - 1)
    return None


def own_tokenizer_present(layer: LayerConfig, model: ModelDescription) -> None:
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
    own_tokenizer_present(layer, model)
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
    check_digits(request.digits)
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
    all_heads, heads_shown = shown_heads(request, layer.heads, every_block)
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
    generated_tokens = [tokens_of(ids, row) for ids, row in zip(run.generated, pieces, strict=True)]
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
    hidden = heads_not_shown(request, layer.heads, every_block, heads_shown)
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


def tokens_of(ids: list[int], pieces: list[str]) -> list[Token]:
    """The generated tokens with their text and its span in the generated text."""
    tokens, start = [], 0
    for token_id, piece in zip(ids, pieces, strict=True):
        tokens.append(Token(token_id, piece, start, start + len(piece)))
        start += len(piece)
    return tokens
