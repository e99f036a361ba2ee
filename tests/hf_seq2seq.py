"""transformers' greedy generation as the oracle for attnctl's encoder–decoder and decoder-only
generation: ids, every step's attentions, and one teacher-forced forward over the result.

Every function loads the folder with ``attn_implementation="eager"`` (the only implementation
that returns attention weights), in float32 (or ``dtype="float64"``), evaluation mode, without
gradients, and calls
``generate(do_sample=False, num_beams=1, max_new_tokens=N)`` with the folder's own
generation_config.json (so its logits processors — Marian's bad_words_ids, Marian's and BART's
forced_eos_token_id — are on, as for a user):

    reference = generate_seq2seq(folder, ["Are you OK?", "猫吃鱼"], max_new_tokens=8)
    reference.generated            # (B, T): start token first, then the greedy ids
    reference.cross_attentions[3][1]           # step 3, decoder block 1: (B, H, 1, Ls)
    reference.teacher_forced.cross_attentions[1][:, :, 3]   # the same row, (B, H, Ls)

Layout of the generated ids (``generated``, transformers' ``sequences``):
- encoder–decoder: ``generated[:, 0]`` is the decoder_start_token_id; ``generated[:, 1:]`` the
  T - 1 generated tokens (T - 1 <= max_new_tokens; fewer when every row has ended). A row that
  emitted its end-of-sequence token earlier than the others is filled after it with
  pad_token_id. Step s (0-based) fed ``generated[:, s]`` and produced ``generated[:, s + 1]``:
  there are T - 1 steps.
- decoder-only: ``generated[:, :L]`` is the prompt, ``generated[:, L:]`` the new tokens; step 0
  is the prefill over the L prompt tokens, step s >= 1 fed ``generated[:, L + s - 1]``.

The teacher-forced forward runs the whole of ``generated`` at once (no cache); its row i equals
the row the steps computed for query position i (for every i but the last, which no step
computed: the last token was produced, never fed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class TeacherForced:
    """One forward pass over a whole sequence (no cache): every row of every attention."""

    encoder_attentions: list[torch.Tensor]  # a block each: (B, H, Ls, Ls); [] for decoder-only
    decoder_attentions: list[torch.Tensor]  # a block each: (B, H, Lt, Lt), causal
    cross_attentions: list[torch.Tensor]  # a block each: (B, H, Lt, Ls); [] for decoder-only
    logits: torch.Tensor  # (B, Lt, V), what the head gives (after bias / scaling)


@dataclass(frozen=True)
class Seq2SeqReference:
    """transformers' greedy generation on an encoder–decoder folder."""

    source_ids: torch.Tensor  # (B, Ls) the folder's tokenizer.json on each text, right-padded
    source_mask: torch.Tensor  # (B, Ls) 1 = a token, 0 = padding
    generated: torch.Tensor  # (B, T) start token + generated ids (pad after a row's EOS)
    encoder_attentions: list[torch.Tensor]  # a block each: (B, H, Ls, Ls)
    decoder_attentions: list[list[torch.Tensor]]  # [step][block]: (B, H, 1, step + 1)
    cross_attentions: list[list[torch.Tensor]]  # [step][block]: (B, H, 1, Ls)
    step_logits: list[torch.Tensor]  # a step each: (B, V) raw logits, float32
    step_scores: list[torch.Tensor]  # a step each: (B, V) after the logits processors
    teacher_forced: TeacherForced  # decoder_input_ids = generated, same source and mask


@dataclass(frozen=True)
class CausalReference:
    """transformers' greedy generation on a decoder-only *ForCausalLM folder."""

    prompt_ids: torch.Tensor  # (B, L)
    generated: torch.Tensor  # (B, L + N') prompt + new ids (pad after a row's EOS)
    # [step][layer]: step 0 (the prefill) (B, H, L, L), then step s (B, H, 1, L + s)
    attentions: list[list[torch.Tensor]]
    step_logits: list[torch.Tensor]  # a step each: (B, V) raw logits, float32
    step_scores: list[torch.Tensor]  # a step each: (B, V) after the logits processors
    teacher_forced: TeacherForced  # over all of `generated`: decoder_attentions (B, H, Lt, Lt)


def config_of(folder: Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


def encode_source(folder: Path, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The folder's tokenizer.json on each text (special tokens included), right-padded with the
    config's pad_token_id: (ids, mask), each (B, L)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
    pad_id = config_of(folder).get("pad_token_id")
    pad_id = 0 if pad_id is None else pad_id
    rows = [tokenizer.encode(text).ids for text in texts]
    length = max(len(row) for row in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, : len(row)] = 1
    return ids, mask


DTYPES = {"float32": torch.float32, "float64": torch.float64}


def load_seq2seq(folder: Path, dtype: str = "float32"):
    """The folder's encoder–decoder model: eager attention, evaluation mode, in ``dtype``."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(
        folder, attn_implementation="eager", dtype=DTYPES[dtype]
    )
    return model.eval()


def load_causal(folder: Path, dtype: str = "float32"):
    """The folder's causal LM: eager attention, evaluation mode, in ``dtype``."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", dtype=DTYPES[dtype]
    )
    return model.eval()


def _generate(model, max_new_tokens: int, **inputs):
    return model.generate(
        **inputs,
        do_sample=False,
        num_beams=1,
        max_new_tokens=max_new_tokens,
        output_attentions=True,
        output_scores=True,
        output_logits=True,
        return_dict_in_generate=True,
    )


def generate_seq2seq(
    folder: Path, texts: list[str], max_new_tokens: int, dtype: str = "float32"
) -> Seq2SeqReference:
    """Greedy generation from each text (a batch, right-padded), its per-step attentions, and a
    teacher-forced forward over the generated ids. ``dtype`` "float64" gives an oracle without
    float32's rounding (transformers then computes everything in float64; the logits processors
    and the argmax still run on a float32 copy of the logits)."""
    model = load_seq2seq(folder, dtype)
    source_ids, source_mask = encode_source(folder, texts)
    with torch.no_grad():
        out = _generate(model, max_new_tokens, input_ids=source_ids, attention_mask=source_mask)
        generated = out.sequences  # (B, T)
        forward = model(
            input_ids=source_ids,
            attention_mask=source_mask,
            decoder_input_ids=generated,
            output_attentions=True,
            use_cache=False,
        )
    teacher = TeacherForced(
        encoder_attentions=list(forward.encoder_attentions),
        decoder_attentions=list(forward.decoder_attentions),
        cross_attentions=list(forward.cross_attentions),
        logits=forward.logits,
    )
    return Seq2SeqReference(
        source_ids=source_ids,
        source_mask=source_mask,
        generated=generated,
        encoder_attentions=list(out.encoder_attentions),
        decoder_attentions=[list(step) for step in out.decoder_attentions],
        cross_attentions=[list(step) for step in out.cross_attentions],
        step_logits=list(out.logits),
        step_scores=list(out.scores),
        teacher_forced=teacher,
    )


def generate_causal(
    folder: Path, ids: torch.Tensor, max_new_tokens: int, dtype: str = "float32"
) -> CausalReference:
    """Greedy generation from (B, L) prompt ids (no padding: one prompt, or equal lengths), its
    per-step attentions, and a teacher-forced forward over prompt + generated ids."""
    model = load_causal(folder, dtype)
    ids = torch.as_tensor(ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids[None]
    with torch.no_grad():
        out = _generate(model, max_new_tokens, input_ids=ids, attention_mask=torch.ones_like(ids))
        generated = out.sequences  # (B, L + N')
        forward = model(input_ids=generated, output_attentions=True, use_cache=False)
    teacher = TeacherForced(
        encoder_attentions=[],
        decoder_attentions=list(forward.attentions),
        cross_attentions=[],
        logits=forward.logits,
    )
    return CausalReference(
        prompt_ids=ids,
        generated=generated,
        attentions=[list(step) for step in out.attentions],
        step_logits=list(out.logits),
        step_scores=list(out.scores),
        teacher_forced=teacher,
    )


def step_rows(steps: list[list[torch.Tensor]], block: int) -> torch.Tensor:
    """The per-step attention rows of one block stacked as the teacher-forced layout:
    (B, H, S, K) for an encoder–decoder's S steps (self: K = S, zero-filled right of the causal
    diagonal; cross: K = Ls). A decoder-only step 0 (the prefill, L rows) is kept whole."""
    rows = []
    width = steps[-1][block].shape[-1]
    for step in steps:
        weights = step[block]  # (B, H, q, k)
        pad = width - weights.shape[-1]
        rows.append(torch.nn.functional.pad(weights, (0, pad)))
    return torch.cat(rows, dim=2)
