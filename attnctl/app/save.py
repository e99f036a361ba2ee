"""``run --save FILE.safetensors``: the recorded stages' tensors and the attention computed.

The attention tensors are built from the ``--json`` document's own weights, so that the
file holds exactly what the JSON does (float32). torch and safetensors are imported only
when a file is written.
"""

from __future__ import annotations

import json
import re
from typing import Any

from attnctl.errors import RUNTIME, AttnctlError
from attnctl.output_files import OutputFile, checked_output, write_atomically_with
from attnctl.trace import KeptStages

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


def kept_stage_groups(report: Any) -> list[KeptStages]:
    """The stages a run's report kept (``run --save``): each trace's (the seeded layer,
    a model's block N), then the report's own groups (a generation's prefill, an
    encoder–decoder's encoder and decoder)."""
    groups = [trace.kept for trace in getattr(report, "traces", []) if trace.kept is not None]
    return groups + list(getattr(report, "kept_stages", []))


def stage_tensors(groups: list[KeptStages]) -> dict[str, Any]:
    """Each recorded stage's tensor: by its name for the seeded layer, ``block.N.NAME`` for
    a model's block N (``prefill.block.N.NAME``, ``encoder.block.N.NAME``, …)."""
    return {group.prefix + name: t for group in groups for name, t in group.tensors.items()}


def stage_metadata(groups: list[KeptStages]) -> dict[str, str]:
    """What the stage tensors are: ``stages`` maps each one's saved name to its named dims
    (as the JSON's ``stages`` give them), ``stage_groups`` each prefix to its pass."""
    if not groups:
        return {}
    dims = {group.prefix + s.name: list(s.dims) for group in groups for s in group.stages}
    what = {group.prefix: group.what for group in groups}
    return {
        "stages": json.dumps(dims, ensure_ascii=False),
        "stage_groups": json.dumps(what, ensure_ascii=False),
    }


def metadata(document: dict[str, Any]) -> dict[str, str]:
    """The document's config, tokens and choices, each JSON-encoded (string to string)."""
    found = {key: document[key] for key in METADATA_KEYS if key in document}
    return {key: json.dumps(value, ensure_ascii=False) for key, value in found.items()}


def _os_error(message: str) -> OSError:
    """safetensors' 'Error while serializing: I/O error: No space left on device (os error
    28) at path "/x/.tmpAb12"' as the OSError it stands for, without its temporary name."""
    found = re.search(r"I/O error: (.+?) \(os error (\d+)\)", message)
    if found is None:
        return OSError(message)
    return OSError(int(found.group(2)), found.group(1))


def save_run(output: OutputFile, document: dict[str, Any], report: Any) -> int:
    """Write the stages and attention of a run (``report``, ``document`` its JSON) to
    ``output`` atomically (a temporary file in the target's folder, then renamed); the
    tensors written.

    ``save_file`` writes the tensors from their own memory (``save`` would build the whole
    file in memory first) into our temporary file, never the user's path: it renames a
    temporary file of its own over the name it is given, which would replace a device or
    a symlink.
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    groups = kept_stage_groups(report)
    tensors = {**stage_tensors(groups), **attention_tensors(document)}
    file_metadata = metadata(document) | stage_metadata(groups)

    def write(temporary: str) -> None:
        try:
            save_file(tensors, temporary, metadata=file_metadata)
        except SafetensorError as error:  # its I/O errors are not OSError, and name its file
            raise _os_error(str(error)) from error

    write_atomically_with(output, write)
    return len(tensors)
