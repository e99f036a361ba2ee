"""A torch-free replay of autograd's memory: storages, saved tensors, the engine's order.

``replay/stages.py`` walks a plan's stages and, per stage, records what its forward
allocates, which tensors autograd saves, and what its backward allocates; this module
keeps the books. A storage lives while anything holds it: the Python code that computes
the forward (released after the stage that reads it last, as the plan says), a node that
saved it (released when the node's backward has run), or a gradient on its way. The
bytes alive are read after every op, as the measurement (``measure.LiveStorages``) reads
them: a tensor freed between two ops is gone when the next op's output is counted.

The backward runs the nodes as torch's engine does on one device: of the nodes whose
gradient is complete, the one created last first (nodes made when the weights were
loaded, views of what a checkpoint stores, run last). A gradient that arrives for a
tensor that already has one is summed out of place (``old + new``); a parameter's are
summed the same way in AccumulateGrad's buffer, which runs once all have come, before
any other ready node, and keeps the sum as the parameter's gradient.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field


@dataclass(eq=False)
class Tensor:
    """A value of the forward: its storage and, when a gradient flows to it, the node
    that made it (None: a leaf, or no gradient)."""

    storage: int
    nbytes: int  # its bytes (0: a view of a weight, with no storage of its own)
    node: Node | None = None
    slot: int = 0  # which of the node's gradients it is (a split has one per part)


@dataclass(eq=False)
class Node:
    """One backward function: ``steps`` run in order when its gradient is complete."""

    seq: int
    inputs: tuple[Tensor | None, ...]  # where its gradients go (None: nowhere)
    saved: tuple[int, ...]  # storages it holds until it has run
    steps: tuple[tuple, ...]
    pending: int = 0  # gradients still to arrive
    unit: int | None = None  # ZeRO 3: the unit (block, -1 outside) whose forward made it


# The steps of a node's backward (each op's allocation is read once it is made):
#   ("grad", i, nbytes)   a new gradient for input i
#   ("pass", i)           input i gets the incoming gradient itself (a view, no bytes)
#   ("param", name, nbytes[, copied])  a parameter's gradient (copied: AccumulateGrad
#                         clones it into the parameter's layout)
#   ("param_in", name[, copied])  the incoming gradient goes to the parameter (a view's
#                         node in front of AccumulateGrad: W.t() in F.linear)
#   ("temp", key, nbytes) a temporary of this backward, alive until ("free", key)
#   ("free", key)
#   ("drop_incoming",)    the incoming gradient is let go early (a copy replaced it)
#   ("give", i, key)      the temporary ``key`` becomes input i's gradient (no new bytes)


@dataclass
class Replay:
    live: dict[int, int] = field(default_factory=dict)  # storage -> bytes
    holds: dict[int, int] = field(default_factory=dict)  # storage -> holders
    current: int = 0
    peak: int = 0
    peak_phase: str = ""
    phase: str = "forward"
    phase_peaks: dict[str, int] = field(default_factory=dict)
    param_grads: dict[str, int] = field(default_factory=dict)  # name -> storage
    nodes: list[Node] = field(default_factory=list)
    # the backward's peak up to each parameter's gradient (measure.py reads the same)
    gradient_windows: list[int] = field(default_factory=list)
    # each parameter's gradient let go as soon as AccumulateGrad has made it (ZeRO 2 and
    # 3: a hook reduce-scatters it into the rank's shard and frees it); the shard, of
    # these bytes, is made by the first gradient's hook (None: gradients kept)
    gradient_shard_bytes: int | None = None
    shard_made: bool = False
    # ZeRO 3: each unit's gathered weights (bytes, by unit: -1 outside the blocks, then
    # each block), gathered while its forward runs, again when the backward reaches its
    # first node, freed once its last gradient has gone (None: the weights are whole)
    unit_bytes: dict[int, int] | None = None
    unit: int | None = None  # the unit the forward is in (its nodes are tagged with it)
    _gathered: dict[int, int] = field(default_factory=dict)  # unit -> its storage
    _regathered: set[int] = field(default_factory=set)  # units the backward has gathered
    _window: int = -1  # the peak since the last gradient; -1: no op since
    # the stage whose forward made each storage (``origin`` while it is replayed): what
    # the forward saves, stage by stage (``training.saved_by_stage``)
    origin: str = ""
    origins: dict[int, str] = field(default_factory=dict)
    _ids: itertools.count = field(default_factory=itertools.count)
    _seq: itertools.count = field(default_factory=itertools.count)

    # ---------------------------------------------------------------- bytes alive
    def close_window(self, windows: list[int]) -> None:
        """The most alive since the last window closed (the bytes alive now if no op
        allocated since), appended to ``windows``; the next window starts."""
        windows.append(self.current if self._window < 0 else self._window)
        self._window = -1

    def start(self, phase: str) -> None:
        """The next phase of the step begins (its first gradient window with it)."""
        self.phase = phase
        self._window = -1

    def read(self, transient: int = 0) -> None:
        """One op has finished: its outputs (and ``transient`` bytes still alive in it)."""
        alive = self.current + transient
        self._window = max(self._window, alive)
        if alive > self.phase_peaks.get(self.phase, -1):
            self.phase_peaks[self.phase] = alive
        if alive > self.peak:
            self.peak, self.peak_phase = alive, self.phase

    def new(self, nbytes: int, transient: int = 0, read: bool = True) -> Tensor:
        """A new storage, held once (by the code that made it)."""
        storage = next(self._ids)
        self.live[storage] = nbytes
        self.origins[storage] = self.origin
        self.holds[storage] = 1
        self.current += nbytes
        if read:
            self.read(transient)
        return Tensor(storage, nbytes)

    def view(self, tensor: Tensor) -> Tensor:
        """Another tensor on the same storage (its own node, if one is attached)."""
        return Tensor(tensor.storage, tensor.nbytes)

    def hold(self, storage: int) -> None:
        self.holds[storage] += 1

    def drop(self, storage: int) -> None:
        self.holds[storage] -= 1
        if self.holds[storage] == 0:
            del self.holds[storage]
            self.current -= self.live.pop(storage)

    # ---------------------------------------------------------------- ZeRO 3's units
    def gather(self, unit: int | None) -> None:
        """Unit ``unit``'s weights gathered (once; not a unit of this replay: nothing)."""
        if self.unit_bytes is None or unit is None or unit in self._gathered:
            return
        if unit in self.unit_bytes:
            self._gathered[unit] = self.new(self.unit_bytes[unit]).storage

    def release(self, unit: int | None) -> None:
        """Unit ``unit``'s gathered weights freed (if gathered)."""
        if unit in self._gathered:
            self.drop(self._gathered.pop(unit))

    def enter_unit(self, unit: int | None) -> None:
        """The forward moves on to ``unit``: the one before freed, this one gathered."""
        if unit != self.unit:
            self.release(self.unit)
            self.unit = unit
            self.gather(unit)

    # ---------------------------------------------------------------- the graph
    def node(
        self,
        out: Tensor,
        inputs: tuple[Tensor | None, ...],
        saved: tuple[Tensor, ...],
        steps: tuple[tuple, ...],
    ) -> Tensor:
        """Attach a backward node to ``out``; it holds the storages of ``saved``."""
        inputs = tuple(t if t is not None and t.node is not None else None for t in inputs)
        # a gradient is computed only for an input that needs one (needs_input_grad)
        steps = tuple(s for s in steps if s[0] not in ("grad", "pass") or inputs[s[1]] is not None)
        for tensor in saved:
            self.hold(tensor.storage)
        out.node = Node(next(self._seq), inputs, tuple(t.storage for t in saved), steps,
                        unit=self.unit)  # fmt: skip
        self.nodes.append(out.node)
        return out

    def split_node(
        self, parts: int, inputs: tuple[Tensor | None, ...], steps: tuple[tuple, ...]
    ) -> list[Tensor]:
        """A node with one gradient per part, run once all have arrived (a weight split
        into views): the views, as tensors with no storage of their own."""
        node = Node(next(self._seq), inputs, (), steps, unit=self.unit)
        self.nodes.append(node)
        return [Tensor(-1, 0, node, slot) for slot in range(parts)]

    def leaf_node(self, out: Tensor, saved: tuple[Tensor, ...], steps: tuple[tuple, ...]):
        """A node whose gradients go only to parameters (an embedding lookup)."""
        return self.node(out, (), saved, steps)

    # ---------------------------------------------------------------- backward
    def backward(self, root: Tensor, seed: Tensor) -> None:
        """Run every node that ``root`` depends on, from the gradient ``seed``."""
        if root.node is None:
            return
        nodes = _graph(root.node)
        arriving: dict[str, int] = {}  # parameter -> gradients still to come to it
        for node in nodes:
            for step in node.steps:
                if step[0] in ("param", "param_in"):
                    arriving[step[1]] = arriving.get(step[1], 0) + 1
        waiting: dict[int, int] = {}  # ZeRO 3: unit -> its parameters' gradients to go
        for name in arriving:
            waiting[parameter_unit(name)] = waiting.get(parameter_unit(name), 0) + 1
        # (node, slot) -> the gradient storage arrived so far
        buffers: dict[tuple[int, int], int] = {(id(root.node), 0): seed.storage}
        grad_bytes: dict[int, int] = {seed.storage: seed.nbytes}
        self.hold(seed.storage)
        ready = [(-root.node.seq, root.node)]
        while ready:
            _, node = heapq.heappop(ready)
            if node.unit is not None and node.unit not in self._regathered:
                self._regathered.add(node.unit)  # the hook on the unit's output
                self.gather(node.unit)
            slots = [key for key in buffers if key[0] == id(node)]
            incoming = [buffers.pop(key) for key in sorted(slots)]
            outgoing, params = self._run_steps(node, incoming, grad_bytes)
            self._send_gradients(node, outgoing, buffers, grad_bytes, ready)
            for name, grad, copied in params:
                self._accumulate(name, grad, copied, arriving, waiting)
        self.drop(seed.storage)

    def _run_steps(
        self, node: Node, incoming: list[int], grad_bytes: dict[int, int]
    ) -> tuple[dict[int, Tensor], list[tuple[str, Tensor, bool]]]:
        """Run ``node``'s steps on its ``incoming`` gradients (storages), then let go of
        what it saved and of them. Returns its gradients by input, and the parameters'
        (name, gradient, copied) for AccumulateGrad."""
        outgoing: dict[int, Tensor] = {}
        temps: dict[str, int] = {}
        held = True  # the incoming gradients, until the node lets them go
        params: list[tuple[str, Tensor, bool]] = []  # for AccumulateGrad, once done
        for step in node.steps:
            kind = step[0]
            if kind == "grad":
                outgoing[step[1]] = self.new(step[2])
            elif kind == "pass":
                self.hold(incoming[0])
                outgoing[step[1]] = Tensor(incoming[0], grad_bytes[incoming[0]])
            elif kind == "param":  # ("param", name, nbytes[, copied])
                params.append((step[1], self.new(step[2]), len(step) > 3 and step[3]))
            elif kind == "param_in":  # the incoming gradient is the parameter's
                self.hold(incoming[0])
                grad = Tensor(incoming[0], grad_bytes[incoming[0]])
                params.append((step[1], grad, len(step) > 2 and step[2]))
            elif kind == "temp":
                temps[step[1]] = self.new(step[2]).storage
            elif kind == "give":  # ("give", i, key): the temporary is input i's gradient
                storage = temps.pop(step[2])
                outgoing[step[1]] = Tensor(storage, self.live[storage])
            elif kind == "free":
                self.drop(temps.pop(step[1]))
            elif kind == "drop_incoming":  # a copy of it is used from here on
                for storage in incoming:
                    self.drop(storage)
                held = False
        for storage in node.saved:
            self.drop(storage)
        if held:
            for storage in incoming:
                self.drop(storage)
        return outgoing, params

    def _send_gradients(
        self,
        node: Node,
        outgoing: dict[int, Tensor],
        buffers: dict[tuple[int, int], int],
        grad_bytes: dict[int, int],
        ready: list[tuple[int, Node]],
    ) -> None:
        """``node``'s gradients to the nodes of its inputs (summed out of place with one
        already there); a node whose gradients are all there is ready."""
        for index, tensor in enumerate(node.inputs):
            if tensor is None or index not in outgoing:
                continue
            grad = outgoing[index]
            grad_bytes[grad.storage] = grad.nbytes
            target = tensor.node
            key = (id(target), tensor.slot)
            if key in buffers:  # old + new, out of place
                total = self.new(grad.nbytes)
                grad_bytes[total.storage] = total.nbytes
                self.drop(buffers[key])
                self.drop(grad.storage)
                buffers[key] = total.storage
            else:
                buffers[key] = grad.storage
            target.pending -= 1
            if target.pending == 0:
                heapq.heappush(ready, (-target.seq, target))

    def _accumulate(
        self,
        name: str,
        grad: Tensor,
        copied: bool,
        arriving: dict[str, int],
        waiting: dict[int, int],
    ) -> None:
        """One gradient of parameter ``name`` into AccumulateGrad's buffer, which runs once
        every one has come (``copied``: into the parameter's layout), ending a gradient
        window; under ZeRO 2 and 3 its hook then reduces and frees it."""
        if name in self.param_grads:  # another one: old + new in AccumulateGrad's
            total = self.new(grad.nbytes)  # buffer, out of place
            self.drop(self.param_grads[name])
            self.drop(grad.storage)
            grad = total
        self.param_grads[name] = grad.storage
        arriving[name] -= 1
        if arriving[name]:
            return  # AccumulateGrad runs once every gradient has come
        if copied:  # not in the parameter's layout: cloned into it
            copy = self.new(grad.nbytes)
            self.drop(grad.storage)
            self.param_grads[name] = copy.storage
        # AccumulateGrad runs first of the ready nodes: a gradient window ends
        self.close_window(self.gradient_windows)
        if self.gradient_shard_bytes is not None:  # its post-accumulate hook
            if not self.shard_made:
                self.new(self.gradient_shard_bytes)  # the first one makes the shard
                self.shard_made = True
            self.read()  # its reduce runs in the next window, the gradient alive
            self.drop(self.param_grads.pop(name))  # and frees it
            unit = parameter_unit(name)
            waiting[unit] -= 1
            if waiting[unit] == 0:  # ZeRO 3: the unit's last gradient has gone
                self.release(unit)


def _graph(root: Node) -> list[Node]:
    """Every node ``root`` depends on (``root`` first), each counting the gradients it
    waits for (``pending``)."""
    nodes: list[Node] = []
    stack, seen = [root], {id(root)}
    while stack:
        node = stack.pop()
        nodes.append(node)
        for tensor in node.inputs:
            if tensor is None:
                continue
            tensor.node.pending += 1
            if id(tensor.node) not in seen:
                seen.add(id(tensor.node))
                stack.append(tensor.node)
    return nodes


def parameter_unit(name: str) -> int:
    """ZeRO 3's unit of a parameter: its block ("blocks.N."), or -1 outside the blocks."""
    if name.startswith("blocks."):
        return int(name.split(".", 2)[1])
    return -1
