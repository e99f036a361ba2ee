"""Run the layer on real text: seed, build, check memory, run on the device, return a Trace."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
from array import array
from collections.abc import Iterator, Sequence
from itertools import islice
from typing import Any

from attnctl.errors import RUNTIME, AttnctlError
from attnctl.model.config import LayerConfig, resolve_impl
from attnctl.model.describe import ModelDescription, seeded_model
from attnctl.text.tokenize import Batch, encode_batch
from attnctl.trace import KeptStages, RowSums, Token, Trace

TOP_KEYS = 64  # strongest keys kept per query row, for tables too narrow for every key


def run_text(
    text: str | list[str],
    config: LayerConfig,
    heads: list[int] | None = None,
    rows: list[int] | None = None,
) -> Trace:
    """Tokenize ``text`` (or a batch of texts) and run one seeded attention layer over it."""
    texts = [text] if isinstance(text, str) else text
    return run(encode_batch(texts, config.tokenizer), config, heads=heads, rows=rows)[0]


def needs_padding_mask(keys: Batch, config: LayerConfig) -> bool:
    """Keys of unequal length need a key-padding mask, unless a causal mask is there: with
    padding on the right, no real token can see a later position anyway. The keys are the
    text's own tokens, or the context's in cross-attention."""
    return keys.padded and config.mask != "causal"


def run(
    batch: Batch,
    config: LayerConfig,
    model: ModelDescription | None = None,
    layers: list[int] | None = None,
    heads: Sequence[int] | None = None,
    rows: list[int] | None = None,
    context: Batch | None = None,
    keep_stages: bool = False,
) -> list[Trace]:
    """Run the seeded layer (``model`` None) or a checkpoint's blocks up to the last of
    ``layers`` over a (padded) batch: a Trace for each of ``layers``, with weights only
    for ``heads`` x ``rows``.

    The stages are recorded for the first of ``layers`` only when it is the one layer
    asked for (``--layer N``); ``--layer all`` shows weights, not stages (with
    ``keep_stages``, each block's are recorded and kept, not shown). ``context``,
    one row per text, makes the seeded layer cross-attention over those tokens. The
    caller has checked memory first (``resources.preflight``). ``keep_stages`` keeps a
    CPU copy of each recorded stage's tensor (``run --save``).
    """
    import torch

    from attnctl.nn.weights import model_weights

    layers = [0] if layers is None else layers
    if context is not None:  # keys and values from the context: cross-attention
        config = dataclasses.replace(config, cross=True)
    config, device, heads, rows = _start(batch, config, heads, rows)
    description = (
        seeded_model(config, batch.vocab_size) if model is None else model.with_run(config)
    )
    padded_rows = batch.padded_rows()
    if model is not None:
        _check_vocabulary(padded_rows, model)
    last = max(layers)
    weights = model_weights(description, config, device, blocks=last + 1)
    token_ids, context_rows, context_ids = _input_ids(padded_rows, context, device)
    keys = batch if context is None else context
    padding = padding_mask(keys, device) if needs_padding_mask(keys, config) else None
    record, records = _recorders(layers, keep_stages)
    queries = [len(row) for row in batch.rows]
    with device_errors(device), torch.inference_mode():
        windows = _forward_windows(
            description, weights.named, token_ids, layers, records, padding, context_ids,
            heads, rows, queries,
        )  # fmt: skip
    return _traces(
        batch, config, model, layers, heads, rows, device, padded_rows, context_rows, record,
        records, windows, keep_stages,
    )  # fmt: skip


def _check_vocabulary(padded_rows: list[list[Token]], model: ModelDescription) -> None:
    """Every token id must have a row in the model's embedding."""
    largest = max(t.id for row in padded_rows for t in row)
    if largest >= model.vocab_size:
        raise AttnctlError(
            f"token id {largest} is outside the model's vocabulary of {model.vocab_size}: "
            "is this tokenizer the model's own?"
        )


def _input_ids(
    padded_rows: list[list[Token]], context: Batch | None, device: Any
) -> tuple[Any, list[list[Token]] | None, Any]:
    """The token ids on the device (B, L), and the context's rows and ids (B, Lc) (None
    without a context); the caller holds the tensors until its run ends."""
    import torch

    token_ids = torch.tensor([[t.id for t in row] for row in padded_rows], device=device)  # (B, L)
    context_rows = None if context is None else context.padded_rows()
    context_ids = None
    if context_rows is not None:
        context_ids = torch.tensor(
            [[t.id for t in row] for row in context_rows], device=device
        )  # (B, Lc)
    return token_ids, context_rows, context_ids


def _recorders(layers: list[int], keep_stages: bool) -> tuple[Any, dict[int, Any]]:
    """The Recorder whose stages are shown (--layer N), and the Recorder of each block
    that records: that one, or (--layer all --save) each block's own, kept."""
    from attnctl.nn.layer import Recorder

    record = Recorder(keep=keep_stages)  # --layer N: the block's stages, shown and kept
    records = {layers[0]: record} if len(layers) == 1 else {}
    if keep_stages and len(layers) > 1:  # --layer all --save: each block's own, kept
        records = {n: Recorder(keep=True) for n in layers}
    return record, records


def _forward_windows(
    description: ModelDescription,
    named: dict[str, Any],
    token_ids: Any,
    layers: list[int],
    records: dict[int, Any],
    padding: Any,
    context_ids: Any,
    heads: list[int],
    rows: list[int],
    queries: list[int],
) -> dict[int, tuple[list, list, RowSums]]:
    """The forward pass up to the last of ``layers``, and each one's weights of ``heads``
    x ``rows`` as a Trace holds them (:func:`shown_weights`); the pass's result is freed
    when they are read."""
    from attnctl.nn.model import forward

    result = forward(
        description,
        named,
        token_ids,
        last=max(layers),
        records=records,
        padding=padding,
        context_ids=context_ids,
        shown=layers,
        window=(heads, rows),
    )
    windows = {n: shown_weights(result.windows[n], rows, queries) for n in layers}
    del result
    return windows


def _traces(
    batch: Batch,
    config: LayerConfig,
    model: ModelDescription | None,
    layers: list[int],
    heads: list[int],
    rows: list[int],
    device: Any,
    padded_rows: list[list[Token]],
    context_rows: list[list[Token]] | None,
    record: Any,
    records: dict[int, Any],
    windows: dict[int, tuple[list, list, RowSums]],
    keep_stages: bool,
) -> list[Trace]:
    """A Trace for each of ``layers``: the tokens, the stages shown, the weights read."""
    return [
        Trace(
            tokens=padded_rows,
            stages=record.stages,
            attention=windows[n][0],
            attention_heads=heads,
            attention_rows=rows,
            top_keys=windows[n][1],
            device=str(device),
            tokenizer=batch.name,
            vocab_size=batch.vocab_size,
            impl=config.impl,
            context_tokens=context_rows,
            layer=None if model is None else n,
            sums=windows[n][2],
            kept=kept_stages_of(records[n], "" if model is None else f"block.{n}.")
            if keep_stages
            else None,
        )
        for n in layers
    ]


def kept_stages_of(record: Any, prefix: str, what: str = "") -> KeptStages:
    """What a keeping :class:`~attnctl.nn.layer.Recorder` holds, saved under ``prefix``."""
    if not what:
        block = prefix.removesuffix(".").rpartition(".")[2]
        what = f"block {block}'s stages" if prefix else "the layer's stages"
    return KeptStages(prefix, record.stages, record.tensors, what)


def _start(
    batch: Batch,
    config: LayerConfig,
    heads: Sequence[int] | None,
    rows: list[int] | None,
) -> tuple[LayerConfig, Any, list[int], list[int]]:
    """The implementation for the rows shown, the device, heads and rows."""
    from attnctl.nn.layer import resolve_device

    seq_len = batch.seq_len
    heads = list(range(config.heads) if heads is None else heads)
    rows = list(range(seq_len)) if rows is None else rows
    config = resolve_impl(config, shows_every_weight=len(rows) == seq_len)
    device = resolve_device(config.device)
    tune_allocator()
    return config, device, heads, rows


def padding_mask(keys: Batch, device) -> Any:
    """(B, Lk) bool, True = a real key (SDPA's convention), for right-padded rows."""
    import torch

    lengths = torch.tensor([len(row) for row in keys.rows], device=device)
    key_positions = torch.arange(keys.seq_len, device=device)
    return key_positions < lengths[:, None]  # (B, Lk)


def shown_weights(window, rows: list[int], queries: list[int]) -> tuple[list, list, RowSums]:
    """(B, h, r, Lk) weights as compact float32 rows, each row's strongest keys, and the
    sums the statistics need (``queries``: each text's own length, without padding)."""
    import torch

    top = window.topk(min(TOP_KEYS, window.shape[-1]), dim=-1).indices  # (B, h, r, K)
    # one compact float32 array per row: 4 bytes a weight, not a 32-byte Python float,
    # copied from the tensor's memory at once (tolist() made a Python float of each)
    window = window.float().cpu().contiguous()
    batch, shown_heads, shown_rows, keys = window.shape
    flat = array("f")
    flat.frombytes(ctypes.string_at(window.data_ptr(), window.numel() * flat.itemsize))
    starts = iter(range(0, len(flat), keys))
    attention = [
        [[flat[start : start + keys] for start in islice(starts, shown_rows)]
         for _ in range(shown_heads)]
        for _ in range(batch)
    ]  # fmt: skip
    # attention: (B, h, r) rows of Lk weights
    wide = window.double()  # summed in float64, as Python adds floats
    own = torch.tensor([[row < count for row in rows] for count in queries])  # (B, r)
    sums = RowSums(
        entropy=torch.special.xlogy(wide, wide).sum(-1).neg().tolist(),  # (B, h, r); 0·log 0 = 0
        support=(window > 0).sum(-1).tolist(),  # (B, h, r)
        columns=(wide * own[:, None, :, None]).sum(2).tolist(),  # (B, h, Lk)
    )
    return attention, top.cpu().tolist(), sums


@contextlib.contextmanager
def device_errors(device) -> Iterator[None]:
    """Out of memory and other failures on the device: one line, exit 1."""
    import torch

    try:
        yield
    except (torch.OutOfMemoryError, MemoryError) as error:
        message = _first_line(error)
        raise AttnctlError(f"out of memory on {device}: {message}", exit_code=RUNTIME) from error
    except RuntimeError as error:
        message = _first_line(error)
        if "memory" in message or "allocate" in message:
            raise AttnctlError(
                f"out of memory on {device}: {message}", exit_code=RUNTIME
            ) from error
        raise AttnctlError(f"the layer failed on {device}: {message}", exit_code=RUNTIME) from error


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def tune_allocator() -> None:
    """Give large blocks back to the system as soon as they are freed (glibc on Linux).

    glibc raises its mmap threshold after the first large free and then keeps freed
    tensors of tens of MiB in the heap, so a long input's peak RSS grew ~1.4x beyond the
    live tensors. A fixed 1 MiB threshold (MALLOC_MMAP_THRESHOLD_ without the variable)
    maps every tensor larger than that on its own and unmaps it when it is freed.
    """
    if os.uname().sysname != "Linux":
        return
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt: nothing to tune
        return
    m_mmap_threshold = -3
    mallopt(m_mmap_threshold, 1 << 20)
