"""One module per model family; this registry maps config.json's ``model_type`` to it.

A family module (any module here but ``common.py``: adding one needs no edit here)
names its ``MODEL_TYPES`` (model_type -> the name people use), a
``KIND`` for the supported list, and ``describe(source) -> ModelDescription``: its
config.json keys, read and checked, as embeddings and blocks of sublayers, with the one
table of its checkpoint's tensors (key, shape, where each goes) that both the header
checks and the loading use. Nothing outside the family modules knows a family.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import importlib
import pkgutil
import re
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, NamedTuple

from attnctl.errors import AttnctlError

if TYPE_CHECKING:
    from attnctl.model.describe import ModelDescription


class Declared(NamedTuple):
    """What a family module declares (its ``MODEL_TYPES`` and ``KIND``), read from its
    source without importing it: ``--help`` lists the families and imports none."""

    module: str
    model_types: dict[str, str]
    kind: str


@functools.cache
def declared() -> tuple[Declared, ...]:
    """Every module in this package but common.py is a family, in the order of their names."""
    found = []
    for module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if module.name == "common":
            continue
        source = Path(__path__[0], f"{module.name}.py").read_text("utf-8")
        values = _declared_values(source)
        found.append(Declared(module.name, values["MODEL_TYPES"], values["KIND"]))
    return tuple(found)


def _declared_values(source: str) -> dict[str, Any]:
    """A family module's ``MODEL_TYPES`` and ``KIND``: each a one-line literal, read with a
    pattern and ``ast.literal_eval`` (a parse of the whole module costs --help 30 ms); one
    written over several lines is read from the parsed module."""
    values: dict[str, Any] = {}
    for match in _DECLARED.finditer(source):
        with contextlib.suppress(ValueError, SyntaxError):
            values[match.group(1)] = ast.literal_eval(match.group(2))
    if len(values) < 2:
        for node in ast.parse(source).body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target = node.targets[0]
                if isinstance(target, ast.Name) and target.id in ("MODEL_TYPES", "KIND"):
                    values[target.id] = ast.literal_eval(node.value)
    return values


_DECLARED = re.compile(r"^(MODEL_TYPES|KIND) = (.+)$", re.M)


def family_of(model_type: str) -> ModuleType | None:
    """The family module that reads ``model_type``, imported now; None if none does."""
    for family in declared():
        if model_type in family.model_types:
            return importlib.import_module(f"{__name__}.{family.module}")
    return None


# model types people point attnctl at that no family reads yet, and why
NOT_YET = {
    "mixtral": "its blocks are mixtures of experts (MoE)",
    "qwen2_moe": "its blocks are mixtures of experts (MoE)",
    "qwen3_moe": "its blocks are mixtures of experts (MoE)",
    "olmoe": "its blocks are mixtures of experts (MoE)",
    "phimoe": "its blocks are mixtures of experts (MoE)",
    "deepseek_v2": "its attention is multi-head latent attention (MLA) and its blocks MoE",
    "deepseek_v3": "its attention is multi-head latent attention (MLA) and its blocks MoE",
    "mt5": "mT5 is not read yet (T5 is)",
    "mbart": "mBART is pre-norm with final norms, unlike BART: another family",
    "gemma3": "it is the multimodal Gemma 3 (its text model, gemma3_text, is supported)",
    "phi3small": "Phi-3-small's blocksparse attention is another architecture than phi3",
}


def family_name(family: ModuleType) -> str:
    return family.__name__.rsplit(".", 1)[-1]


def supported() -> str:
    """'bert (BERT encoders), gpt2 (GPT-2), llama, mistral and qwen2 (Llama-style decoders)'."""
    parts = []
    for family in declared():
        types = list(family.model_types)
        listed = types[0] if len(types) == 1 else ", ".join(types[:-1]) + " and " + types[-1]
        parts.append(f"{listed} ({family.kind})")
    return "; ".join(parts[:-1]) + "; and " + parts[-1]


def supported_names() -> str:
    """'BERT, GPT-2, Llama, Mistral or Qwen2', for --help."""
    names = [name for family in declared() for name in family.model_types.values()]
    return ", ".join(names[:-1]) + " or " + names[-1]


def read_model(directory: str | Path) -> ModelDescription:
    """Read and check a model folder; every problem is an AttnctlError (exit 2)."""
    from attnctl.model.checkpoint import Fields, _brief, check_tensors, read_tensor_headers
    from attnctl.model.config import validate
    from attnctl.model.families.common import Source

    path = Path(directory).expanduser()
    if not path.is_dir():
        if path.exists():
            raise AttnctlError(f"--model needs a folder, and {directory} is not one")
        raise AttnctlError(f"model folder not found: {directory}")
    config = _read_config(path)
    model_type = config.get("model_type")
    if isinstance(model_type, str) and model_type in NOT_YET:
        raise AttnctlError(
            f"{path / 'config.json'} has model_type {model_type!r}: {NOT_YET[model_type]}; "
            f"attnctl does not run it yet, and supports {supported()}"
        )
    family = family_of(model_type) if isinstance(model_type, str) else None
    if family is None:
        found = f"model_type {_brief(model_type)}" if model_type is not None else "no model_type"
        raise AttnctlError(f"{path / 'config.json'} has {found}; attnctl supports {supported()}")
    tensors = read_tensor_headers(path)
    source = Source(
        path=path,
        model_type=model_type,
        name=family.MODEL_TYPES[model_type],
        family=family_name(family),
        fields=Fields(path / "config.json", config),
        tensors=tensors,
    )
    model = family.describe(source)
    stacks = [model] if model.decoder is None else [model, model.decoder]
    try:  # in float32: the run's dtype (--dtype) is checked when the run asks for it
        for stack in stacks:
            for sublayer in {s for block in stack.blocks for s in block.sublayers}:
                if hasattr(sublayer, "config"):
                    validate(dataclasses.replace(sublayer.config, dtype="float32"))
    except AttnctlError as error:
        raise AttnctlError(f"{path / 'config.json'}: {error.message}") from None
    checkpoint = model.checkpoint
    check_tensors(
        path, source.name, checkpoint.prefix, tensors, checkpoint.table + checkpoint.head_table
    )
    return model


def _read_config(path: Path) -> dict[str, Any]:
    from attnctl.model.config import read_json_object

    config_path = path / "config.json"
    if not config_path.exists():
        raise AttnctlError(f"no config.json in {path}: attnctl reads Hugging Face style folders")
    return read_json_object(config_path, "model config")
