"""The embeddings in torch: token ids -> vectors, plus positions where they are added.

The plan of these stages is ``attnctl/stages/embeddings.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnctl.model.describe import Embeddings
from attnctl.nn import Record, no_record, positions
from attnctl.nn.collectives import TensorGroup


def embed(
    embeddings: Embeddings,
    weights: dict[str, torch.Tensor],
    owned: list[torch.Tensor],
    record: Record = no_record,
    name: str | None = "embeddings",
    offset: int = 0,
    group: TensorGroup | None = None,
) -> torch.Tensor:
    """(B, L, D): the looked-up vectors ``owned = [x]`` (taken out, so they are freed once
    positions are added), with positions (and BERT's segment and norm).

    ``name``: what ``x`` is recorded as (None: not recorded). ``offset``: the position of
    the first token (a decoding step's, after the tokens in the KV cache). ``group``: a
    tensor-parallel rank's, whose vectors (summed over the ranks already) are under
    sequence parallelism its (B, L/T, D): positions for its own tokens.
    """
    x = owned.pop()
    hidden, rows = "B L D", "L D"
    if group is not None and group.sequence_parallel:  # this rank's tokens from here on
        hidden, rows = group.hidden, "L/T D"
        offset += group.rank * x.shape[1]
    if name is not None:
        record(name, x, hidden)
    if embeddings.scale:  # Gemma, Marian: × √D (Gemma rounds the factor to the dtype first)
        factor = embeddings.scale
        if embeddings.scale_rounded:
            factor = torch.tensor(factor, dtype=x.dtype).item()  # √D in the dtype
        x = x * factor  # (B, L, D)
        record("scaled_embeddings", x, hidden)
    seq_len = x.shape[1]
    if embeddings.positions == "sinusoidal":
        added = positions.sinusoidal_positions(
            seq_len, embeddings.d_model, x.device, x.dtype, offset
        )
    elif embeddings.positions == "sinusoidal_halves":
        ids = torch.arange(offset, offset + seq_len, device=x.device)  # (L,)
        added = positions.sinusoidal_halves(ids, embeddings.d_model, x.dtype)  # (L, D)
        del ids
    elif embeddings.positions == "learned":
        first = offset + embeddings.position_offset  # BART's table starts 2 rows later
        ids = torch.arange(first, first + seq_len, device=x.device)  # (L,)
        added = F.embedding(ids, weights["positions.weight"])  # (L, D)
        del ids  # the int64 ids live during the lookup only
    else:  # RoPE turns Q and K in every block; ALiBi biases the scores
        return x
    record("positions", added, rows)
    if embeddings.segment:  # one text: every token in segment 0, added before positions
        x = x + weights["segment.weight"][0]  # (B, L, D)
        x += added
    else:
        x = x + added  # (B, L, D), positions broadcast over the batch
    del added
    record("x", x, hidden)
    if embeddings.norm == "layer":
        x = F.layer_norm(
            x,
            (embeddings.d_model,),
            weights["embedding_norm.weight"],
            weights["embedding_norm.bias"],
            embeddings.norm_eps,
        )  # (B, L, D)
        record("embedding_norm", x, hidden)
    return x


def embed_context(
    embeddings: Embeddings,
    weights: dict[str, torch.Tensor],
    context_ids: torch.Tensor,
    record: Record = no_record,
) -> torch.Tensor:
    """(B, Lc, D): a context embedded as the text is, the keys and values of cross-attention."""
    x = F.embedding(context_ids, weights["embedding.weight"])  # (B, Lc, D)
    record("context_embeddings", x, "B Lc D")
    seq_len = x.shape[1]
    if embeddings.positions == "sinusoidal":
        added = positions.sinusoidal_positions(seq_len, embeddings.d_model, x.device, x.dtype)
    elif embeddings.positions == "learned":
        ids = torch.arange(seq_len, device=x.device)  # (Lc,)
        added = F.embedding(ids, weights["positions.weight"])  # (Lc, D)
        del ids
    else:
        return x
    record("context_positions", added, "Lc D")
    x = x + added  # (B, Lc, D)
    del added
    record("context_x", x, "B Lc D")
    return x
