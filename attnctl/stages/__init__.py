"""The plan of each kind of sublayer, torch-free: which stages it computes, in order.

Each module here has a twin under ``attnctl/nn/`` that computes the same stages in torch
and records them under the same names, written out literally in both, so a stage name
in the output leads to its plan and its code with one search. ``plan.py`` walks a
:class:`~attnctl.model.describe.ModelDescription` and calls these.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from attnctl.model.config import DTYPE_BYTES
from attnctl.model.gpu import CudaTarget, rounded
from attnctl.trace import Stage

MASK_CONVENTION = "True = may attend (F.scaled_dot_product_attention convention)"


@dataclass
class PlanBuilder:
    """Collects stages; ``sizes`` maps each named dim (B, L, D, ...) to its number."""

    sizes: dict[str, int]
    dtype: str  # the run's dtype: what a stage is unless it says otherwise
    device: str = ""
    stages: list[Stage] = field(default_factory=list)
    # the names of a scope's stages start with it ("cross_": a decoder's cross-attention)
    scope: str = ""
    # one rank of a split (``attnctl/model/layout.py``): the T ranks its partial sums are added
    # over, and whether the tensors between the sublayers hold L / T tokens (SP)
    tensor_parallel: int = 1
    sequence_parallel: bool = False
    # context parallel (``stages/ring_attention.py``): the C ranks the sequence is cut
    # over, L / C consecutive tokens each, and which of them this is
    context_parallel: int = 1
    context_rank: int = 0
    # a plan on CUDA: the GPU and torch rules it is for (``model/gpu.py``); None elsewhere
    cuda: CudaTarget | None = None

    def pieces(self, *nbytes: int) -> int:
        """The bytes of several temporary tensors together: on CUDA each is rounded up
        to the caching allocator's 512-byte blocks, as it charges them."""
        if self.cuda is None:
            return sum(nbytes)
        return sum(rounded(n) for n in nbytes)

    @contextmanager
    def scoped(self, prefix: str) -> Iterator[None]:
        """Stages added inside are named ``prefix + name``, and a read of ``name`` is of
        the scope's own stage of that name when there is one (``v`` is ``cross_v``)."""
        outer, self.scope = self.scope, prefix
        try:
            yield
        finally:
            self.scope = outer

    def resolve(self, name: str) -> str:
        """The stage a read of ``name`` means inside the current scope."""
        if self.scope and not name.startswith(self.scope):
            scoped = self.scope + name
            if any(s.name == scoped for s in self.stages):
                return scoped
        return name

    def add(
        self,
        name: str,
        dims: str,
        reads: tuple[str, ...] = (),
        *,
        dtype: str | None = None,
        view_of: str | None = None,
        what: str = "",
        scratch: int = 0,
    ) -> str:
        """One stage; returns its name, for the stages that read it."""
        reads = tuple(self.resolve(read) for read in reads)
        view_of = None if view_of is None else self.resolve(view_of)
        owner = next((s.view_of for s in self.stages if s.name == view_of and s.view_of), None)
        view_of = owner or view_of  # the stage that owns the memory, as a run records it
        name = self.scope + name
        dtype = dtype or self.dtype
        dim_names = tuple(dims.split())
        shape = tuple(self.sizes[d] for d in dim_names)
        stage = Stage(
            name,
            dim_names,
            shape,
            dtype,
            product(shape) * DTYPE_BYTES[dtype],
            self.device,
            view_of,
            tuple(reads),
            what,
            scratch,
        )
        self.stages.append(stage)
        return name

    def nbytes(self, dims: str, dtype: str | None = None) -> int:
        """The bytes of a tensor of these named dims."""
        return (
            product(tuple(self.sizes[d] for d in dims.split())) * DTYPE_BYTES[dtype or self.dtype]
        )

    @property
    def hidden(self) -> str:
        """The dims of the tensors between sublayers (norms, residuals): B L D, or with
        sequence parallelism each rank's L / T tokens of them."""
        return "B L/T D" if self.sequence_parallel else "B L D"

    @property
    def last(self) -> str:
        return self.stages[-1].name


def product(shape: tuple[int, ...]) -> int:
    total = 1
    for n in shape:
        total *= n
    return total
