"""The computation's entry points: every call the use cases make into model, plan, memory,
training, runner, measure and check goes through one function here, so a change of their
signatures stays in this file. torch-importing modules are imported inside the functions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
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
    from attnctl.report.generation import GenerationRun, TranslationRun


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
        device,
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
        return measure_forward(plan)


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
    from attnctl.nn.runner import kept_stages_of, shown_weights, tune_allocator
    from attnctl.nn.weights import model_weights
    from attnctl.report.generation import TOP_KEYS_KEPT, GenerationRun, GenerationStep

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
        top = rows.topk(min(TOP_KEYS_KEPT, rows.shape[-1]), dim=-1)  # (B, S, K)
        top_weights, top_keys = top.values.tolist(), top.indices.tolist()
        total = shown.shape[2]
        attention = {
            block: shown_weights(
                decoded.attention[(block, "attention")], list(range(total)), [total] * len(ids)
            )
            for block in blocks
        }
    windows = [block.attention.window for block in run.blocks]
    finished = [False] * len(prompt_ids)
    steps = []
    for number, step in enumerate(decoded.steps):
        position = step.query_position + 1
        eos = (run.generation.eos_ids if run.generation else ()) or ()
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
                top_keys=[
                    [
                        (key, weight)
                        for key, weight in zip(keys[number], values[number], strict=True)
                        if weight > 0
                    ]
                    for keys, values in zip(top_keys, top_weights, strict=True)
                ],
                keys=kept[cache_block],
            )
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
    every decoder block's in one more pass of the decoder over the whole target at once
    (teacher-forced: the tokens it chose; its weights are the steps', to float error)."""
    import torch

    from attnctl.nn.generate import decoder_weights, encode, greedy
    from attnctl.nn.layer import Recorder, resolve_device
    from attnctl.nn.model import forward
    from attnctl.nn.runner import kept_stages_of, shown_weights, tune_allocator
    from attnctl.nn.weights import model_weights
    from attnctl.report.generation import TOP_KEYS_KEPT, GenerationStep, TranslationRun

    device = resolve_device(layer.device)
    tune_allocator()
    run = model.with_run(layer)
    decoder = run.decoder
    rules = decoder.generation
    encoder_records = {n: Recorder(keep=True) for n in range(run.layers)} if keep_stages else {}
    decoder_records = {n: Recorder(keep=True) for n in range(decoder.layers)} if keep_stages else {}
    with device_errors_of(layer.device), torch.inference_mode():
        weights = model_weights(run, layer, device, blocks=None, head=True)
        ids = torch.tensor(source_ids, device=device)  # (B, Ls)
        lengths = torch.tensor(source_lengths, device=device)
        padding = torch.arange(ids.shape[1], device=device) < lengths[:, None]  # (B, Ls)
        encoder_shown = list(range(run.layers)) if every_block else [encoder_block]
        decoder_shown = list(range(decoder.layers)) if every_block else [decoder_block]
        # None where no source is padded: the same weights, and no mask among the stages
        key_padding = None if bool(padding.all()) else padding
        encoded = encode(
            run, weights.named, ids, key_padding, shown=encoder_shown, heads=heads,
            records=encoder_records or None,
        )  # fmt: skip
        start = torch.full((len(source_ids), 1), rules.start_id, device=device)  # (B, 1)
        decoded = greedy(
            decoder,
            decoder_weights(weights.named),
            start,
            new_tokens,
            shown=decoder_shown,
            heads=heads,
            encoder_output=encoded.output,
            encoder_padding=padding,
        )
        if keep_stages:  # the target as the steps fed it: the start token, then each chosen
            target = torch.tensor([[rules.start_id, *row] for row in decoded.generated])
            forward(
                decoder,
                decoder_weights(weights.named),
                target.to(device),  # (B, Lt)
                last=decoder.layers - 1,
                records=decoder_records,
                context=encoded.output,
                context_padding=key_padding,
            )
        del weights
        cross = decoded.attention[(decoder_block, "cross_attention")]  # (B, h, Lt, Ls)
        rows = cross[:, :, : len(decoded.steps)].mean(dim=1)  # (B, S, Ls): rows that chose
        top = rows.topk(min(TOP_KEYS_KEPT, rows.shape[-1]), dim=-1)  # (B, S, K)
        top_weights, top_keys = top.values.tolist(), top.indices.tolist()
        encoder_attention = encoded.attention[(encoder_block, "attention")].tolist()
        decoder_attention = decoded.attention[(decoder_block, "attention")].tolist()
        cross_attention = cross.tolist()
        target_len = cross.shape[2]
        cross_window = shown_weights(cross, list(range(target_len)), [target_len] * len(ids))
        block_windows: dict[str, dict[int, tuple[list, list, object]]] = {}
        if every_block:
            source_len, targets = ids.shape[1], [target_len] * len(ids)
            block_windows["encoder"] = {
                n: shown_weights(encoded.attention[(n, "attention")], list(range(source_len)),
                                 source_lengths)
                for n in encoder_shown
            }  # fmt: skip
            for kind, name in (("decoder", "attention"), ("cross", "cross_attention")):
                block_windows[kind] = {
                    n: shown_weights(decoded.attention[(n, name)], list(range(target_len)), targets)
                    for n in decoder_shown
                }
    finished = [False] * len(source_ids)
    steps = []
    for number, step in enumerate(decoded.steps):
        finished = [
            done or token in rules.eos_ids
            for done, token in zip(finished, step.tokens, strict=True)
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
                dropped=[0] * decoder.layers,
                top_keys=[
                    [
                        (key, weight)
                        for key, weight in zip(keys[number], values[number], strict=True)
                        if weight > 0
                    ]
                    for keys, values in zip(top_keys, top_weights, strict=True)
                ],
                keys=step.query_position + 1,
            )
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
        kept_stages=[
            kept_stages_of(record, f"encoder.block.{n}.", f"encoder block {n}'s stages")
            for n, record in encoder_records.items()
        ]
        + [
            kept_stages_of(
                record,
                f"decoder.block.{n}.",
                f"decoder block {n}'s stages, over the whole target at once (teacher-forced)",
            )
            for n, record in decoder_records.items()
        ],
    )
