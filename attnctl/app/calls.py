"""The computation's entry points: every call the use cases make into model, plan, memory,
training, runner, measure and check goes through one function here, so a change of their
signatures stays in this file. torch-importing modules are imported inside the functions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from attnctl.memory.estimate import (
    KVCacheGroup,
    MemoryEstimate,
    cross_kv_cache_groups,
    estimate,
    kv_cache_groups,
)
from attnctl.model.config import DTYPE_BYTES, LayerConfig
from attnctl.model.describe import ModelDescription
from attnctl.model.families import read_model
from attnctl.stages.plan import Plan, build_plan, build_seq2seq_plans
from attnctl.text.tokenize import Batch

if TYPE_CHECKING:  # they import torch (the replay: only --train needs it)
    from attnctl.nn.check import CheckResult
    from attnctl.replay.step import TrainingEstimate
    from attnctl.trace import Trace


if TYPE_CHECKING:  # generation's report types: imported by the calls that make them
    from attnctl.report.generation import GenerationRun, GenerationStep, TranslationRun
    from attnctl.trace import KeptStages


def load_model(directory: str) -> ModelDescription:
    return read_model(directory)


def model_layer(model: ModelDescription, options: dict[str, Any]) -> LayerConfig:
    """The layer a model's config.json sets, with the options that still apply to it."""
    return model.layer_config(**options)


def model_weight_bytes(model: ModelDescription, blocks: int, dtype: str) -> int:
    """The bytes of the weights a run up to ``blocks`` blocks loads."""
    return model.loaded_values(blocks) * DTYPE_BYTES[dtype]


def plan_for(
    config: LayerConfig,
    seq_len: int,
    batch: int,
    vocab: int,
    device: str = "",
    *,
    padded: bool = False,
    context_len: int | None = None,
    model: ModelDescription | None = None,
    layer_index: int = 0,
) -> Plan:
    return build_plan(
        config,
        seq_len,
        batch,
        vocab,
        device or config.device,  # the one device, resolved by the use case
        padded=padded,
        context_len=context_len,
        model=model,
        layer_index=layer_index,
    )


def estimate_of(plan: Plan, layers: int = 1) -> MemoryEstimate:
    return estimate(plan, layers)


def training_estimate_of(plan: Plan, layers: int) -> TrainingEstimate:
    from attnctl.replay.step import estimate_training  # only --train loads the replay

    return estimate_training(plan, layers)


def kv_cache_of(plan: Plan, tokens: int, layers: int) -> list[KVCacheGroup]:
    return kv_cache_groups(plan, tokens, layers)


def device_of(spec: str) -> Any:
    from attnctl.nn.layer import resolve_device

    return resolve_device(spec)


def padding_mask_needed(keys: Batch, layer: LayerConfig) -> bool:
    from attnctl.nn.runner import needs_padding_mask

    return needs_padding_mask(keys, layer)


@contextlib.contextmanager
def device_errors_of(device_spec: str) -> Iterator[None]:
    from attnctl.nn.runner import device_errors

    with device_errors(device_spec):
        yield


def run_traces(
    batch: Batch,
    layer: LayerConfig,
    heads: list[int],
    query_rows: list[int],
    cross: Batch | None,
    model: ModelDescription | None,
    blocks: list[int] | None,
    keep_stages: bool = False,
) -> list[Trace]:
    """attnctl's layer on the batch (one trace), or a model's blocks (one trace each);
    ``keep_stages``: with a CPU copy of each recorded stage's tensor."""
    from attnctl.nn.runner import run

    with device_errors_of(layer.device):
        return run(
            batch, layer, model, blocks, heads, query_rows, context=cross, keep_stages=keep_stages
        )


def measure_peak(plan: Plan, model: ModelDescription | None, train: bool, layers: int = 1) -> Any:
    """A forward pass of the plan's model, or (``train``) a training step of its stack
    of ``layers`` blocks."""
    from attnctl.memory.measure import measure_forward, measure_training

    with device_errors_of(plan.config.device):
        if train:
            return measure_training(plan.config, plan, layers)
        return measure_forward(plan, layers)


def require_trained_weights(plan: Plan) -> None:
    from attnctl.memory.measure import require_trained_weights

    require_trained_weights(plan)


def measure_generated_cache_of(plan: Plan, new_tokens: int) -> int:
    """The K and V bytes after really generating ``new_tokens`` after the plan's prompt."""
    from attnctl.memory.measure import measure_generated_cache

    with device_errors_of(plan.config.device):
        return measure_generated_cache(plan, new_tokens)


def compare_implementations(
    layer: LayerConfig, batch: int, seq_len: int, vocab: int
) -> CheckResult:
    from attnctl.nn.check import run_check

    with device_errors_of(layer.device):
        return run_check(layer, batch, seq_len, vocab)


def generation_weight_bytes(model: ModelDescription, dtype: str) -> int:
    """The bytes of every block's weights, the final norm's and the LM head's."""
    values = model.loaded_values(model.layers)
    for entry in model.source.head_table:
        count = 1
        for n in entry.shape:
            count *= n
        values += count
    return values * DTYPE_BYTES[dtype]


def generate_tokens(
    model: ModelDescription,
    layer: LayerConfig,
    prompt_ids: list[list[int]],
    new_tokens: int,
    blocks: list[int],
    heads: list[int],
    cache_block: int,
    averaged_heads: list[int],
    keep_stages: bool = False,
) -> GenerationRun:
    """Greedy decoding of up to ``new_tokens`` after ``prompt_ids`` (B, L), of equal
    length, keeping ``heads``' weights in ``blocks``; each step's query row of
    ``cache_block`` averaged over ``averaged_heads`` (a subset of ``heads``) gives its
    strongest keys. Plain data back: lists and compact float32 rows. ``keep_stages``
    (``run --save``): a CPU copy of every block's stages in the prefill."""
    import torch

    from attnctl.nn.generate import greedy
    from attnctl.nn.layer import Recorder, resolve_device
    from attnctl.nn.runner import kept_stages_of, tune_allocator
    from attnctl.nn.weights import model_weights
    from attnctl.report.generation import GenerationRun

    device = resolve_device(layer.device)
    tune_allocator()
    run = model.with_run(layer)
    prompt_len = len(prompt_ids[0])
    records = {n: Recorder(keep=True) for n in range(run.layers)} if keep_stages else None
    with device_errors_of(layer.device), torch.inference_mode():
        weights = model_weights(run, layer, device, blocks=run.layers, head=True)
        ids = torch.tensor(prompt_ids, device=device)  # (B, L)
        decoded = greedy(
            run, weights.named, ids, new_tokens, shown=blocks, heads=heads,
            prefill_records=records,
        )  # fmt: skip
        del weights
        shown = decoded.attention[(cache_block, "attention")]  # (B, h, T, T)
        picked = [heads.index(h) for h in averaged_heads]
        mean = shown[:, picked].mean(dim=1)  # (B, T, T)
        queries = prompt_len - 1 + torch.arange(len(decoded.steps))  # (S,) rows that chose
        rows = mean[:, queries]  # (B, S, T)
        _top, top_weights, top_keys = _strongest_keys(rows)  # (B, S, K), held
        attention = _shown_blocks(decoded.attention, blocks, "attention", shown.shape[2], len(ids))
    eos = (run.generation.eos_ids if run.generation else ()) or ()
    windows = [block.attention.window for block in run.blocks]
    steps = _generation_steps(
        decoded.steps, len(prompt_ids), eos, windows, cache_block, top_keys, top_weights
    )
    return GenerationRun(
        generated=decoded.generated,
        steps=steps,
        attention=attention,
        final_cache_shapes=decoded.final_cache,
        final_measured_bytes=decoded.final_cache_bytes,
        device=str(device),
        kept_stages=[
            kept_stages_of(record, f"prefill.block.{n}.", f"block {n}'s stages in the prefill")
            for n, record in (records or {}).items()
        ],
    )


def _shown_blocks(
    attention: dict[tuple[int, str], Any], blocks: list[int], name: str, total: int, texts: int
) -> dict[int, tuple[list, list, object]]:
    """The weights (B, h, T, T) of ``name`` in each of ``blocks`` as a Trace holds them,
    every one of the ``total`` rows (``runner.shown_weights``)."""
    from attnctl.nn.runner import shown_weights

    return {
        block: shown_weights(attention[(block, name)], list(range(total)), [total] * texts)
        for block in blocks
    }


def _top_keys_at(
    top_keys: list[list[list[int]]], top_weights: list[list[list[float]]], number: int
) -> list[list[tuple[int, float]]]:
    """Step ``number``'s strongest keys in each text, with their weights (none of 0)."""
    return [
        [
            (key, weight)
            for key, weight in zip(keys[number], values[number], strict=True)
            if weight > 0
        ]
        for keys, values in zip(top_keys, top_weights, strict=True)
    ]


def _generation_steps(
    decoded_steps: list[Any],
    texts: int,
    eos: Sequence[int],
    windows: list[int | None],
    cache_block: int,
    top_keys: list[list[list[int]]],
    top_weights: list[list[list[float]]],
) -> list[GenerationStep]:
    """What each step chose and its cache held: the texts are decoded by the use case,
    the estimated bytes filled in by it; ``dropped``: positions out of a block's window."""
    from attnctl.report.generation import GenerationStep

    finished = [False] * texts
    steps = []
    for number, step in enumerate(decoded_steps):
        position = step.query_position + 1
        finished = [done or token in eos for done, token in zip(finished, step.tokens, strict=True)]
        kept = [shape.get("attention", (0, 0, 0))[2] for shape in step.cache]
        steps.append(
            GenerationStep(
                step=number,
                tokens=step.tokens,
                texts=[],
                position=position,
                finished=finished,
                cache_shapes=step.cache,
                estimated_bytes=0,
                measured_bytes=step.cache_bytes,
                dropped=[position - n if w else 0 for n, w in zip(kept, windows, strict=True)],
                top_keys=_top_keys_at(top_keys, top_weights, number),
                keys=kept[cache_block],
            )
        )
    return steps


def seq2seq_plans_of(
    model: ModelDescription,
    layer: LayerConfig,
    src_len: int,
    tgt_len: int,
    batch: int,
    padded: bool,
    encoder_block: int,
    decoder_block: int,
) -> tuple[Plan, Plan]:
    device = str(device_of(layer.device))  # "auto" as the run resolves it
    return build_seq2seq_plans(
        model, layer, src_len, tgt_len, batch, padded, encoder_block, decoder_block, device
    )


def cross_kv_cache_of(plan: Plan, tokens: int) -> list[KVCacheGroup]:
    return cross_kv_cache_groups(plan, tokens)


def translate_tokens(
    model: ModelDescription,
    layer: LayerConfig,
    source_ids: list[list[int]],
    source_lengths: list[int],
    new_tokens: int,
    encoder_block: int,
    decoder_block: int,
    heads: list[int],
    every_block: bool = False,
    keep_stages: bool = False,
) -> TranslationRun:
    """An encoder–decoder: encode the right-padded ``source_ids`` (B, Ls), then decode
    greedily from the start token up to ``new_tokens``, keeping ``heads``' weights of the
    encoder's ``encoder_block`` and the decoder's ``decoder_block``. Each step's strongest
    keys: its cross-attention row (the source tokens) averaged over ``heads``.
    ``every_block``: also every block's weights of each kind, as Traces hold them.
    ``keep_stages`` (``run --save``): a CPU copy of every encoder block's stages, and of
    every decoder block's in one more pass of the decoder (:func:`_teacher_forced_pass`)."""
    import torch

    from attnctl.nn.generate import decoder_weights, greedy
    from attnctl.nn.layer import resolve_device
    from attnctl.nn.runner import tune_allocator
    from attnctl.nn.weights import model_weights
    from attnctl.report.generation import TranslationRun

    device = resolve_device(layer.device)
    tune_allocator()
    run = model.with_run(layer)
    decoder = run.decoder
    rules = decoder.generation
    encoder_records, decoder_records = _translation_records(run, keep_stages)
    with device_errors_of(layer.device), torch.inference_mode():
        weights = model_weights(run, layer, device, blocks=None, head=True)
        encoder_shown = list(range(run.layers)) if every_block else [encoder_block]
        decoder_shown = list(range(decoder.layers)) if every_block else [decoder_block]
        # the source (B, Ls), its lengths (held), padding mask and the encoder's pass over it
        ids, _lengths, padding, key_padding, encoded = _encode_source(
            run, weights.named, source_ids, source_lengths, device, encoder_shown, heads,
            encoder_records,
        )  # fmt: skip
        start = torch.full((len(source_ids), 1), rules.start_id, device=device)  # (B, 1)
        decoded = greedy(
            decoder, decoder_weights(weights.named), start, new_tokens, shown=decoder_shown,
            heads=heads, encoder_output=encoded.output, encoder_padding=padding,
        )  # fmt: skip
        if keep_stages:  # the target as the steps fed it: the start token, then each chosen
            target = torch.tensor([[rules.start_id, *row] for row in decoded.generated])
            _teacher_forced_pass(decoder, weights.named, target, device, encoded.output,
                                 key_padding, decoder_records)  # fmt: skip
        del weights
        cross = decoded.attention[(decoder_block, "cross_attention")]  # (B, h, Lt, Ls)
        rows = cross[:, :, : len(decoded.steps)].mean(dim=1)  # (B, S, Ls): rows that chose
        _top, top_weights, top_keys = _strongest_keys(rows)  # (B, S, K), held
        encoder_attention = encoded.attention[(encoder_block, "attention")].tolist()
        decoder_attention = decoded.attention[(decoder_block, "attention")].tolist()
        cross_attention = cross.tolist()
        cross_window, block_windows = _translation_windows(
            cross, encoded.attention, decoded.attention, (encoder_shown, decoder_shown),
            source_lengths, ids.shape[1], every_block,
        )  # fmt: skip
    steps = _translation_steps(
        decoded.steps, len(source_ids), rules.eos_ids, decoder.layers, top_keys, top_weights
    )
    return TranslationRun(
        generated=decoded.generated,
        steps=steps,
        encoder_attention=encoder_attention,
        decoder_attention=decoder_attention,
        cross_attention=cross_attention,
        cross_window=cross_window,
        block_windows=block_windows,
        final_cache_shapes=decoded.final_cache,
        final_measured_bytes=decoded.final_cache_bytes,
        device=str(device),
        kept_stages=_translation_kept_stages(encoder_records, decoder_records),
    )


def _translation_records(run: ModelDescription, keep_stages: bool) -> tuple[dict, dict]:
    """run --save: a keeping Recorder for every encoder block and every decoder block."""
    from attnctl.nn.layer import Recorder

    encoder_records = {n: Recorder(keep=True) for n in range(run.layers)} if keep_stages else {}
    decoder_layers = run.decoder.layers
    decoder_records = {n: Recorder(keep=True) for n in range(decoder_layers)} if keep_stages else {}
    return encoder_records, decoder_records


def _strongest_keys(rows: Any) -> tuple[Any, list, list]:
    """Each of the (B, S, Lk) rows' strongest keys: the top-k (B, S, K), which the caller
    holds as before, and its weights and keys as lists."""
    from attnctl.report.generation import TOP_KEYS_KEPT

    top = rows.topk(min(TOP_KEYS_KEPT, rows.shape[-1]), dim=-1)  # (B, S, K)
    top_weights, top_keys = top.values.tolist(), top.indices.tolist()
    return top, top_weights, top_keys


def _encode_source(
    run: ModelDescription,
    named: dict[str, Any],
    source_ids: list[list[int]],
    source_lengths: list[int],
    device: Any,
    shown: list[int],
    heads: list[int],
    records: dict[int, Any],
) -> tuple[Any, Any, Any, Any, Any]:
    """The right-padded source on the device (B, Ls), its lengths (B,), its padding mask
    (B, Ls) (True = a real token; None as the key padding where no source is padded), and
    the encoder's pass keeping ``heads``' weights of the ``shown`` blocks. The caller holds
    every tensor until its run ends."""
    import torch

    from attnctl.nn.generate import encode

    ids = torch.tensor(source_ids, device=device)  # (B, Ls)
    lengths = torch.tensor(source_lengths, device=device)
    padding = torch.arange(ids.shape[1], device=device) < lengths[:, None]  # (B, Ls)
    # None where no source is padded: the same weights, and no mask among the stages
    key_padding = None if bool(padding.all()) else padding
    encoded = encode(
        run, named, ids, key_padding, shown=shown, heads=heads, records=records or None,
    )  # fmt: skip
    return ids, lengths, padding, key_padding, encoded


def _teacher_forced_pass(
    decoder: ModelDescription,
    named: dict[str, Any],
    target: Any,
    device: Any,
    context: Any,
    context_padding: Any,
    records: dict[int, Any],
) -> None:
    """One more pass of the decoder over the whole target (B, Lt) at once, recording every
    block's stages: teacher-forced (the tokens the steps chose; its weights are the steps',
    to float error)."""
    from attnctl.nn.generate import decoder_weights
    from attnctl.nn.model import forward

    forward(
        decoder,
        decoder_weights(named),
        target.to(device),  # (B, Lt)
        last=decoder.layers - 1,
        records=records,
        context=context,
        context_padding=context_padding,
    )


def _translation_windows(
    cross: Any,
    encoder_attention: dict[tuple[int, str], Any],
    decoder_attention: dict[tuple[int, str], Any],
    shown: tuple[list[int], list[int]],
    source_lengths: list[int],
    source_len: int,
    every_block: bool,
) -> tuple[tuple[list, list, object], dict[str, dict[int, tuple[list, list, object]]]]:
    """The weights as Traces hold them (``runner.shown_weights``): the cross-attention
    (B, h, Lt, Ls) of the decoder block shown, and with ``every_block`` every block's of
    each kind (encoder, decoder, cross) of the ``shown`` encoder and decoder blocks."""
    from attnctl.nn.runner import shown_weights

    encoder_shown, decoder_shown = shown
    target_len = cross.shape[2]
    cross_window = shown_weights(cross, list(range(target_len)), [target_len] * len(source_lengths))
    block_windows: dict[str, dict[int, tuple[list, list, object]]] = {}
    if every_block:
        block_windows["encoder"] = {
            n: shown_weights(encoder_attention[(n, "attention")], list(range(source_len)),
                             source_lengths)
            for n in encoder_shown
        }  # fmt: skip
        for kind, name in (("decoder", "attention"), ("cross", "cross_attention")):
            block_windows[kind] = _shown_blocks(
                decoder_attention, decoder_shown, name, target_len, len(source_lengths)
            )
    return cross_window, block_windows


def _translation_steps(
    decoded_steps: list[Any],
    texts: int,
    eos_ids: Sequence[int],
    layers: int,
    top_keys: list[list[list[int]]],
    top_weights: list[list[list[float]]],
) -> list[GenerationStep]:
    """What each step chose and its cache held, each row's strongest source tokens; the
    texts and the estimated bytes are the use case's to fill in."""
    from attnctl.report.generation import GenerationStep

    finished = [False] * texts
    steps = []
    for number, step in enumerate(decoded_steps):
        finished = [
            done or token in eos_ids for done, token in zip(finished, step.tokens, strict=True)
        ]
        steps.append(
            GenerationStep(
                step=number,
                tokens=step.tokens,
                texts=[],
                position=step.query_position + 1,
                finished=finished,
                cache_shapes=step.cache,
                estimated_bytes=0,
                measured_bytes=step.cache_bytes,
                dropped=[0] * layers,
                top_keys=_top_keys_at(top_keys, top_weights, number),
                keys=step.query_position + 1,
            )
        )
    return steps


def _translation_kept_stages(
    encoder_records: dict[int, Any], decoder_records: dict[int, Any]
) -> list[KeptStages]:
    """run --save: what every encoder block's and decoder block's Recorder kept."""
    from attnctl.nn.runner import kept_stages_of

    return [
        kept_stages_of(record, f"encoder.block.{n}.", f"encoder block {n}'s stages")
        for n, record in encoder_records.items()
    ] + [
        kept_stages_of(
            record,
            f"decoder.block.{n}.",
            f"decoder block {n}'s stages, over the whole target at once (teacher-forced)",
        )
        for n, record in decoder_records.items()
    ]
