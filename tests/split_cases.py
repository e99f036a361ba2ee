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


def seeded_weights(case, full) -> dict:
    """One device's weights of the step under the same seed: a seeded stack of
    ``layers`` copies of block 0, or the checkpoint's."""
    import torch

    from attnctl.nn.weights import model_weights

    torch.manual_seed(case.config.seed)
    checkpoint = case.model is not None
    whole = model_weights(full, case.config, torch.device("cpu"), blocks=None, head=checkpoint)
    named = {k: v.detach().clone() for k, v in whole.named.items()}
    if not checkpoint:
        block = {k: v for k, v in named.items() if k.startswith("blocks.0.")}
        for n in range(1, case.layers):
            for key, value in block.items():
                named[key.replace("blocks.0.", f"blocks.{n}.", 1)] = value.clone()
    return named


def whole_batch_gradients(case, full) -> dict:
    """One device's gradients of every copy's token ids together (rank r's drawn under
    seed + r), of the loss summed over them divided by D: the copies' mean."""
    import torch

    from attnctl.describe import ModelDescription
    from attnctl.nn.model import forward

    dp = case.layout.dp
    named = {k: v.requires_grad_() for k, v in seeded_weights(case, full).items()}
    drawn = [
        torch.randint(0, full.vocab_size, (case.batch, case.seq_len),
                      generator=torch.Generator().manual_seed(case.config.seed + rank))
        for rank in range(dp)
    ]  # fmt: skip
    token_ids = torch.cat(drawn)  # (D·B, L)
    stack, last = full, full.layers - 1
    if case.model is None:
        stack, last = ModelDescription(full.embeddings, full.blocks * case.layers), case.layers - 1
    (forward(stack, named, token_ids, last=last, training=True).output.sum() / dp).backward()
    return {k: v.grad for k, v in named.items() if v.grad is not None}


def held_gradients(zero: int, results: list[dict], weights: dict) -> dict:
    """The mean gradients a data-parallel group of ranks holds (``results``: each rank's
    of one task, ``weights``: the tensors they train, by name): every rank's whole under
    ZeRO 0 and 1 (the same everywhere), each rank's pieces of the flat buffer under ZeRO
    2 and 3, put together (every value held by exactly one rank)."""
    import torch

    if zero < 2:
        gradients = [result["gradients"] for result in results]
        assert all(g == gradients[0] for g in gradients)  # the mean, everywhere
        return {k: torch.tensor(v) for k, v in gradients[0].items()}
    shapes = {k: v.shape for k, v in weights.items()}
    flat: dict[str, torch.Tensor] = {}
    held: dict[str, torch.Tensor] = {}
    for result in results:
        assert "gradients" not in result  # no rank keeps a whole gradient
        for name, first, values in result["gradient_pieces"]:
            whole = flat.setdefault(name, torch.zeros(shapes[name].numel()))
            count = held.setdefault(name, torch.zeros(shapes[name].numel(), dtype=torch.int64))
            whole[first : first + len(values)] = torch.tensor(values)
            count[first : first + len(values)] += 1
    for name, count in held.items():
        assert bool((count == 1).all()), name  # every value on exactly one rank
    return {k: v.view(shapes[k]) for k, v in flat.items()}
