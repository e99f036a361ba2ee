"""The torch twins of ``attnctl/stages/``: each computes and records the stages its plan
names, under the same names. ``nn/model.py`` walks a model description through them."""

from __future__ import annotations

from collections.abc import Callable

import torch

Record = Callable[[str, torch.Tensor, str], None]


def no_record(name: str, tensor: torch.Tensor, dims: str) -> None:
    """A recorder that keeps nothing (blocks that are run but not shown)."""
