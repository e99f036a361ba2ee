"""The computation's entry points: every call the use cases make into model, plan, memory,
training, runner, measure and check goes through one function here, so a change of their
signatures stays in this file. torch-importing modules are imported inside the functions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from attnctl.config import DTYPE_BYTES, LayerConfig
from attnctl.describe import ModelDescription
from attnctl.families import read_model
from attnctl.memory import KVCacheGroup, MemoryEstimate, estimate, kv_cache_groups
from attnctl.plan import Plan, build_plan
from attnctl.tokenize import Batch
from attnctl.training import TrainingEstimate, estimate_training

if TYPE_CHECKING:  # they import torch
    from attnctl.check import CheckResult
    from attnctl.trace import Trace


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
    return estimate_training(plan, layers)


def kv_cache_of(plan: Plan, tokens: int, layers: int) -> list[KVCacheGroup]:
    return kv_cache_groups(plan, tokens, layers)


def device_of(spec: str) -> Any:
    from attnctl.layer import resolve_device

    return resolve_device(spec)


def padding_mask_needed(keys: Batch, layer: LayerConfig) -> bool:
    from attnctl.runner import needs_padding_mask

    return needs_padding_mask(keys, layer)


@contextlib.contextmanager
def device_errors_of(device_spec: str) -> Iterator[None]:
    from attnctl.runner import device_errors

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
) -> list[Trace]:
    """attnctl's layer on the batch (one trace), or a model's blocks (one trace each)."""
    from attnctl.runner import run

    with device_errors_of(layer.device):
        return run(batch, layer, model, blocks, heads, query_rows, context=cross)


def measure_peak(plan: Plan, model: ModelDescription | None, train: bool, layers: int = 1) -> Any:
    """A forward pass of the plan's model, or (``train``) a training step of its stack
    of ``layers`` blocks."""
    from attnctl.measure import measure_forward, measure_training

    with device_errors_of(plan.config.device):
        if train:
            return measure_training(plan.config, plan, layers)
        return measure_forward(plan)


def measure_generated_cache_of(plan: Plan, new_tokens: int) -> int:
    """The K and V bytes after really generating ``new_tokens`` after the plan's prompt."""
    from attnctl.measure import measure_generated_cache

    with device_errors_of(plan.config.device):
        return measure_generated_cache(plan, new_tokens)


def compare_implementations(
    layer: LayerConfig, batch: int, seq_len: int, vocab: int
) -> CheckResult:
    from attnctl.check import run_check

    with device_errors_of(layer.device):
        return run_check(layer, batch, seq_len, vocab)
