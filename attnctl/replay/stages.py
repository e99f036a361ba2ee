"""What autograd does at each stage of a plan: one entry per stage name.

``training._replay`` walks a plan's stages (and, for ``--layers N``, its block N times) in
order. Each stage's entry below allocates what its torch code (``attnctl/nn/``)
allocates when autograd records it, says which tensors the backward node keeps, and
lists what that node's backward allocates, in the order the kernels make it. The
Python code's own references end after the last stage that reads a tensor, as the plan
says (``reads``, ``held_until``), so a new stage needs one entry here and nothing else.

Those of an attention sublayer are in ``replay/attention.py``. The entries were written
against the measured timeline of ``memory --measure --train``
(``measure.LiveStorages``: bytes alive after every aten op, on CPU, torch 2.13); the
tests hold the replay equal to it to the byte over the accepted grid.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from attnctl.model.config import DTYPE_BYTES, FP32, LayerConfig
from attnctl.model.describe import FeedForward
from attnctl.model.layout import vocab_rows
from attnctl.replay.autograd import Replay, Tensor
from attnctl.stages.plan import INPUTS, Plan
from attnctl.trace import Stage

EMBEDDING_STAGES = (
    "vocab_mask",  # a tensor-parallel rank's vocab-parallel lookup (replay/collectives.py)
    "local_ids",
    "embeddings",
    "embedding_all_reduce",
    "embedding_reduce_scatter",
    "scaled_embeddings",
    "positions",
    "x",
    "embedding_norm",
    "context_embeddings",
    "context_positions",
    "context_x",
)


@dataclass
class Walk:
    """The state of one replayed forward: tensors by (qualified) stage name."""

    replay: Replay
    plan: Plan
    config: LayerConfig
    block: int = 0
    base: str = ""  # the stage being replayed, as the plan names it
    stages: dict[str, Stage] = field(default_factory=dict)  # by qualified name
    tensors: dict[str, Tensor] = field(default_factory=dict)  # latest version per name
    split: set[str] = field(default_factory=set)  # (B, H, L, d_k) views of (B, L, D)
    # a checkpoint's weights that are parts of one stored tensor (GPT-2's c_attn)
    weight_views: dict[str, Tensor] = field(default_factory=dict)
    # what a stage's code does once the tensors it read last are freed, before it records
    # the stage; and after it records it (once the stage's window has closed)
    then: list[Callable[[], None]] = field(default_factory=list)
    later: list[Callable[[], None]] = field(default_factory=list)
    # tensor parallel without SP: what a block's column-parallel projections read, as
    # Megatron's f hands it to them (by the name of the stage they read)
    to_ranks: dict[str, Tensor] = field(default_factory=dict)
    # ring attention under autograd (``replay/ring.py``): what its function keeps, and
    # the storages held until it returns
    ring: dict[str, Tensor] = field(default_factory=dict)
    ring_held: list[int] = field(default_factory=list)
    # a row-parallel projection's bias under tensor parallelism, added in place after the
    # ranks' sum (its name, its view of a stored tensor or None, its bytes): the next
    # collective stage adds it (``replay.collectives.add_bias``)
    bias_after_sum: tuple[str, Tensor | None, int] | None = None

    @property
    def feed_forward(self) -> FeedForward:
        description = self.plan.description
        return next(s for s in description.blocks[0].sublayers if isinstance(s, FeedForward))

    @property
    def e(self) -> int:
        return DTYPE_BYTES[self.config.dtype]

    @property
    def sizes(self) -> dict[str, int]:
        return self.plan.sizes

    def qualified(self, base: str) -> str:
        """A block stage's name in the walk ("blocks.2.scores"); embeddings keep theirs."""
        return base if base in EMBEDDING_STAGES or base in INPUTS else f"blocks.{self.block}.{base}"

    def stage(self, name: str) -> Stage:
        return self.stages[name]

    def param(self, name: str) -> str:
        """A block's weight by the layout's name ("blocks.2.attention.W_q.weight")."""
        if name.startswith("feed_forward."):
            return f"blocks.{self.block}.{name}"
        return f"blocks.{self.block}.attention.{name}"

    def column_input(self, stage: Stage, x: Tensor) -> Tensor:
        """What a column-parallel projection (W_q, W_k, W_v, W_up, W_gate) reads. Under
        tensor parallelism without SP, ``x`` through Megatron's f (``nn/collectives``
        ``_CopyToRanks``): a view whose gradient, summed from every projection that reads
        it, is all-reduced in place and handed on to ``x`` (where a residual's is added);
        made once, before the first projection. Otherwise ``x`` itself."""
        if self.plan.tensor_parallel == 1 or self.plan.sequence_parallel:
            return x
        name = stage.reads[0]
        if name not in self.to_ranks:
            r = self.replay
            self.to_ranks[name] = r.node(r.view(x), (x,), (), (("pass", 0),))
        return self.to_ranks[name]

    def gathered_from(self, stage: Stage) -> Tensor | None:
        """Under SP, the L / T tokens a column-parallel projection's input was gathered
        from (what Megatron's projection keeps for the backward); else None."""
        if not self.plan.sequence_parallel or self.plan.tensor_parallel == 1:
            return None
        read = stage.reads[0] if stage.reads else ""
        if not read.endswith("all_gather"):
            return None
        return self.tensors[self.stages[read].reads[0]]

    def merges_badly(self, stage: Stage) -> bool:
        """Whether (B, H, ·, ·) of this (B, H, L, d_k) view cannot be merged without a copy:
        only when B, H and L are all above 1 (size-1 dims merge freely)."""
        batch, heads, length = stage.shape[0], stage.shape[1], stage.shape[2]
        return batch > 1 and heads > 1 and length > 1


Entry = Callable[[Walk, Stage, list[Tensor]], Tensor]
ENTRIES: dict[str, Entry] = {}


def entry(*names: str) -> Callable[[Entry], Entry]:
    def register(function: Entry) -> Entry:
        for name in names:
            ENTRIES[name] = function
        return function

    return register


# ------------------------------------------------------------------ embeddings


@entry("embeddings", "context_embeddings")
def _lookup(walk: Walk, stage: Stage, ins: list[Tensor]) -> Tensor:
    r = walk.replay
    ids = walk.tensors["context_ids" if stage.name.startswith("context") else "token_ids"]
    weight = walk.plan.vocab_size * walk.sizes["D"] * walk.e
    if stage.reads == ("local_ids", "vocab_mask"):  # a tensor-parallel rank's rows
        ids, mask = walk.tensors["local_ids"], walk.tensors["vocab_mask"]
        values = vocab_rows(walk.plan.vocab_size, walk.plan.tensor_parallel) * walk.sizes["D"]
        out = r.new(stage.bytes)
        r.leaf_node(out, (ids,), (("param", "embedding.weight", values * walk.e),))
        # masked_fill_ of the ids outside the rank's rows: it keeps the mask
        return r.node(r.view(out), (out,), (mask,), (("grad", 0, stage.bytes),))
    out = r.new(stage.bytes)  # F.embedding; its backward keeps the ids
    return r.leaf_node(out, (ids,), (("param", "embedding.weight", weight),))


@entry("scaled_embeddings")
def _scale_embeddings(walk: Walk, stage: Stage, ins: list[Tensor]) -> Tensor:
    """Gemma: x * √D (a Python number), out of place; its backward scales the gradient."""
    r = walk.replay
    (x,) = ins
    return r.node(r.new(stage.bytes), (x,), (), (("grad", 0, stage.bytes),))


@entry("positions", "context_positions")
def _positions(walk: Walk, stage: Stage, ins: list[Tensor]) -> Tensor:
    r = walk.replay
    if walk.plan.description.embeddings.positions == "sinusoidal":  # a table, no gradient
        return r.new(stage.bytes, transient=stage.scratch)
    ids = r.new(stage.scratch)  # learned: torch.arange(L) int64, kept by the lookup
    out = r.new(stage.bytes)
    weight = walk.plan.description.embeddings.max_positions * walk.sizes["D"] * walk.e
    r.leaf_node(out, (ids,), (("param", "positions.weight", weight),))
    r.drop(ids.storage)
    return out


@entry("x", "context_x")
def _add_positions(walk: Walk, stage: Stage, ins: list[Tensor]) -> Tensor:
    r = walk.replay
    embeddings, positions = ins
    added = (("pass", 0), ("grad", 1, positions.nbytes))  # positions: the batch summed away
    description = walk.plan.description
    if description.embeddings.segment and stage.name == "x":
        # BERT: x + segment.weight[0] (a select of the weight), then += positions in place
        table = description.source.table
        types = next(e.shape[0] for e in table if e.targets == ("segment.weight",))
        d_bytes = walk.sizes["D"] * walk.e
        segment = Tensor(-1, d_bytes)  # a view of the weight: no storage of its own
        r.leaf_node(segment, (), (("param", "segment.weight", types * d_bytes),))
        plus = r.node(r.new(stage.bytes), (embeddings, segment), (),
                      (("pass", 0), ("grad", 1, d_bytes)))  # fmt: skip
        return r.node(r.view(plus), (plus, positions), (), added)
    return r.node(r.new(stage.bytes), (embeddings, positions), (), added)


# ------------------------------------------------------------------ norms and linears


@entry("norm", "ffn_norm", "embedding_norm", "post_norm", "ffn_post_norm")
def _norm(walk: Walk, stage: Stage, ins: list[Tensor]) -> Tensor:
    (x,) = ins
    if walk.base == "ffn_norm":
        norm_type, weight = walk.feed_forward.norm_type, walk.param("feed_forward.norm")
    elif walk.base == "ffn_post_norm":  # Gemma, OLMo 2: the FFN's output normalised
        norm_type, weight = walk.feed_forward.norm_type, walk.param("feed_forward.post_norm")
    elif walk.base == "post_norm":  # the attention's output normalised
        norm_type, weight = walk.config.norm_type, walk.param("post_norm")
    elif walk.base == "embedding_norm":  # BERT: a LayerNorm after the embeddings
        norm_type, weight = "layer", "embedding_norm"
    else:
        norm_type, weight = walk.config.norm_type, walk.param("norm")
    return norm_over_last(walk, stage, x, norm_type, weight)


def norm_over_last(walk: Walk, stage: Stage, x: Tensor, norm_type: str, weight: str) -> Tensor:
    """LayerNorm or RMSNorm over the stage's last dim (D, H·d_k or d_k)."""
    rows = stage.bytes // (stage.shape[-1] * walk.e)
    if norm_type == "layer":
        return _layer_norm(walk, stage, x, rows, weight)
    return _rms_norm(walk, stage, x, rows, weight)


def _layer_norm(walk: Walk, stage: Stage, x: Tensor, rows: int, weight: str) -> Tensor:
    """native_layer_norm: output, mean and rstd (the activation dtype on CPU), kept."""
    r = walk.replay
    d_bytes = stage.shape[-1] * walk.e
    out = r.new(stage.bytes, read=False)
    mean = r.new(rows * walk.e, read=False)
    rstd = r.new(rows * walk.e)
    r.node(
        out,
        (x,),
        (x, mean, rstd),
        (("grad", 0, x.nbytes), ("param", f"{weight}.weight", d_bytes),
         ("param", f"{weight}.bias", d_bytes)),
    )  # fmt: skip
    r.drop(mean.storage)
    r.drop(rstd.storage)
    return out


def _rms_norm(walk: Walk, stage: Stage, x: Tensor, rows: int, weight_name: str) -> Tensor:
    """F.rms_norm, which autograd records op by op: in float32 (a float32 copy of a half
    input first), x · rsqrt(mean(x²) + eps) · weight, then cast back."""
    r = walk.replay
    wide = rows * stage.shape[-1] * FP32  # (B, L, D) in float32
    row = rows * FP32  # (B, L, 1) in float32
    half = walk.e != FP32
    upcast = r.node(r.new(wide), (x,), (), (("grad", 0, x.nbytes),)) if half else x
    # x.pow(2): its backward is grad · 2 · x.pow(1), two temporaries on the way
    twice = (("temp", "a", wide), ("temp", "b", wide), ("grad", 0, wide), ("free", "a"),
             ("free", "b"))  # fmt: skip
    squared = r.node(r.new(wide), (upcast,), (upcast,), twice)
    mean = r.node(r.new(row), (squared,), (), (("grad", 0, wide),))  # expand, then / D
    plus_eps = r.node(r.view(mean), (mean,), (), (("pass", 0),))  # .add_(eps)
    cubed = (("temp", "a", row), ("temp", "b", row), ("grad", 0, row), ("free", "a"),
             ("free", "b"))  # fmt: skip
    rstd = r.new(row)
    r.node(rstd, (plus_eps,), (rstd,), cubed)  # rsqrt keeps its result
    r.drop(squared.storage)  # the expression's temporaries, freed when it ends
    r.drop(mean.storage)
    normed = r.new(wide)
    r.node(normed, (upcast, rstd), (upcast, rstd),
           (("grad", 0, wide), ("temp", "p", wide), ("grad", 1, row), ("free", "p")))  # fmt: skip
    r.drop(rstd.storage)
    weight, width = f"{weight_name}.weight", stage.shape[-1]
    if half:  # the weight's gradient is summed in float32, then cast to its dtype
        to_weight = (("temp", "s", width * FP32), ("free", "p"),
                     ("param", weight, width * walk.e), ("free", "s"))  # fmt: skip
    else:
        to_weight = (("param", weight, width * FP32), ("free", "p"))
    scaled = r.new(wide)
    r.node(scaled, (normed,), (normed,), (("grad", 0, wide), ("temp", "p", wide), *to_weight))
    r.drop(normed.storage)
    if half:
        r.drop(upcast.storage)
        out = r.node(r.new(stage.bytes), (scaled,), (), (("grad", 0, wide),))  # .type_as(x)
        r.drop(scaled.storage)
        return out
    return scaled


def linear(
    walk: Walk, stage: Stage, x: Tensor, name: str, bias: bool, strided_gradient: bool = False
) -> Tensor:
    """F.linear over (B, L, ·): addmm with a bias (input's gradient first), mm without
    (the weight's first). ``strided_gradient``: the incoming gradient is not contiguous,
    so the backward first copies it (and lets the original go). A column-parallel
    projection of the gathered sequence under SP is Megatron's instead
    (:func:`_sequence_parallel_linear`)."""
    r = walk.replay
    e = walk.e
    rows = 1
    for n in stage.shape[:-1]:
        rows *= n
    width_out = stage.shape[-1]
    width_in = x.nbytes // (rows * e)
    weight_name, bias_name = walk.param(f"{name}.weight"), walk.param(f"{name}.bias")
    weight_view = walk.weight_views.get(weight_name)  # a part of a stored tensor, or None
    bias_view = walk.weight_views.get(bias_name) if bias else None
    shard = walk.gathered_from(stage)
    if shard is not None:
        weight_bytes, bias_bytes = width_in * width_out * e, width_out * e if bias else 0
        return _sequence_parallel_linear(
            walk, stage, x, shard, (weight_name, weight_view, weight_bytes),
            (bias_name, bias_view, bias_bytes), strided_gradient,
        )  # fmt: skip

    def flattened() -> Tensor:  # x.view(B·L, ·): its node hands the gradient back to x
        return r.node(r.view(x), (x,), (), (("pass", 0),))

    def transposed() -> Tensor:  # weight.t(): its node hands the gradient on to the weight
        steps = (("pass", 0),) if weight_view else (("param_in", weight_name),)
        return r.node(Tensor(-1, 0), (weight_view,), (), steps)  # no storage of its own

    # the order F.linear makes them: the view before weight.t() with a bias, after without
    x_2d, weight_t = (flattened(), transposed()) if bias else (None, transposed())
    if x_2d is None:
        x_2d = flattened()
    out = r.new(stage.bytes)
    weight_grad = ("grad", 1, width_in * width_out * e)
    to_bias = ("grad", 2, width_out * e) if bias_view else ("param", bias_name, width_out * e)
    if bias:
        steps: tuple[tuple, ...] = (("grad", 0, x.nbytes), weight_grad, to_bias)
    else:
        steps = (weight_grad, ("grad", 0, x.nbytes))
    if strided_gradient:
        steps = (("temp", "g", stage.bytes), ("drop_incoming",), *steps, ("free", "g"))
    return r.node(out, (x_2d, weight_t, bias_view), (x,), steps)


def row_parallel_linear(walk: Walk, stage: Stage, x: Tensor, name: str, bias: bool) -> Tensor:
    """W_o or the feed-forward's down projection: :func:`linear`, except under tensor
    parallelism, where the rank's linear has no bias (mm: the weight's gradient first)
    and the bias is added in place after the ranks' sum (``nn/collectives.reduce_partial``):
    the collective stage that follows adds its node, whose backward makes the bias's
    gradient before this linear's (``walk.bias_after_sum``)."""
    if walk.plan.tensor_parallel == 1 or not bias:
        return linear(walk, stage, x, name, bias)
    bias_name = walk.param(f"{name}.bias")
    walk.bias_after_sum = (bias_name, walk.weight_views.get(bias_name), stage.shape[-1] * walk.e)
    return linear(walk, stage, x, name, False)


def _sequence_parallel_linear(
    walk: Walk,
    stage: Stage,
    x: Tensor,
    shard: Tensor,
    weight: tuple[str, Tensor | None, int],
    bias: tuple[str, Tensor | None, int],
    strided_gradient: bool,
) -> Tensor:
    """``nn/collectives._SequenceParallelLinear``: the output made as F.linear makes it;
    autograd keeps the rank's L / T tokens (``shard``) and the weight, not the gathered
    ``x``. Its backward: (a copy of a strided gradient,) x's gradient, the tokens
    gathered again, the weight's gradient, the bias's, then the gathered let go."""
    r = walk.replay
    (weight_name, weight_view, weight_bytes), (bias_name, bias_view, bias_bytes) = weight, bias
    out = r.new(stage.bytes)

    def to(name: str, view: Tensor | None, slot: int, nbytes: int) -> tuple:
        return ("grad", slot, nbytes) if view is not None else ("param", name, nbytes)

    steps: list[tuple] = [("temp", "c", stage.bytes)] if strided_gradient else []
    steps += [("grad", 0, x.nbytes), ("temp", "t", x.nbytes),
              to(weight_name, weight_view, 1, weight_bytes)]  # fmt: skip
    if bias_bytes:
        steps.append(to(bias_name, bias_view, 2, bias_bytes))
    steps.append(("free", "t"))
    if strided_gradient:
        steps.append(("free", "c"))
    node = r.node(out, (x, weight_view, bias_view), (shard,), tuple(steps))
    if walk.base in LAST_COLUMN_PROJECTIONS:  # `del h, shard`: the code's hold ends
        r.drop(shard.storage)
    return node


# the last projection that reads a sublayer's gathered sequence (nn/attention.py: W_v;
# nn/feed_forward.py: W_up), after which the code lets go of the tokens it kept for them
LAST_COLUMN_PROJECTIONS = ("v", "ffn_up")


def weight_views(walk: Walk) -> None:
    """A checkpoint's weights that are views of what it stores (GPT-2's Conv1D weights,
    transposed; its c_attn, split into W_q, W_k, W_v): their nodes, made in the table's
    order when the weights load, before any of the forward's, so the backward runs them
    last. A split concatenates its parts' gradients once all have come; a transposed
    split's result is cloned into the stored tensor's layout by AccumulateGrad."""
    model = walk.plan.model
    if model is None:
        return
    r = walk.replay
    for entry in model.source.table:
        if not entry.transposed and len(entry.targets) < 2:
            continue
        count = 1
        for n in entry.shape:
            count *= n
        split = len(entry.targets) > 1
        views = [Tensor(-1, 0)]
        if entry.transposed:  # .t(): the stored tensor's gradient, from the layout's
            r.node(views[0], (), (), (("param_in", entry.key, split),))
        if split:
            steps = (("grad", 0, count * walk.e),) if entry.transposed else (
                ("param", entry.key, count * walk.e),)  # fmt: skip
            inputs = (views[0],) if entry.transposed else ()
            views = r.split_node(len(entry.targets), inputs, steps)
        walk.weight_views.update(zip(entry.targets, views, strict=True))


# ------------------------------------------------------------------ the feed-forward


@entry("ffn_up", "ffn_gate", "ffn_down")
def _ffn_projection(walk: Walk, stage: Stage, ins: list[Tensor]) -> Tensor:
    name = "feed_forward." + walk.base.removeprefix("ffn_")
    if walk.base == "ffn_down":
        return row_parallel_linear(walk, stage, ins[0], name, walk.feed_forward.bias)
    return linear(walk, stage, walk.column_input(stage, ins[0]), name, walk.feed_forward.bias)


@entry("ffn_act")
def _activation(walk: Walk, stage: Stage, ins: list[Tensor]) -> Tensor:
    """gelu and silu keep their input for the backward, relu its output."""
    r = walk.replay
    (x,) = ins
    out = r.new(stage.bytes)
    kept = out if walk.feed_forward.activation == "relu" else x
    return r.node(out, (x,), (kept,), (("grad", 0, stage.bytes),))


@entry("ffn_product")
def _gate_times_up(walk: Walk, stage: Stage, ins: list[Tensor]) -> Tensor:
    """``act *= up`` in place: autograd keeps a copy of act as it was, and up."""
    r = walk.replay
    act, up = ins
    original = r.new(act.nbytes)
    out = r.node(r.view(act), (act, up), (original, up), (("grad", 0, act.nbytes),
                                                          ("grad", 1, up.nbytes)))  # fmt: skip
    r.drop(original.storage)
    return out


@entry("ffn_residual")
def _ffn_residual(walk: Walk, stage: Stage, ins: list[Tensor]) -> Tensor:
    """``out += x`` in place. With a bias the linear's output is a view of its (B·L, D)
    result, and an in-place op on a view is CopySlices in the backward: the gradient laid
    into a tensor of the base's shape, and a copy of it for x. A tensor-parallel rank's
    linear has no bias (added after the sum, :func:`row_parallel_linear`): mm's result
    is not a view, and the add hands the gradient on to both."""
    r = walk.replay
    down, x = ins
    r.read()  # the add_ is an op: the bytes alive then, x among them, are read
    linear_bias = walk.feed_forward.bias and walk.plan.tensor_parallel == 1
    if not linear_bias or walk.feed_forward.output_norm:  # not a linear's view
        return r.node(r.view(down), (down, x), (), (("pass", 0), ("pass", 1)))
    base = r.node(r.view(down), (down, x), (), (("grad", 0, down.nbytes), ("grad", 1, x.nbytes)))
    return r.node(r.view(down), (base,), (), (("grad", 0, down.nbytes),))  # as_strided
