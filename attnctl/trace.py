"""Plain data shared by the plan (predicted) and the run (recorded). Standard library only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Stage:
    """One tensor an attention layer produces, predicted by the plan or recorded by a run."""

    name: str
    dims: tuple[str, ...]  # named dims, e.g. ("B", "H", "L", "d_k")
    shape: tuple[int, ...]
    dtype: str
    bytes: int  # numel * element size, whether or not it owns its memory
    device: str = ""
    view_of: str | None = None  # the earlier stage whose memory this one shares (no new bytes)
    reads: tuple[str, ...] = ()  # stages this one is computed from (plan only; for liveness)
    what: str = ""  # one line for people (plan only)
    scratch: int = 0  # temporary bytes alive only while this stage is computed (plan only)

    @property
    def allocates(self) -> bool:
        return self.view_of is None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dims": list(self.dims),
            "shape": list(self.shape),
            "dtype": self.dtype,
            "device": self.device,
            "bytes": self.bytes,
            "view_of": self.view_of,
        }


@dataclass
class KeptStages:
    """``run --save``: the stages one pass through one block recorded, with a CPU copy of
    each tensor (torch.Tensor), saved as ``prefix + stage name``."""

    prefix: str  # "" (the seeded layer), "block.3.", "prefill.block.3.", "encoder.block.0."
    stages: list[Stage]  # as recorded, in order
    tensors: dict  # stage name -> CPU tensor
    what: str = ""  # one line for people: which pass, which block


@dataclass(frozen=True)
class Token:
    """One token: its id, the text span it covers in the input, and that span's offsets."""

    id: int
    text: str
    start: int
    end: int
    pieces: int = 1  # >1 when several tokens share one character span (a CJK char in bytes)
    piece: int = 1  # which of those pieces this is, 1-based
    pad: bool = False  # padding appended to a shorter text of a batch

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "text": self.text,
            "start": self.start,
            "end": self.end,
            "pad": self.pad,
        }


@dataclass
class RowSums:
    """Sums over every computed weight that the statistics need, made by the run (in torch:
    a long input has millions of weights); ``stats`` computes them itself without them."""

    entropy: list  # (B, heads, rows): -Σ w·log w over each row, in nats
    support: list  # (B, heads, rows): how many keys have weight > 0
    columns: list  # (B, heads, Lk): each key's weight summed over the text's own query rows


@dataclass
class Trace:
    """What one real run produced: tokens, recorded stages, per-head weights (if computed)."""

    tokens: list[list[Token]]  # one list per batch row
    stages: list[Stage]
    attention: list  # (B, heads, rows) nested lists of array("f") rows of Lk weights

    attention_heads: list[int]  # which heads `attention` holds, in its order
    attention_rows: list[int]  # which query rows it holds
    top_keys: list  # (B, heads, rows, K): each row's keys by weight, strongest first (K <= 64)
    device: str
    tokenizer: str  # "bundled BPE", "char", or a path
    vocab_size: int
    impl: str  # the implementation that produced the output: "math" or "sdpa"
    context_tokens: list[list[Token]] | None = None  # cross-attention: the keys' tokens
    layer: int | None = None  # a pretrained model's block these weights come from
    sums: RowSums | None = None
    kept: KeptStages | None = None  # run --save: the stages recorded and their tensors

    def attention_lists(self) -> list:
        """The weights as plain nested lists (B, heads, rows, Lk), e.g. for JSON."""
        return [[[list(row) for row in head] for head in b] for b in self.attention]
