"""Greedy decoding in torch, step by step with a KV cache, keeping what attnctl shows.

A decoder-only model reads the prompt once (the prefill), then one token a step; an
encoder–decoder encodes the source once, and its decoder starts from the start token,
one token a step, its cross-attention reading K and V made from the encoder output at
the first step. Each step keeps the attention rows of the shown blocks and what the
cache holds. The last token chosen is fed once more, so that its row and its K and V
exist: the rows then cover the whole final sequence, and the cache holds every position.

The token chosen is the arg-max of the logits after the rules of the model's generation
config (:class:`~attnctl.model.describe.Generation`), as transformers' ``generate(do_sample=
False, num_beams=1)`` applies them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from attnctl.model.describe import Generation, ModelDescription
from attnctl.nn import Record
from attnctl.nn.attention import KVCache
from attnctl.nn.model import final_norm, forward, logits, sublayer_weights


@dataclass
class Step:
    """One decoding step: the token each row chose, and the cache after it."""

    tokens: list[int]  # (B,) the token chosen (a finished row's pad)
    query_position: int  # the position of the token whose row chose it
    cache: list[dict[str, tuple[int, ...]]]  # per block: sublayer name -> (B, Hkv, T, d_k)
    cache_bytes: int  # measured: the bytes of every K and V kept (storages)
    dropped: int = 0  # positions that fell out of sliding windows (the most in any block)


@dataclass
class Decoded:
    """What a greedy run computed, for the report."""

    generated: list[list[int]]  # (B, N) the tokens chosen
    steps: list[Step]
    # (block, sublayer name) -> (B, h, T, Lk) float32: every row of the fed sequence, each
    # as its step computed it, over the keys at positions 0 … Lk-1 (0 where a sliding
    # window had dropped a key, or a key did not exist yet)
    attention: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    final_cache_bytes: int = 0  # after the last token was fed
    final_cache: list[dict[str, tuple[int, ...]]] = field(default_factory=list)


@dataclass
class Encoded:
    output: torch.Tensor  # (B, Ls, D): the encoder's output (after its final norm)
    attention: dict[tuple[int, str], torch.Tensor]  # (block, "attention") -> (B, h, Ls, Ls)


def encode(
    model: ModelDescription,
    weights: dict[str, torch.Tensor],
    source_ids: torch.Tensor,
    padding: torch.Tensor | None,
    shown: Sequence[int],
    heads: list[int],
    records: Mapping[int, Record] | None = None,
) -> Encoded:
    """The encoder over source ids (B, Ls); ``padding`` (B, Ls) True = a real token.
    ``records``: block n's stages go to ``records[n]`` (``forward``'s)."""
    rows = list(range(source_ids.shape[1]))
    out = forward(
        model,
        weights,
        source_ids,
        last=model.layers - 1,
        recorded=None,
        records=records,
        padding=padding,
        shown=shown,
        window=(heads, rows),
    )
    attention = {key: window.float() for key, (window, _) in out.shown.items()}
    return Encoded(final_norm(model, weights, out.output), attention)


def greedy(
    model: ModelDescription,
    weights: dict[str, torch.Tensor],
    prompt_ids: torch.Tensor,
    new_tokens: int,
    shown: Sequence[int],
    heads: list[int],
    encoder_output: torch.Tensor | None = None,
    encoder_padding: torch.Tensor | None = None,
    prefill_records: Mapping[int, Record] | None = None,
) -> Decoded:
    """Generate up to ``new_tokens`` tokens after ``prompt_ids`` (B, L), greedily.

    ``model``: a decoder-only model, or an encoder–decoder's decoder (``weights`` its own,
    without the ``decoder.`` prefix) with the ``encoder_output`` (B, Ls, D) it attends to.
    ``prefill_records``: block n's stages of the first pass (the prompt's) go to
    ``prefill_records[n]`` (``forward``'s ``records``); the later steps record nothing.
    """
    rules = model.generation or Generation()
    batch, prompt_len = prompt_ids.shape
    device = prompt_ids.device
    caches: list[dict[str, KVCache]] = [{} for _ in model.blocks]
    pieces: dict[tuple[int, str], list[tuple[torch.Tensor, int, int]]] = {}
    eos = torch.tensor(rules.eos_ids or [-1], device=device)  # (E,)
    pad = rules.pad_id if rules.pad_id is not None else (rules.eos_ids or (0,))[0]
    finished = torch.zeros(batch, dtype=torch.bool, device=device)  # (B,)
    sequence = prompt_ids  # (B, L + n): every token so far
    fed, offset = prompt_ids, 0
    generated: list[list[int]] = [[] for _ in range(batch)]
    steps: list[Step] = []
    while True:
        out = forward(
            model,
            weights,
            fed,
            last=model.layers - 1,
            recorded=None,
            records=prefill_records if not steps and offset == 0 else None,
            shown=shown,
            window=(heads, list(range(fed.shape[1]))),
            context=encoder_output,
            context_padding=encoder_padding,
            caches=caches,
            offset=offset,
        )
        for key, (window, key_start) in out.shown.items():
            pieces.setdefault(key, []).append((window.float(), offset, key_start))
        offset += fed.shape[1]
        if len(steps) == new_tokens or bool(finished.all()):
            break  # the last token fed: its row and its K, V exist now
        hidden = final_norm(model, weights, out.output[:, -1:])  # (B, 1, D)
        del out
        scores = logits(model, weights, hidden)[:, -1].float()  # (B, V)
        scores = apply_rules(rules, scores, sequence, prompt_len, new_tokens)
        chosen = scores.argmax(dim=-1)  # (B,)
        chosen = torch.where(finished, torch.full_like(chosen, pad), chosen)
        finished |= torch.isin(chosen, eos)
        sequence = torch.cat((sequence, chosen[:, None]), dim=1)  # (B, L + n + 1)
        for row, token in zip(generated, chosen.tolist(), strict=True):
            row.append(token)
        steps.append(
            Step(
                tokens=chosen.tolist(),
                query_position=offset - 1,
                cache=cache_shapes(caches),
                cache_bytes=cache_bytes(caches),
                dropped=max((c.start for block in caches for c in block.values()), default=0),
            )
        )
        fed = chosen[:, None]  # (B, 1)
    attention = {key: _assemble(parts) for key, parts in pieces.items()}
    return Decoded(
        generated=generated,
        steps=steps,
        attention=attention,
        final_cache_bytes=cache_bytes(caches),
        final_cache=cache_shapes(caches),
    )


def decoder_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An encoder–decoder's decoder weights by their names within the decoder."""
    return sublayer_weights(weights, "decoder.")


def apply_rules(
    rules: Generation,
    scores: torch.Tensor,
    sequence: torch.Tensor,
    prompt_len: int,
    new_tokens: int,
) -> torch.Tensor:
    """The logits (B, V) after the generation config's rules, for the next token of
    ``sequence`` (B, n): what transformers' logits processors do to them, in its order."""
    length = sequence.shape[1]  # tokens so far (an encoder–decoder's: from its start token)
    blocked = float("-inf")
    if rules.repetition_penalty != 1.0:  # tokens already in the sequence: less likely
        seen = scores.gather(1, sequence)  # (B, n)
        seen = torch.where(
            seen < 0, seen * rules.repetition_penalty, seen / rules.repetition_penalty
        )
        scores = scores.scatter(1, sequence, seen)
    if rules.no_repeat_ngram and length + 1 >= rules.no_repeat_ngram:
        scores = _ban_repeated_ngrams(scores, sequence, rules.no_repeat_ngram)
    generated = length - prompt_len
    if rules.eos_ids and (length < rules.min_length or generated < rules.min_new_tokens):
        scores[:, list(rules.eos_ids)] = blocked
    if rules.banned_ids:
        scores[:, list(rules.banned_ids)] = blocked
    if rules.suppressed_ids:
        scores[:, list(rules.suppressed_ids)] = blocked
    if rules.begin_suppressed_ids and generated == 0:
        scores[:, list(rules.begin_suppressed_ids)] = blocked
    if rules.forced_bos_id is not None and length == 1:  # an encoder–decoder's first token
        scores[:] = blocked
        scores[:, rules.forced_bos_id] = 0
    max_length = prompt_len + new_tokens
    if rules.forced_eos_id is not None and length == max_length - 1:
        scores[:] = blocked
        scores[:, rules.forced_eos_id] = 0
    return scores


def _ban_repeated_ngrams(scores: torch.Tensor, sequence: torch.Tensor, n: int) -> torch.Tensor:
    """No token that would repeat an n-gram the row already holds."""
    for row, tokens in enumerate(sequence.tolist()):
        prefix = tuple(tokens[len(tokens) - n + 1 :]) if n > 1 else ()
        for start in range(len(tokens) - n + 1):
            if tuple(tokens[start : start + n - 1]) == prefix:
                scores[row, tokens[start + n - 1]] = float("-inf")
    return scores


def cache_shapes(caches: list[dict[str, KVCache]]) -> list[dict[str, tuple[int, ...]]]:
    return [
        {name: tuple(c.keys.shape) for name, c in block.items() if c.keys is not None}
        for block in caches
    ]


def cache_bytes(caches: list[dict[str, KVCache]]) -> int:
    """The bytes the caches' K and V tensors hold: their storages, measured, not counted."""
    storages = {}
    for block in caches:
        for c in block.values():
            for tensor in (c.keys, c.values):
                if tensor is not None:
                    storage = tensor.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _assemble(parts: list[tuple[torch.Tensor, int, int]]) -> torch.Tensor:
    """Rows (B, h, r, Lk) computed at query offsets over keys from ``key_start`` … as one
    (B, h, T, T') matrix over absolute key positions (T' = the widest key range)."""
    batch, heads = parts[0][0].shape[:2]
    rows = sum(p.shape[2] for p, _, _ in parts)
    keys = max(start + p.shape[3] for p, _, start in parts)
    full = torch.zeros(batch, heads, rows, keys)  # (B, h, T, T')
    for window, row_start, key_start in parts:
        r, k = window.shape[2], window.shape[3]
        full[:, :, row_start : row_start + r, key_start : key_start + k] = window.cpu()
    return full
