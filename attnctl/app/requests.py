"""What the CLI passes to a use case (the options as parsed) and what ``check`` returns."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from attnctl.model.layout import Layout

if TYPE_CHECKING:  # check.py imports torch; the plan is a type here
    from attnctl.nn.check import CheckResult
    from attnctl.stages.plan import Plan


def _no_progress(description: str) -> AbstractContextManager[None]:
    return contextlib.nullcontext()


def _no_warning(message: str) -> None:
    return None


@dataclass(frozen=True)
class Hooks:
    """What the CLI shows while a use case works: a spinner around long work, warnings."""

    progress: Callable[[str], AbstractContextManager[None]] = _no_progress
    warn: Callable[[str], None] = _no_warning


# ---------------------------------------------------------------- requests


@dataclass(frozen=True)
class LayerRequest:
    """The layer options as given (None: the preset's value), and ``--model DIR``."""

    options: dict[str, Any] = field(default_factory=dict)
    model_dir: str | None = None


@dataclass(frozen=True)
class RunRequest:
    layer: LayerRequest
    texts: list[str] | None = None  # TEXT arguments ('-' reads stdin)
    file: str | None = None  # --file
    contexts: list[str] | None = None  # --context
    context_file: str | None = None
    heads: list[int] | None = None  # --head
    rows: list[str] | None = None  # --rows
    digits: int = 2
    force: bool = False
    block: str | None = None  # --layer N|all
    every_weight: bool = False  # --json: every head's weights, not the tables shown
    generate: int | None = None  # --generate N: N greedy tokens after the text
    encoder_block: str | None = None  # --encoder-layer N: an encoder–decoder's encoder block
    save: str | None = None  # --save FILE.safetensors: keep the stages' tensors too
    tp: int = 1  # --tp T: split over T processes (tensor parallel, torch.distributed)
    sp: bool = False  # --sp: sequence parallel over those T


@dataclass(frozen=True)
class ShapesRequest:
    layer: LayerRequest
    seq_len: int | None = 16  # None: not given (16)
    batch: int = 1
    context_len: int | None = None
    src_len: int | None = None  # an encoder–decoder's source and target lengths
    tgt_len: int | None = None


@dataclass(frozen=True)
class MemoryRequest:
    layer: LayerRequest
    seq_len: str | None = None  # one length or several: "512,2048"
    batch: int = 1
    context_len: int | None = None
    layers: int = 1
    kv_cache: int | None = None
    budget: str | None = None
    fit_device: bool = False
    train: bool = False
    measure: bool = False
    force: bool = False
    src_len: int | None = None  # an encoder–decoder's source and target lengths
    tgt_len: int | None = None
    generate: int | None = None  # a decoder-only model's cache after N more tokens
    # --tp, --sp, --cp, --pp, --dp, --zero, --micro-batch, --recompute
    layout: Layout = field(default_factory=Layout)


@dataclass(frozen=True)
class CheckRequest:
    layer: LayerRequest
    seq_len: int = 16
    batch: int = 2
    force: bool = False


@dataclass(frozen=True)
class CheckReport:
    result: CheckResult
    plan: Plan
