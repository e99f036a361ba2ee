"""transformers' own numbers for a checkpoint folder: the oracle attnctl's families are held to.

Every function loads the folder with ``attn_implementation="eager"`` (the only implementation
that returns attention weights) and runs it without gradients, in evaluation mode:

    ids, mask = encode(folder, ["a text", "a longer text"])     # right-padded with id 0
    weights = eager_attentions(folder, ids, mask)                # [(B, H, L, L)] a layer
    reference = run_reference(folder, ids, mask, dtype="bfloat16")

``dtype`` is "auto" (the checkpoint's own, from config.json), "float64", "float32", "float16"
or "bfloat16"; transformers then computes in that dtype, softmax in float32 and cast back.
Half-precision weights load exactly into float32: ``dtype="float32"`` on a bfloat16 folder is
the oracle for a run that widens the stored weights.
Positions are transformers' default, 0 … L-1 for every row (right padding keeps them right).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {
    "float64": torch.float64,  # for oracles: transformers' softmax still runs in float32
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class Reference:
    """One forward pass of transformers' eager model."""

    attentions: list[torch.Tensor]  # a layer each: (B, H, L, L), softmax weights
    # N + 1 tensors (B, L, D): the embeddings (Gemma: already times sqrt(D)), then blocks
    # 0 … N-2's outputs, and last the final norm's output (transformers puts it in place
    # of block N-1's, which it does not return)
    hidden_states: list[torch.Tensor]
    logits: torch.Tensor | None  # (B, L, vocab) for a causal LM (after any soft-cap)


def encode(folder: Path, texts: list[str], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The folder's tokenizer.json on each text, right-padded: (ids, mask), each (B, L)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
    rows = [tokenizer.encode(text).ids for text in texts]
    length = max(len(row) for row in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, : len(row)] = 1
    return ids, mask


def load(folder: Path, dtype: str = "auto"):
    """The folder's model in transformers, eager attention, evaluation mode.

    A causal-LM checkpoint (config.json's architectures ends in ForCausalLM) loads as that
    class, so that its head and soft-capping run too; the older tiny families (saved as
    their base model) load with AutoModel.
    """
    import json

    import transformers

    transformers.utils.logging.disable_progress_bar()
    architectures = json.loads((Path(folder) / "config.json").read_text()).get("architectures") or [
        ""
    ]
    loader = (
        transformers.AutoModelForCausalLM
        if architectures[0].endswith("ForCausalLM")
        else transformers.AutoModel
    )
    torch_dtype = "auto" if dtype == "auto" else DTYPES[dtype]
    model = loader.from_pretrained(folder, attn_implementation="eager", dtype=torch_dtype)
    return model.eval()


def run_reference(
    folder: Path,
    token_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    dtype: str = "auto",
) -> Reference:
    """transformers' eager forward pass on (B, L) token ids; mask 1 = a token, 0 = padding."""
    model = load(folder, dtype)
    with torch.no_grad():
        out = model(
            input_ids=token_ids,
            attention_mask=attention_mask,
            output_attentions=True,
            output_hidden_states=True,
            use_cache=False,
        )
    return Reference(
        attentions=list(out.attentions),
        hidden_states=list(out.hidden_states),
        logits=getattr(out, "logits", None),
    )


def eager_attentions(
    folder: Path,
    token_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    dtype: str = "auto",
) -> list[torch.Tensor]:
    """transformers' eager attention weights, one (B, H, L, L) tensor a layer."""
    return run_reference(folder, token_ids, attention_mask, dtype).attentions
