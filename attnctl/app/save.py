"""``run --save FILE.safetensors``: the recorded stages' tensors and the attention computed.

The attention tensors are built from the ``--json`` document's own weights, so that the
file holds exactly what the JSON does (float32). torch and safetensors are imported only
when a file is written.
"""

from __future__ import annotations

import json
from typing import Any

from attnctl.errors import RUNTIME, AttnctlError
from attnctl.output_files import OutputFile, checked_output, write_atomically

SUFFIX = ".safetensors"
# the document's keys that hold attention weights, saved under their own names
ATTENTION_KEYS = ("attention", "encoder_attention", "decoder_attention", "cross_attention")
# the document's keys written as metadata (JSON-encoded strings), when present
METADATA_KEYS = (
    "schema_version",  # which version of the document the other keys follow
    "model",
    "layer",
    "config",
    "decoder_config",
    "tokenizer",
    "vocab_size",
    "impl",
    "tokens",
    "context_tokens",
    "source_tokens",
    "target_tokens",
    "encoder_layer",
    "decoder_layer",
    "attention_heads",
    "attention_rows",
    "generated_text",
)


def checked_save_path(path: str) -> OutputFile:
    """The file ``--save`` writes, refused before anything runs when it cannot be written.

    A name must end in ``.safetensors``: ``--save out.json`` is more likely a mistake than
    a wish for a binary file under that name, and ``load_file`` users find it by its name.
    """
    return checked_output(path, "--save", suffix=SUFFIX)


def attention_tensors(document: dict[str, Any]) -> dict[str, Any]:
    """Each attention of a run's JSON document as a float32 tensor, by name: the top-level
    keys (``attention``, ``encoder_attention``, …) under their own names, the blocks of
    ``--layer all`` as ``block.N.attention`` (``encoder.block.N.attention``, … for an
    encoder–decoder's ``layers``)."""
    named: dict[str, Any] = {}
    for key in ATTENTION_KEYS:
        if document.get(key) is not None:
            named[key] = _float32(document[key], key)
    layers = document.get("layers")
    groups = layers.items() if isinstance(layers, dict) else [("", layers or [])]
    for kind, blocks in groups:
        prefix = f"{kind}." if kind else ""
        for block in blocks:
            name = f"{prefix}block.{block['layer']}.attention"
            named[name] = _float32(block["attention"], name)
    return named


def _float32(nested: list, name: str) -> Any:
    import torch

    try:
        return torch.tensor(nested, dtype=torch.float32)
    except (ValueError, TypeError) as error:  # rows of unequal length
        raise AttnctlError(
            f"--save: {name} is not rectangular: {error}", exit_code=RUNTIME
        ) from error


def stage_tensors(traces: list) -> dict[str, Any]:
    """Each recorded stage's tensor: by its name for the seeded layer, ``block.N.NAME`` for
    a model's block N."""
    named: dict[str, Any] = {}
    for trace in traces:
        prefix = "" if trace.layer is None else f"block.{trace.layer}."
        for stage, tensor in (trace.stage_tensors or {}).items():
            named[prefix + stage] = tensor
    return named


def metadata(document: dict[str, Any]) -> dict[str, str]:
    """The document's config, tokens and choices, each JSON-encoded (string to string)."""
    found = {key: document[key] for key in METADATA_KEYS if key in document}
    return {key: json.dumps(value, ensure_ascii=False) for key, value in found.items()}


def save_run(output: OutputFile, document: dict[str, Any], traces: list) -> int:
    """Write the stages and attention of a run to ``output`` atomically (a temporary file
    in the target's folder, then renamed); the tensors written.

    The file's bytes are built in memory first (``safetensors.torch.save``): its
    ``save_file`` renames a temporary file of its own over the name it is given, which
    would replace a device or a symlink and name its temporary file in an error.
    """
    from safetensors.torch import save

    tensors = {**stage_tensors(traces), **attention_tensors(document)}
    write_atomically(output, save(tensors, metadata=metadata(document)))
    return len(tensors)
