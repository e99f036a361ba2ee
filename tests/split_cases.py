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


def one_device_gradients(case, full) -> dict:
    """One device's gradients of a split's training step (``distributed.SplitCase``): the
    weights the ranks cut under the same seed, the same token ids (the whole sequence),
    ``loss = output.sum()``; a seeded stack of ``layers`` copies of block 0."""
    import torch

    from attnctl.describe import ModelDescription
    from attnctl.nn.model import forward
    from attnctl.nn.weights import model_weights

    torch.manual_seed(case.config.seed)
    checkpoint = case.model is not None
    whole = model_weights(full, case.config, torch.device("cpu"), blocks=None, head=checkpoint)
    token_ids = torch.randint(0, full.vocab_size, (case.batch, case.seq_len))
    named = {k: v.detach().clone().requires_grad_() for k, v in whole.named.items()}
    stack, last = full, full.layers - 1
    if not checkpoint:
        block = {k: v for k, v in named.items() if k.startswith("blocks.0.")}
        for n in range(1, case.layers):
            for key, value in block.items():
                copy = value.detach().clone().requires_grad_()
                named[key.replace("blocks.0.", f"blocks.{n}.", 1)] = copy
        stack, last = ModelDescription(full.embeddings, full.blocks * case.layers), case.layers - 1
    forward(stack, named, token_ids, last=last, training=True).output.sum().backward()
    return {k: v.grad for k, v in named.items() if v.grad is not None}
