"""Measure the memory a real forward pass holds, stage by stage, to check the estimate.

On CPU a ``TorchDispatchMode`` sees every tensor each aten op returns (including the
temporaries inside composite ops such as ``matmul``) and holds its storage by weak
reference: live bytes are the storages not yet freed, and the peak is taken right
after each op, when its output and inputs are alive together. Buffers a kernel
allocates and frees inside itself are invisible there. On CUDA the allocator's own
``max_memory_allocated`` is used, which sees those too.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from attnctl.errors import RUNTIME, AttnctlError
from attnctl.memory.measure_cuda import cuda_context_bytes, measure_cuda, measure_step_cuda
from attnctl.memory.measurement import Measurement
from attnctl.model.config import LayerConfig
from attnctl.nn.layer import TORCH_DTYPES, Recorder, resolve_device
from attnctl.stages.plan import Plan

_TRACKERS: list[LiveStorages] = []  # those measuring now (``storage_resized`` tells them)


def storage_resized(tensor: torch.Tensor) -> None:
    """Tell every :class:`LiveStorages` measuring now that ``tensor``'s storage was
    resized in place (no op the dispatcher sees does that); on CUDA the allocator's
    counters see it already."""
    for tracker in _TRACKERS:
        tracker.resized(tensor)


class LiveStorages(TorchDispatchMode):
    """Tracks the bytes of every storage an op produces until it is freed."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self._excluded: set[int] = set()  # storages counted elsewhere (the parameters)
        self.current = 0
        self.peak = 0
        self.window_peak: int | None = None

    def exclude(self, tensor: torch.Tensor) -> None:
        """Never count this tensor's storage (e.g. a parameter, whose views ops return)."""
        self._excluded.add(StorageWeakRef(tensor.untyped_storage()).cdata)

    def add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        ref = StorageWeakRef(storage)
        if ref.cdata not in self._live and ref.cdata not in self._excluded:
            self._live[ref.cdata] = (ref, storage.nbytes())
            self.current += storage.nbytes()

    def resized(self, tensor: torch.Tensor) -> None:
        """``tensor``'s storage was resized in place (ZeRO 3's gathered weights, freed to
        no bytes and grown again): counted at its new size from now on, after the
        storages freed since the last op (not counted at the moment it grows)."""
        self._forget_freed()
        storage = tensor.untyped_storage()
        ref = StorageWeakRef(storage)
        if ref.cdata in self._excluded:
            return
        _, before = self._live.get(ref.cdata, (ref, 0))
        self._live[ref.cdata] = (ref, storage.nbytes())
        self.current += storage.nbytes() - before
        self.peak = max(self.peak, self.current)
        self.window_peak = max(self.window_peak or 0, self.current)

    def __enter__(self):
        _TRACKERS.append(self)
        return super().__enter__()

    def __exit__(self, *failure):
        _TRACKERS.remove(self)
        return super().__exit__(*failure)

    def _forget_freed(self) -> None:
        for key, (ref, nbytes) in list(self._live.items()):
            if ref.expired():
                del self._live[key]
                self.current -= nbytes

    def take_window_peak(self) -> int:
        """The peak since the last call (one stage's window); starts the next window.

        A window opens at its first op, after the frees (``del``) that come between two
        stages; a stage whose ops never reach the dispatcher gets the bytes alive now.
        """
        self._forget_freed()
        peak = self.current if self.window_peak is None else self.window_peak
        self.window_peak = None
        return peak

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._forget_freed()
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.add(leaf)
        self.peak = max(self.peak, self.current)
        self.window_peak = max(self.window_peak or 0, self.current)
        return out


def measure_forward(plan: Plan, layers: int = 1) -> Measurement:
    """Run the plan's model once at its batch and length, on the configured device: the
    seeded layer, or a checkpoint loaded whole (its embeddings and block 0 run; every
    block is alike). ``layers``: the seeded layer as a stack of that many blocks, whose
    weights (block 0's values in tensors of their own) are all held while block 0 runs,
    as they are in a stack's forward pass, one block after another.

    The caller has checked memory first (``resources.preflight``).
    """
    from attnctl.nn.model import forward
    from attnctl.nn.weights import model_weights, stacked

    description = plan.description
    config = plan.config
    device = resolve_device(config.device)
    torch.manual_seed(config.seed)  # the seeded layer's weights, then the token ids drawn
    weights = model_weights(description, config, device, blocks=None)
    if description.checkpoint is None:
        weights = stacked(weights, layers)
    named = weights.named
    names = {s.name for s in plan.stages}
    decoder = "encoder_output" in names  # an encoder–decoder's decoder block
    if decoder:
        named = {k.removeprefix("decoder."): v for k, v in named.items()}
    vocab_size = description.vocab_size
    token_ids = torch.randint(0, vocab_size, (plan.batch, plan.seq_len), device=device)
    context_ids = padding = encoder_output = None  # the model's other inputs, made before
    key_len = plan.sizes.get("Lc", plan.seq_len)
    if decoder:  # the encoder's output stands in: random, in the run's dtype
        encoder_output = torch.randn(
            plan.batch, key_len, plan.sizes["D"], device=device, dtype=TORCH_DTYPES[config.dtype]
        )
    elif "Lc" in plan.sizes:  # cross-attention: a context of its own length
        context_ids = torch.randint(0, vocab_size, (plan.batch, key_len), device=device)
    if "padding_mask" in names:  # the last row: half of it padding
        padding = torch.ones(plan.batch, key_len, dtype=torch.bool, device=device)
        padding[-1, (key_len + 1) // 2 :] = False

    def run(record: Callable) -> None:
        forward(
            description,
            named,
            token_ids,
            record=record,
            padding=None if decoder else padding,
            context_ids=context_ids,
            context=encoder_output,
            context_padding=padding if decoder else None,
            last=plan.layer_index,
            recorded=plan.layer_index,
        )

    given = [t for t in (token_ids, context_ids, encoder_output, padding) if t is not None]
    measured = _measure(run, weights.stored, given, weights.parameter_bytes, device)
    if decoder or description.is_encoder_decoder:  # its caches: measure_seq2seq_caches
        return measured
    cache: list[torch.Tensor] = []  # then every block, keeping K and V as a decoder does
    with torch.inference_mode():
        forward(
            description,
            weights.named,
            token_ids,
            last=description.layers - 1,
            recorded=None,
            padding=padding,
            context_ids=context_ids,
            cache=cache,
        )
    kv_bytes = sum(t.untyped_storage().nbytes() for t in cache)
    return dataclasses.replace(measured, kv_cache_bytes=kv_bytes)


def measure_seq2seq_caches(plan: Plan) -> tuple[int, int]:
    """What a decoder keeps over its target (the decoder plan's L tokens) for a source of
    Lc tokens: (self-attention K and V bytes, cross-attention K and V bytes), the storages
    of every block's caches after a forward that fills them as generation does (the
    cross-attention's made once from the encoder output)."""
    from attnctl.nn.attention import KVCache
    from attnctl.nn.model import forward
    from attnctl.nn.weights import model_weights

    description = plan.description
    config = plan.config
    device = resolve_device(config.device)
    torch.manual_seed(config.seed)
    weights = model_weights(description, config, device, blocks=None)
    named = {k.removeprefix("decoder."): v for k, v in weights.named.items()}
    token_ids = torch.randint(0, description.vocab_size, (plan.batch, plan.seq_len), device=device)
    encoder_output = torch.randn(
        plan.batch, plan.sizes["Lc"], plan.sizes["D"], device=device,
        dtype=TORCH_DTYPES[config.dtype],
    )  # fmt: skip
    caches: list[dict[str, KVCache]] = [{} for _ in description.blocks]
    with torch.inference_mode():
        forward(description, named, token_ids, last=description.layers - 1, recorded=None,
                context=encoder_output, caches=caches)  # fmt: skip
    del encoder_output
    kept = {"self": {}, "cross": {}}  # storages by address: a tensor and its views once
    for block in caches:
        for name, cache in block.items():
            side = kept["self" if name == "attention" else "cross"]
            for tensor in (cache.keys, cache.values):
                if tensor is not None:
                    storage = tensor.untyped_storage()
                    side[storage.data_ptr()] = storage.nbytes()
    return sum(kept["self"].values()), sum(kept["cross"].values())


def require_trained_weights(plan: Plan) -> None:
    """A header-only folder (its token embedding all zeros) cannot generate: one line."""
    from attnctl.model.checkpoint import load

    source = plan.description.source
    _, shared = load(  # the shared tensors alone, on the CPU: a cheap look
        source.path, source.prefix, source.tensors, source.table, 0, torch.device("cpu"),
        TORCH_DTYPES[plan.config.dtype],
    )  # fmt: skip
    if not shared["embedding.weight"].any():
        raise AttnctlError(
            f"the token embedding in {source.path} is all zeros: a header-only checkpoint? "
            "--generate with --measure generates tokens: it needs the trained weights"
        )


def measure_generated_cache(plan: Plan, new_tokens: int) -> int:
    """The bytes of every block's K and V after generating ``new_tokens`` tokens after a
    prompt of the plan's length: the prompt read once with the caches, then one token a
    step (sliding windows dropping what falls out), as nn/generate.greedy runs; the tokens
    fed are drawn, not chosen (the cache's bytes do not depend on which). Needs the
    trained weights, as ``run`` does: a header-only folder is refused."""
    from attnctl.nn.attention import KVCache
    from attnctl.nn.generate import cache_bytes
    from attnctl.nn.model import forward
    from attnctl.nn.weights import model_weights

    description = plan.description
    config = plan.config
    device = resolve_device(config.device)
    require_trained_weights(plan)
    weights = model_weights(description, config, device, blocks=None)
    torch.manual_seed(config.seed)
    vocab_size = description.vocab_size
    fed = torch.randint(0, vocab_size, (plan.batch, plan.seq_len), device=device)  # (B, L)
    caches: list[dict[str, KVCache]] = [{} for _ in description.blocks]
    offset = 0
    try:
        with torch.inference_mode():
            for _ in range(new_tokens + 1):  # the prompt, then each new token
                forward(description, weights.named, fed, last=description.layers - 1,
                        recorded=None, caches=caches, offset=offset)  # fmt: skip
                offset += fed.shape[1]
                fed = torch.randint(0, vocab_size, (plan.batch, 1), device=device)  # (B, 1)
    except torch.OutOfMemoryError as error:
        raise AttnctlError(
            f"out of memory on {device} while generating", exit_code=RUNTIME
        ) from error
    return cache_bytes(caches)


def _measure(
    forward: Callable[[Callable], None],
    parameters: list[torch.Tensor],
    given: list[torch.Tensor],
    parameter_bytes: int,
    device: torch.device,
) -> Measurement:
    """Run ``forward(record)`` once, taking the activation peak of each recorded stage."""
    try:
        if device.type == "cuda":
            return measure_cuda(forward, given, parameter_bytes, device)
        return _measure_dispatch(forward, parameters, given, parameter_bytes, str(device))
    except torch.OutOfMemoryError as error:
        raise AttnctlError(
            f"out of memory on {device} while measuring", exit_code=RUNTIME
        ) from error


def _measure_dispatch(
    forward: Callable[[Callable], None],
    parameters: list[torch.Tensor],
    given: list[torch.Tensor],
    parameter_bytes: int,
    device: str,
) -> Measurement:
    tracker = LiveStorages()
    stage_peaks: list[int] = []
    recorder = Recorder()

    def record(name: str, tensor: torch.Tensor, dims: str) -> None:
        recorder(name, tensor, dims)
        stage_peaks.append(tracker.take_window_peak())

    for parameter in parameters:
        tracker.exclude(parameter)
    for tensor in given:  # the inputs, made before the forward pass
        tracker.add(tensor)
    with torch.inference_mode(), tracker:
        tracker.take_window_peak()
        forward(record)
    return Measurement(
        device, parameter_bytes, tracker.peak, tuple(stage_peaks), "live tensor storages"
    )


def measure_training(config: LayerConfig, plan: Plan, layers: int = 1) -> Measurement:
    """One training step at the plan's size: forward, loss.backward(), Adam.step().

    The step ``training.py`` models: ``loss = output.sum()``; Adam with foreach=False on
    the parameters in float32, or (float16/bfloat16) on float32 master weights whose
    gradients are copied from the model's just before the step. ``layers``: a stack of
    the plan's block over one shared embedding (block n's weights are block 0's values,
    in tensors of their own). A checkpoint trains every block: the weights its family's
    table maps are trained, the others (a final norm, a head) are loaded and left alone.
    The inputs are the ones ``measure_forward`` makes: a context for cross-attention, the
    last row half padding when the plan masks padding.
    """
    from attnctl.model.describe import ModelDescription
    from attnctl.nn.model import forward
    from attnctl.nn.weights import seeded_layer, trainable_weights

    device = resolve_device(config.device)
    description = plan.description
    if description is not None and description.checkpoint is not None:  # every block
        stack = description
        layers = description.layers
        loaded = trainable_weights(description, config, device)
        named = loaded.named
        parameters = loaded.trained  # the table's, in its order
        parameter_bytes = loaded.parameter_bytes  # the weights it does not use too
    else:
        layer = seeded_layer(config, plan.vocab_size, device).train()
        named = layer.weights()
        block = {k: v for k, v in named.items() if k.startswith("blocks.0.")}
        parameters = [v for k, v in named.items() if not k.startswith("blocks.")]
        for n in range(layers):
            for key, value in block.items():
                tensor = value if n == 0 else value.detach().clone().requires_grad_()
                named[key.replace("blocks.0.", f"blocks.{n}.", 1)] = tensor
                parameters.append(tensor)
        stack = ModelDescription(description.embeddings, description.blocks * layers)
        parameter_bytes = sum(p.numel() * p.element_size() for p in parameters)
    token_ids = torch.randint(0, plan.vocab_size, (plan.batch, plan.seq_len), device=device)
    context_ids = padding = None
    key_len = plan.sizes.get("Lc", plan.seq_len)
    if "Lc" in plan.sizes:
        context_ids = torch.randint(0, plan.vocab_size, (plan.batch, key_len), device=device)
    if "padding_mask" in {s.name for s in plan.stages}:  # the last row: half of it padding
        padding = torch.ones(plan.batch, key_len, dtype=torch.bool, device=device)
        padding[-1, (key_len + 1) // 2 :] = False
    given = [t for t in (token_ids, context_ids, padding) if t is not None]

    def run(record: Callable) -> Any:
        return forward(
            stack,
            named,
            token_ids,
            last=layers - 1,
            record=record,
            padding=padding,
            context_ids=context_ids,
            training=True,
        )

    mixed = config.dtype != "float32"
    return measure_step(run, parameters, given, parameter_bytes, mixed, device)


def measure_step(
    run: Callable[[Callable], Any],
    parameters: list[torch.Tensor],
    given: list[torch.Tensor],
    parameter_bytes: int,
    mixed: bool,
    device: torch.device,
    after_backward: Callable[[], None] | None = None,
    optimizer_step: Callable[[], Callable[[], None]] | None = None,
    held: list[torch.Tensor] | None = None,
) -> Measurement:
    """The memory of one training step of ``run(record)`` (the forward, whose result's
    ``output`` the loss sums) over ``parameters``, in the order Adam gets them, with the
    ``given`` inputs alive throughout: on the CPU the live storages after every op (each
    phase's peak, the backward's peak between one parameter's gradient and the next, and
    the forward's up to each stage ``run`` records), on CUDA the allocator's peaks.
    ``after_backward``: what runs between the backward and the optimizer step (a
    tensor-parallel rank's sum of its replicated weights' gradients over the ranks).
    ``optimizer_step``: made before the forward (what it holds the whole step, such as
    masters, is made then), the step it returns run after the backward; None:
    :func:`adam_step` of ``parameters`` (one device's). ``held``: the tensors
    ``parameter_bytes`` counts, never counted again (None: ``parameters``; ZeRO 3's rank
    holds its shard, its whole parameters counted while they are gathered)."""
    stage_windows: list[int] = []  # CPU: the forward's peak up to each of block 0's stages
    phases: list[int] = []
    reserved: list[int] = []  # CUDA: each phase's max_memory_reserved
    windows: list[int] = []  # CPU: the peak between one parameter's gradient and the next
    # the step, given the forward and what ends each phase
    step = functools.partial(
        _training_step, parameters=parameters, mixed=mixed, after_backward=after_backward,
        optimizer_step=optimizer_step,
    )  # fmt: skip
    try:
        if device.type == "cuda":
            method = measure_step_cuda(run, step, given, device, (phases, reserved))
        else:
            held = parameters if held is None else held
            method = _measure_step_cpu(
                run, step, parameters, given, held, (phases, windows, stage_windows)
            )
    except torch.OutOfMemoryError as error:
        raise AttnctlError(
            f"out of memory on {device} while measuring", exit_code=RUNTIME
        ) from error
    return Measurement(
        str(device),
        parameter_bytes,
        max(phases),
        (),  # a forward pass's per stage; the training step's forward is below
        method,
        tuple(phases),
        tuple(windows),
        tuple(stage_windows),
        reserved_peak_bytes=max(reserved) if reserved else None,
        context_bytes=cuda_context_bytes(device) if device.type == "cuda" else None,
    )


def _measure_step_cpu(
    run: Callable[[Callable], Any],
    step: Callable[..., None],
    parameters: list[torch.Tensor],
    given: list[torch.Tensor],
    held: list[torch.Tensor],
    peaks: tuple[list[int], list[int], list[int]],
) -> str:
    """measure_step on the CPU: the live storages after every op, but ``held`` (counted
    as the parameters' bytes), the ``given`` inputs counted from the start; each phase's
    peak, each gradient's window and each recorded stage's go to ``peaks``' three lists
    (phases, windows, stage windows); the method's name back."""
    phases, windows, stage_windows = peaks
    tracker = LiveStorages()
    for parameter in held:
        tracker.exclude(parameter)
    for tensor in given:
        tracker.add(tensor)

    def phase_ends() -> None:
        phases.append(tracker.peak)
        tracker._forget_freed()
        tracker.peak = 0
        tracker.take_window_peak()  # the backward's first window starts here

    def gradient_arrived(parameter: torch.Tensor) -> None:
        windows.append(tracker.take_window_peak())

    def record(name: str, tensor: torch.Tensor, dims: str) -> None:
        stage_windows.append(tracker.take_window_peak())

    hooks = [p.register_post_accumulate_grad_hook(gradient_arrived) for p in parameters]
    with tracker:
        step(lambda: run(record), phase_ends=phase_ends)
    for hook in hooks:
        hook.remove()
    return "live tensor storages"


def _training_step(
    run: Callable,
    parameters: list[torch.Tensor],
    mixed: bool,
    phase_ends: Callable[[], None],
    after_backward: Callable[[], None] | None = None,
    optimizer_step: Callable[[], Callable[[], None]] | None = None,
) -> None:
    """The step, calling ``phase_ends`` after the forward, the backward and the update."""
    step = adam_step(parameters, mixed) if optimizer_step is None else optimizer_step()
    result = run()
    loss = result.output.sum()
    del result
    phase_ends()
    loss.backward()
    if after_backward is not None:
        after_backward()
    phase_ends()
    step()
    phase_ends()


def adam_step(parameters: list[torch.Tensor], mixed: bool) -> Callable[[], None]:
    """Adam (foreach=False) on ``parameters``, or under mixed precision on float32 master
    weights made now (alive as long as the step returned): just before the step their
    gradients are copied from the parameters', after it the masters into the parameters."""
    masters = [p.detach().float() for p in parameters] if mixed else parameters
    optimizer = torch.optim.Adam(masters, foreach=False)

    def step() -> None:
        if mixed:
            for master, parameter in zip(masters, parameters, strict=True):
                master.grad = parameter.grad.float()
        optimizer.step()
        if mixed:
            with torch.no_grad():
                for master, parameter in zip(masters, parameters, strict=True):
                    parameter.copy_(master)

    return step
