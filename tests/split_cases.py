"""The small layers the split tests sweep (tests/test_distributed*.py): every layer of
d_model 32 and 4 heads over norm, positions, mask and kernel, with each of ``variants``
(options that change the stages), that ``validate`` accepts; and :func:`covering`, the few
of them (with and without SP) that still put every two options' values together once."""

from __future__ import annotations

import itertools

from attnctl.errors import AttnctlError
from attnctl.model.config import LayerConfig, resolve_impl, validate


def small_layers(variants: list[dict]) -> list[LayerConfig]:
    return [config for config, _ in _small_layers(variants)]


def _small_layers(variants: list[dict]) -> list[tuple[LayerConfig, tuple]]:
    """Every accepted layer of the grid with its factors (norm, pos, mask, kernel, variant)."""
    configs = []
    for norm, pos, mask, impl, (index, extra) in itertools.product(
        ["pre", "post", "none"], ["sinusoidal", "learned", "rope", "none"], ["none", "causal"],
        ["math", "sdpa"], list(enumerate(variants)),
    ):  # fmt: skip
        values = {"d_model": 32, "heads": 4, "norm": norm, "pos": pos, "mask": mask,
                  "impl": impl, "device": "cpu", **extra}  # fmt: skip
        try:
            config = resolve_impl(validate(LayerConfig(**values)))
        except AttnctlError:  # a window without the causal mask, ...
            continue
        configs.append((config, (norm, pos, mask, impl, index)))
    return configs


def covering(variants: list[dict], strength: int = 2) -> list[tuple[LayerConfig, bool]]:
    """(layer, sp) pairs from the grid of :func:`small_layers` x SP in which every value of
    every factor (``strength`` 1), or every two values of two factors (2: all pairs),
    that an accepted layer has, appears at least once: a grid's interactions with a
    fraction of its cases. Greedy (the case covering most of what is left first), so the
    same cases every run."""
    grid = _small_layers(variants)
    candidates = [(config, sp, (*factors, sp)) for config, factors in grid for sp in (False, True)]

    def combinations(factors: tuple) -> set[tuple]:
        return set(itertools.combinations(enumerate(factors), strength))

    left = set().union(*(combinations(f) for _, _, f in candidates))
    chosen = []
    while left:
        best = max(candidates, key=lambda c: len(combinations(c[2]) & left))
        left -= combinations(best[2])
        chosen.append((best[0], best[1]))
    return chosen


def one_device_gradients(case, full) -> dict:
    """One device's gradients of a split's training step (``distributed.SplitCase``): the
    weights the ranks cut under the same seed, the same token ids (the whole sequence),
    ``loss = output.sum()``; a seeded stack of ``layers`` copies of block 0."""
    import torch

    from attnctl.model.describe import ModelDescription
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

    from attnctl.model.describe import ModelDescription
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


def assert_steps_to_the_byte(case, ranks: list, world: int) -> None:
    """Each of the ``world`` ranks' training step of ``case`` (``distributed.SplitCase``)
    equal to its estimate: its weights, each phase's peak and the peak, and the
    backward's peak up to each gradient (every window, in the order they come), to the
    byte."""
    what = "the layer" if case.model is None else case.model.name
    assert [r.rank for r in ranks] == list(range(world))
    for rank in ranks:
        where = f"{what} {case.layout.summary()} {case.config.dtype} rank {rank.rank}"
        assert rank.stage_names == ("forward", "backward", "optimizer step")
        assert rank.measured_parameter_bytes == rank.parameter_bytes, where
        assert rank.measured_stage_peak_bytes == rank.stage_peak_bytes, where
        assert rank.measured_peak_bytes == rank.peak_bytes, where
        assert rank.gradient_window_bytes, where  # one a trained tensor
        windows = zip(rank.gradient_window_bytes, rank.measured_gradient_window_bytes, strict=True)
        differ = [(n, a - b) for n, (a, b) in enumerate(windows) if a != b]  # (window, bytes)
        assert rank.measured_gradient_window_bytes == rank.gradient_window_bytes, (where, differ)


def measured_document(invoke, *args: str) -> tuple[list[dict], dict]:
    """``attnctl *args --measure --json`` of a training step: its ranks, each equal to its
    estimate phase by phase, and its per-device row, which is the busiest rank's."""
    import json

    result = invoke(*args, "--measure", "--json")
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    ranks = document["measured_per_rank"]
    (device,) = document["per_device"]
    for rank in ranks:
        assert rank["peak_bytes"] == rank["measured_peak_bytes"]
        assert rank["phase_peak_bytes"] == rank["measured_phase_peak_bytes"]
    assert device["peak_bytes"] == max(rank["peak_bytes"] for rank in ranks)
    return ranks, device


def assert_stepped_as_one_device(weights: dict, gradients: dict, results: list, dtype: str,
                                 where: str) -> None:  # fmt: skip
    """One device's Adam step on ``weights`` (a rank's tensors, by name; stepped in
    place) with the ``gradients`` the ranks hold, against each result's weights after
    its step, within 1e-6 of the largest weight. On the gradients held, not an oracle's:
    a gradient of 0 (W_k's bias: softmax is blind to a shift of a row's scores) is float
    noise, whose sign Adam's step keeps."""
    import torch

    from attnctl.memory.measure import adam_step

    trained = [weights[name] for name in gradients]
    for tensor, name in zip(trained, gradients, strict=True):
        tensor.grad = gradients[name].to(tensor.dtype)
    adam_step(trained, dtype != "float32")()
    bound = 1e-6 * max(float(w.abs().max()) for w in weights.values())
    for result in results:
        assert set(result["parameters"]) == set(weights), where
        for name, value in result["parameters"].items():
            said = f"{where} rank {result['rank']} {name}"
            torch.testing.assert_close(torch.tensor(value), weights[name].float(), rtol=0,
                                       atol=bound, msg=said)  # fmt: skip
