"""The small layers the split tests sweep (tests/test_distributed*.py): every layer of
d_model 32 and 4 heads over norm, positions, mask and kernel, with each of ``variants``
(options that change the stages), that ``validate`` accepts."""

from __future__ import annotations

import itertools

from attnctl.config import LayerConfig, resolve_impl, validate
from attnctl.errors import AttnctlError


def small_layers(variants: list[dict]) -> list[LayerConfig]:
    configs = []
    for norm, pos, mask, impl, extra in itertools.product(
        ["pre", "post", "none"], ["sinusoidal", "learned", "rope", "none"], ["none", "causal"],
        ["math", "sdpa"], variants,
    ):  # fmt: skip
        values = {"d_model": 32, "heads": 4, "norm": norm, "pos": pos, "mask": mask,
                  "impl": impl, "device": "cpu", **extra}  # fmt: skip
        try:
            configs.append(resolve_impl(validate(LayerConfig(**values))))
        except AttnctlError:  # a window without the causal mask, ...
            continue
    return configs
