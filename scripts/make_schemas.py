"""Write docs/schema/*.schema.json: the JSON Schema (draft 2020-12) of each command's --json.

    python scripts/make_schemas.py           # rewrite the files
    python scripts/make_schemas.py --check   # exit 1 if a file is out of date

The schemas are built here from shared pieces (a token, a stage, a config, ...) and each
file is written whole (no reference to another file), so that one file is all a reader
needs to validate a document. The config's properties follow attnctl.model.config.LayerConfig:
a field added there changes the schema (run this script; tests/test_schema.py says so).
Each document's version is attnctl.render.json.SCHEMA_VERSION (docs/json.md: the rule).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from attnctl.model.config import _CHOICES, DTYPE_BYTES, DTYPES, IMPLS, LayerConfig  # noqa: E402
from attnctl.render.json import (  # noqa: E402
    ENCODER_DECODER,
    LAYER,
    RUN_KEYS,
    SCHEMA_VERSION,
)
from attnctl.stats import PATTERNS  # noqa: E402

SCHEMA_DIR = ROOT / "docs" / "schema"
# no document is fetched: the id names the command and the version
DIALECT = "https://json-schema.org/draft/2020-12/schema"
COMMANDS = ("run", "shapes", "memory", "check")

Schema = dict[str, Any]


# ---------------------------------------------------------------- building blocks


def integer(minimum: int | None = 0, description: str | None = None) -> Schema:
    schema: Schema = {"type": "integer"}
    if minimum is not None:
        schema["minimum"] = minimum
    if description:
        schema["description"] = description
    return schema


def nullable(schema: Schema) -> Schema:
    """``schema`` or null."""
    if "type" in schema and set(schema) <= {"type", "minimum", "maximum", "description"}:
        kind = schema["type"]
        return {**schema, "type": [kind, "null"] if isinstance(kind, str) else [*kind, "null"]}
    return {"anyOf": [schema, {"type": "null"}]}


def string(description: str | None = None) -> Schema:
    return {"type": "string", **({"description": description} if description else {})}


def enum(values: tuple[str, ...] | list[str], description: str | None = None) -> Schema:
    return {"enum": list(values), **({"description": description} if description else {})}


def array(items: Schema, min_items: int = 0, description: str | None = None) -> Schema:
    schema: Schema = {"type": "array", "items": items}
    if min_items:
        schema["minItems"] = min_items
    if description:
        schema["description"] = description
    return schema


def obj(properties: dict[str, Schema], description: str | None = None) -> Schema:
    """An object with exactly these keys, every one required."""
    schema: Schema = {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }
    if description:
        schema["description"] = description
    return schema


def mapping(keys: tuple[str, ...], values: Schema, description: str | None = None) -> Schema:
    """An object keyed by some of ``keys`` (at least one), each value ``values``."""
    schema: Schema = {
        "type": "object",
        "propertyNames": {"enum": list(keys)},
        "additionalProperties": values,
        "minProperties": 1,
    }
    if description:
        schema["description"] = description
    return schema


def ref(name: str) -> Schema:
    return {"$ref": f"#/$defs/{name}"}


BYTES = integer(0, "bytes (exact)")
COUNT = integer(0)
POSITIVE = integer(1)
INDEX = integer(0, "0-based")
WEIGHT = {"type": "number", "minimum": 0, "maximum": 1, "description": "an attention weight"}
# a sum or mean of several weights: at most 1 up to float rounding, so not bounded above
WEIGHT_SUM = {"type": "number", "minimum": 0}


def config_schema() -> Schema:
    """LayerConfig.to_dict(): every field, typed from its default, enums from _CHOICES."""
    minima = {
        "d_model": 1,
        "heads": 1,
        "head_dim": 0,
        "kv_heads": 0,
        "max_positions": 0,
        "window": 0,
        "relative_buckets": 1,
        "relative_distance": 1,
        "rope_original_max_positions": 1,
        "seed": 0,
    }
    non_negative_floats = {
        "norm_eps", "rope_factor", "rope_mscale", "rope_mscale_all_dim",
        "rope_attention_factor", "query_scale", "softcap", "dropout",
    }  # fmt: skip
    properties: dict[str, Schema] = {}
    for field in dataclasses.fields(LayerConfig):
        default = field.default
        if field.name in _CHOICES:
            properties[field.name] = enum(_CHOICES[field.name])
        elif isinstance(default, bool):
            properties[field.name] = {"type": "boolean"}
        elif isinstance(default, int):
            properties[field.name] = integer(minima.get(field.name))
        elif isinstance(default, float):
            schema: Schema = {"type": "number"}
            if field.name in non_negative_floats:
                schema["minimum"] = 0
            if field.name == "dropout":
                schema["maximum"] = 1
            properties[field.name] = schema
        elif isinstance(default, tuple):
            properties[field.name] = array({"type": "number"})
        elif field.name == "window_pattern":
            properties[field.name] = {"type": "string", "pattern": "^[sf]*$"}
        else:
            properties[field.name] = string()
    return obj(properties, "the attention layer's configuration (LayerConfig)")


def attention(description: str) -> Schema:
    """Nested lists (B, heads, rows, Lk) of weights."""
    return array(array(array(array(WEIGHT))), 1, description)


def token() -> Schema:
    return obj(
        {
            "id": COUNT,
            "text": string("the span of the input the token covers"),
            "start": integer(-1, "offset in the text; -1 for padding"),
            "end": integer(-1),
            "pad": {"type": "boolean"},
        }
    )


def tokens(description: str = "one list per text of the batch") -> Schema:
    return array(array(ref("token")), 1, description)


def stage(extra: dict[str, Schema] | None = None) -> Schema:
    return obj(
        {
            "name": string(),
            "dims": array(string(), description="named dims, e.g. B, H, L, d_k"),
            "shape": ref("shape"),
            "dtype": enum(tuple(DTYPE_BYTES)),
            "device": string(),
            "bytes": BYTES,
            "view_of": nullable(string("the stage whose memory it shares")),
            **(extra or {}),
        }
    )


def memory_stage() -> Schema:
    return stage(
        {
            "live_bytes": BYTES,
            "scratch_bytes": BYTES,
            "measured_live_bytes": nullable(integer(0, "with --measure; else null")),
        }
    )


def estimate() -> Schema:
    return obj(
        {
            "parameters": COUNT,
            "parameters_bytes": BYTES,
            "activation_bytes": BYTES,
            "attention_matrix_bytes": BYTES,
            "scores_bytes": BYTES,
            "weights_bytes": BYTES,
            "peak_activation_bytes": BYTES,
            "peak_bytes": BYTES,
            "peak_stage": string(),
        },
        "one forward pass's memory",
    )


POSITIONS_OF_MODEL = string(
    "the positions it uses: added to its embeddings (learned, sinusoidal, sinusoidal_halves), "
    "else its attention's (config.pos: rope, alibi, relative, none)"
)


def model(decoder_layers: bool = False) -> Schema:
    properties = {
        "path": string(),
        "model_type": string(),
        "family": string(),
        "layers": POSITIVE,
        "hidden": POSITIVE,
        "heads": POSITIVE,
        "kv_heads": POSITIVE,
        "intermediate": COUNT,
        "activation": string(),
        "vocab_size": POSITIVE,
        "max_positions": integer(0, "0: no limit (relative positions)"),
        "positions": POSITIONS_OF_MODEL,
        "dtype": string("the stored weights' dtype"),
    }
    if decoder_layers:
        properties["decoder_layers"] = POSITIVE
    description = "the checkpoint (--model); null for the seeded layer"
    return nullable(obj(properties, description))


def sizes() -> Schema:
    required = ("B", "L", "D", "H", "Hkv", "D_kv", "d_k", "V")
    optional = ("D_q", "Lc", "I")
    return {
        "type": "object",
        "description": "each named dim's size; D_q when --head-dim makes it differ from D, "
        "Lc with a context, I with a model",
        "properties": {name: POSITIVE for name in (*required, *optional)},
        "required": list(required),
        "additionalProperties": False,
    }


def kv_group() -> Schema:
    return obj(
        {
            "window": nullable(integer(1, "null: full attention")),
            "layers": POSITIVE,
            "tokens": COUNT,
            "kv_heads": POSITIVE,
            "head_dim": POSITIVE,
            "bytes": BYTES,
        },
        "the K and V of one kind of block",
    )


def head_stats() -> Schema:
    weight_or_null = nullable(WEIGHT)
    sum_or_null = nullable(WEIGHT_SUM)
    return obj(
        {
            "batch_row": INDEX,
            "head": INDEX,
            "rows": POSITIVE,
            "entropy": {"type": "number", "minimum": 0, "description": "mean, in nats"},
            "entropy_fraction": {"type": "number", "minimum": 0},
            "top_key": INDEX,
            "top_key_text": string(),
            "previous": weight_or_null,
            "first": weight_or_null,
            "diagonal": weight_or_null,
            "same_token": sum_or_null,
            "induction": sum_or_null,
            "layer": nullable(INDEX),
            "kind": enum([*PATTERNS, "diffuse", "mixed"]),
        }
    )


def block() -> Schema:
    return obj(
        {
            "layer": INDEX,
            "head_stats": array(ref("head_stat")),
            "attention": attention("(B, heads, rows, Lk)"),
        },
        "one block of --layer all",
    )


def ranked_keys(description: str) -> Schema:
    pair = {
        "type": "array",
        "prefixItems": [INDEX, WEIGHT],
        "items": False,
        "minItems": 2,
        "description": "[position, weight]",
    }
    return array(array(pair), 1, description)


def by_kind(kinds: dict[str, str]) -> Schema:
    """A document of one of ``kinds`` (kind -> what it is), each its own object in $defs.

    ``kind`` says which: ``if``/``then`` validates the document against that one only (a
    oneOf would try every kind, and report the errors of each)."""
    return {
        "type": "object",
        "required": ["schema_version", "command", "kind"],
        "properties": {
            "schema_version": {"const": SCHEMA_VERSION},
            "kind": {
                "enum": list(kinds),
                "description": "; ".join(f"{k}: {what}" for k, what in kinds.items()),
            },
        },
        "allOf": [{"if": {"properties": {"kind": {"const": k}}}, "then": ref(k)} for k in kinds],
    }


KINDS = {
    LAYER: "the seeded layer, or a model with one stack (decoder-only or encoder-only)",
    ENCODER_DECODER: "a model with an encoder and a decoder (its keys differ)",
}


def header(command: str, kind: str) -> dict[str, Schema]:
    return {
        "schema_version": {"const": SCHEMA_VERSION, "description": "bumped by a breaking change"},
        "command": {"const": command},
        "kind": {"const": kind},
    }


def cuda() -> Schema:
    """render.json.cuda_dict: what a CUDA plan assumes and adds."""
    kernels = ("cudnn", "flash", "efficient", "math")
    sdpa = obj(
        {
            "kernel": enum(kernels),
            "label": string("as the output names it, e.g. cuDNN, or math (a fallback)"),
            "dtype": enum(DTYPES),
            "reason": string("why the kernels before it in torch's order were passed over"),
            "fallback": {
                "type": "boolean",
                "description": "math although a fused kernel was asked for",
            },
        },
        "one SDPA call's kernel, by torch's rules",
    )
    line = obj(
        {
            "name": enum(
                (
                    "cublas_workspace",
                    "cublaslt_workspace",
                    "norm_statistics",
                    "bmm_copies",
                    "sdpa_buffers",
                )
            ),
            "what": string(),
            "bytes": BYTES,
            "first": string("the stage it is made at"),
            "last": nullable(string("the last stage it is alive at; null: kept past the pass")),
            "fallback": {"type": "boolean", "description": "the matrices of a fallback to math"},
        },
        "what CUDA allocates beside the stages' tensors",
    )
    return nullable(
        obj(
            {
                "gpu": string("the profile's name (--gpu), or this machine's GPU's"),
                "label": string(),
                "capability": string("e.g. sm_90"),
                "memory_bytes": integer(0, "torch.cuda.mem_get_info's total"),
                "planned": {"type": "boolean", "description": "for a named --gpu profile"},
                "torch_rules": string("the torch version whose kernel rules are followed"),
                "cudnn": integer(0, "torch.backends.cudnn.version() of those wheels"),
                "verified": {"type": "boolean", "description": "checked to the byte on hardware"},
                "assumptions": string(),
                "sdpa": array(sdpa),
                "warnings": array(string(), description="a fallback to math, with its cost"),
                "device_lines": array(line),
            },
            "on CUDA: the GPU and torch rules planned for; null on another device",
        )
    )


COMMON_DEFS: dict[str, Schema] = {
    "shape": array(POSITIVE, description="a tensor's shape"),
    "token": token(),
    "config": config_schema(),
    "cuda": cuda(),
}


# ---------------------------------------------------------------- run


def run_layer() -> Schema:
    generated = "with --generate; else null"
    properties: dict[str, Schema] = {
        **header("run", LAYER),
        "model": model(),
        "layer": nullable(integer(0, "the block shown; null: the seeded layer, --layer all")),
        "config": ref("config"),
        "tokenizer": string(),
        "vocab_size": POSITIVE,
        "device": string(),
        "tokens": tokens(),
        "stages": array(
            ref("stage"),
            1,
            "the block's as planned; with --layer all block 0's (--generate: the prefill's)",
        ),
        "impl": enum(("math", "sdpa")),
        "head_stats": nullable(array(ref("head_stat"), description="null with --layer all")),
        "attention": nullable(attention("(B, heads, rows, Lk); null with --layer all")),
        "attention_heads": array(INDEX, 1),
        "attention_rows": array(INDEX, 1),
        "context_tokens": nullable(tokens("with --context; else null")),
        "memory": ref("estimate"),
        "layers": nullable(array(ref("block"), 1, "with --layer all; else null")),
        "prompt_tokens": nullable(tokens(generated)),
        "generated_ids": nullable(array(array(COUNT), 1, generated)),
        "generated_tokens": nullable(array(array(string()), 1, generated)),
        "generated_text": nullable(array(string(), 1, generated)),
        "stop": nullable(enum(("eos", "forced_eos", "limit"), generated)),
        "kv_cache_layer": nullable(integer(0, generated)),
        "steps": nullable(array(ref("step"), 1, generated)),
        "kv_cache_bytes": nullable(integer(0, generated)),
        "measured_kv_cache_bytes": nullable(integer(0, generated)),
        "kv_cache": nullable(array(ref("kv_group"), 1, generated)),
        "cuda": ref("cuda"),
    }
    assert list(properties)[3:] == list(RUN_KEYS), "run's keys and RUN_KEYS differ"
    return obj(properties, "run on the seeded layer or a model with one stack")


def step() -> Schema:
    return obj(
        {
            "step": INDEX,
            "token": array(COUNT, 1, "each text's id"),
            "text": array(string(), 1),
            "position": INDEX,
            "finished": array({"type": "boolean"}, 1),
            "kv_cache_shape": ref("shape"),
            "kv_cache_shapes": array(ref("shape"), 1),
            "kv_cache_bytes": BYTES,
            "measured_kv_cache_bytes": nullable(BYTES),
            "dropped": array(COUNT, 1, "per block: positions out of its window"),
            "top_keys": ranked_keys("per text: the row averaged over the heads"),
        }
    )


def run_encoder_decoder() -> Schema:
    blocks = array(ref("block"), 1)
    properties: dict[str, Schema] = {
        **header("run", ENCODER_DECODER),
        "model": obj(
            {
                "path": string(),
                "model_type": string(),
                "family": string(),
                "encoder_layers": POSITIVE,
                "decoder_layers": POSITIVE,
                "hidden": POSITIVE,
                "heads": POSITIVE,
                "vocab_size": POSITIVE,
                "positions": POSITIONS_OF_MODEL,
                "dtype": string(),
            }
        ),
        "config": ref("config"),
        "decoder_config": ref("config"),
        "tokenizer": string(),
        "device": string(),
        "dtype": enum(DTYPES),
        "impl": {"const": "math"},
        "encoder_stages": nullable(array(ref("stage"), 1)),
        "decoder_stages": nullable(array(ref("stage"), 1)),
        "source_tokens": tokens(),
        "target_tokens": tokens("the start token, then the generated"),
        "encoder_layer": INDEX,
        "decoder_layer": INDEX,
        "attention_heads": array(INDEX, 1),
        "encoder_attention": attention("(B, H, Ls, Ls)"),
        "decoder_attention": attention("(B, H, Lt, Lt)"),
        "cross_attention": attention("(B, H, Lt, Ls)"),
        "encoder_head_stats": array(ref("head_stat"), description="the encoder block shown"),
        "decoder_head_stats": array(ref("head_stat"), description="the decoder block shown"),
        "cross_head_stats": array(ref("head_stat"), description="its cross-attention"),
        "alignment_heads": array(INDEX, 1),
        "alignment": array(
            array(
                obj(
                    {
                        "target_position": INDEX,
                        "target_id": COUNT,
                        "source_position": INDEX,
                        "weight": WEIGHT,
                    }
                )
            ),
            1,
        ),
        "tokens": tokens("the source's"),
        "attention": attention("the encoder block's, as encoder_attention"),
        "attention_rows": array(INDEX, 1),
        "generated_ids": array(array(COUNT), 1),
        "generated_tokens": array(array(string()), 1),
        "generated_text": array(string(), 1),
        "stop": enum(("eos", "forced_eos", "limit")),
        "steps": array(
            obj(
                {
                    "step": INDEX,
                    "token": array(COUNT, 1),
                    "text": array(string(), 1),
                    "position": INDEX,
                    "finished": array({"type": "boolean"}, 1),
                    "kv_cache_shape": ref("shape"),
                    "cross_kv_cache_shape": ref("shape"),
                    "kv_cache_bytes": BYTES,
                    "measured_kv_cache_bytes": nullable(BYTES),
                    "top_sources": ranked_keys("per text: the cross-attention's strongest"),
                }
            ),
            1,
        ),
        "kv_cache_bytes": BYTES,
        "measured_kv_cache_bytes": nullable(BYTES),
        "memory": obj(
            {
                "parameters": COUNT,
                "parameters_bytes": BYTES,
                "encoder_peak_activation_bytes": BYTES,
                "decoder_peak_activation_bytes": BYTES,
                "kv_cache_bytes": BYTES,
                "cross_kv_cache_bytes": BYTES,
                "peak_bytes": BYTES,
            },
            "as memory --src-len S --tgt-len T gives them for the run's lengths (S the "
            "source's, T the target's); kv_cache_bytes is the self-attention's alone",
        ),
        "layers": nullable(
            obj(
                {"encoder": blocks, "decoder": blocks, "cross": blocks},
                "with --layer all; else null",
            )
        ),
    }
    return obj(properties, "run on an encoder–decoder: the translation")


def run_schema() -> Schema:
    return {
        "$defs": {
            **COMMON_DEFS,
            "stage": stage(),
            "estimate": estimate(),
            "head_stat": head_stats(),
            "block": block(),
            "step": step(),
            "kv_group": kv_group(),
            "layer": run_layer(),
            "encoder-decoder": run_encoder_decoder(),
        },
        **by_kind(KINDS),
    }


# ---------------------------------------------------------------- shapes


def shapes_schema() -> Schema:
    block_shapes = obj(
        {
            "layer": INDEX,
            "seq_len": POSITIVE,
            "sizes": ref("sizes"),
            "stages": ref("stages"),
            "cuda": ref("cuda"),
        }
    )
    layer = obj(
        {
            **header("shapes", LAYER),
            "model": model(),
            "config": ref("config"),
            "seq_len": POSITIVE,
            "batch": POSITIVE,
            "sizes": ref("sizes"),
            "stages": ref("stages"),
            "cuda": ref("cuda"),
        },
        "the seeded layer, or a model with one stack",
    )
    encoder_decoder = obj(
        {
            **header("shapes", ENCODER_DECODER),
            "model": model(decoder_layers=True),
            "config": ref("config"),
            "src_len": POSITIVE,
            "tgt_len": POSITIVE,
            "batch": POSITIVE,
            "dims": obj({"L": string(), "Lc": string()}, "what L and Lc are"),
            "encoder": block_shapes,
            "decoder": block_shapes,
        },
        "an encoder–decoder: its encoder block and its decoder block",
    )
    return {
        "$defs": {
            **COMMON_DEFS,
            "sizes": sizes(),
            "stage": stage(),
            "stages": array(ref("stage"), 1),
            "layer": layer,
            "encoder-decoder": encoder_decoder,
        },
        **by_kind(KINDS),
    }


# ---------------------------------------------------------------- memory


def split_properties() -> dict[str, Schema]:
    """memory with --tp, --sp, --cp, --pp, --dp, --zero, --micro-batch or --recompute:
    each pipeline stage's device (every key null without a split)."""
    layout = obj(
        {
            "tp": POSITIVE,
            "sp": {"type": "boolean"},
            "cp": POSITIVE,
            "pp": POSITIVE,
            "dp": POSITIVE,
            "zero": {"type": "integer", "minimum": 0, "maximum": 3},
            "micro_batch": POSITIVE,
            "recompute": enum(("none", "selective", "full")),
            "devices": integer(1, "T · C · P · D"),
            "micro_batches": integer(1, "per step: batch / micro_batch"),
            "kv_replicas": integer(1, "ranks holding each kv-head: T / Hkv when T > Hkv, else 1"),
        },
        "the split",
    )
    device = obj(
        {
            "stage": INDEX,
            "kind": enum(("all", "first", "middle", "last")),
            "blocks": array(INDEX, 2, "the first and the last block the stage holds"),
            "weights_bytes": BYTES,
            "gradients_bytes": BYTES,
            "optimizer_bytes": integer(0, "Adam's moments and the master weights"),
            "master_bytes": integer(0, "of optimizer_bytes, the float32 master weights"),
            "gathered_bytes": integer(
                0, "ZeRO 3: the largest unit's parameters (a block's, or the embeddings'), gathered"
            ),
            "activations_bytes": BYTES,
            "kv_cache_bytes": BYTES,
            "peak_bytes": integer(
                0,
                "inference: the sum of the other *_bytes but master_bytes; training: the "
                "largest of phase_peak_bytes",
            ),
            "peak_phase": nullable(
                enum(("forward", "backward", "optimizer step"), "training: the busiest phase")
            ),
            "phase_peak_bytes": nullable(
                obj(
                    {"forward": BYTES, "backward": BYTES, "optimizer_step": BYTES},
                    "training: the device's bytes at the busiest point of each phase",
                )
            ),
            "micro_batches_in_flight": POSITIVE,
        },
        "one device of a pipeline stage (any of its tensor-parallel ranks)",
    )
    fit = obj({"budget_bytes": BYTES, "max_seq_len": COUNT, "max_micro_batch": COUNT})
    phases = obj(
        {"forward": BYTES, "backward": BYTES, "optimizer_step": BYTES},
        "a rank's bytes at the busiest point of each phase of its training step",
    )
    measured = obj(
        {
            "rank": INDEX,
            "peak_bytes": integer(
                0,
                "the rank's estimated peak of what it measures: its weights and activations,"
                " no KV cache (per_device's peak_bytes adds the cache in inference)",
            ),
            "measured_peak_bytes": BYTES,
            # what gloo / NCCL allocate inside a collective, which the measurement does
            # not see: at most this
            "collective_buffer_bytes": BYTES,
            # --train: each phase's peak, estimated and measured; null for a forward pass
            "phase_peak_bytes": nullable(phases),
            "measured_phase_peak_bytes": nullable(phases),
        }
    )
    return {
        "layout": nullable(layout),
        "per_device": nullable(array(device, 1, "one per pipeline stage, in order")),
        "per_device_fit": nullable(fit),
        "measured_per_rank": nullable(
            array(measured, 1, "measured on torch.distributed (memory --measure of a split)")
        ),
    }


def memory_schema() -> Schema:
    by_impl_int = mapping(tuple(i for i in IMPLS if i != "auto"), COUNT)
    length = obj(
        {
            "model": model(),
            "config": ref("config"),
            "seq_len": POSITIVE,
            "batch": POSITIVE,
            "layers": POSITIVE,
            **estimate()["properties"],
            "kv_cache_tokens": COUNT,
            "kv_cache_bytes": BYTES,
            "kv_cache": array(ref("kv_group")),
            "measured_kv_cache_bytes": nullable(integer(0, "with --measure; else null")),
            "by_dtype": mapping(DTYPES, ref("estimate")),
            "by_impl": mapping(tuple(i for i in IMPLS if i != "auto"), ref("estimate")),
            "stages": array(ref("memory_stage"), 1),
            "training_bytes": nullable(integer(0, "with --train: the step's peak; else null")),
            "training": nullable(
                obj(
                    {
                        "parameters_bytes": BYTES,
                        "gradient_bytes": BYTES,
                        "master_bytes": BYTES,
                        "optimizer_bytes": BYTES,
                        "saved_bytes": BYTES,
                        "peak_bytes": BYTES,
                        "peak_phase": string(),
                    },
                    "with --train; else null",
                )
            ),
            "measured_peak_bytes": nullable(integer(0, "with --measure; else null")),
            "measured_what": nullable(enum(("forward pass", "training step"))),
            "measured_device": nullable(string()),
            "measured_by": nullable(string()),
            "measured_reserved_bytes": nullable(
                integer(0, "--measure on CUDA: torch.cuda.max_memory_reserved; else null")
            ),
            "measured_context_bytes": nullable(
                integer(0, "--measure on CUDA: what the process holds outside torch's allocator")
            ),
            "kv_cache_after_generate": nullable(
                obj(
                    {
                        "generate": POSITIVE,
                        "tokens": POSITIVE,
                        "bytes": BYTES,
                        "kv_cache": array(ref("kv_group"), 1),
                        "measured_bytes": nullable(BYTES),
                    },
                    "with --generate N; else null",
                )
            ),
            "cuda": ref("cuda"),
        },
        "one length's estimate",
    )
    layer = obj(
        {
            **header("memory", LAYER),
            "model": model(),
            "config": ref("config"),
            "batch": POSITIVE,
            "layers": POSITIVE,
            "seq_lens": array(POSITIVE, 1),
            "results": array(ref("length"), 1, "one per length of seq_lens, in its order"),
            "budget_bytes": nullable(integer(0, "with --budget or --fit; else null")),
            "max_seq_len": nullable(by_impl_int),
            "max_batch": nullable(by_impl_int),
            **split_properties(),
        },
        "the seeded layer (a stack of it), or a model with one stack",
    )
    row = obj(
        {
            "parameters_bytes": BYTES,
            "encoder_peak_activation_bytes": BYTES,
            "decoder_peak_activation_bytes": BYTES,
            "kv_cache_bytes": BYTES,
            "cross_kv_cache_bytes": BYTES,
            "peak_bytes": BYTES,
        }
    )
    part = obj(
        {
            "layer": INDEX,
            "seq_len": POSITIVE,
            "sizes": ref("sizes"),
            **estimate()["properties"],
            "stages": array(ref("memory_stage"), 1),
            "cuda": ref("cuda"),
        }
    )
    encoder_decoder = obj(
        {
            **header("memory", ENCODER_DECODER),
            "model": model(decoder_layers=True),
            "config": ref("config"),
            "batch": POSITIVE,
            "src_len": POSITIVE,
            "tgt_len": POSITIVE,
            "parameters": COUNT,
            **row["properties"],
            "kv_cache_tokens": COUNT,
            "kv_cache": array(ref("kv_group"), 1),
            "cross_kv_cache_tokens": COUNT,
            "cross_kv_cache": array(ref("kv_group"), 1),
            "by_dtype": mapping(DTYPES, ref("row")),
            "by_impl": mapping(tuple(i for i in IMPLS if i != "auto"), ref("row")),
            "encoder": part,
            "decoder": part,
            "measured": nullable(
                obj(
                    {
                        "parameters_bytes": BYTES,
                        "encoder_peak_activation_bytes": BYTES,
                        "decoder_peak_activation_bytes": BYTES,
                        "kv_cache_bytes": BYTES,
                        "cross_kv_cache_bytes": BYTES,
                        "device": string(),
                        "by": string(),
                    },
                    "with --measure; else null",
                )
            ),
        },
        "an encoder–decoder",
    )
    return {
        "$defs": {
            **COMMON_DEFS,
            "sizes": sizes(),
            "estimate": estimate(),
            "memory_stage": memory_stage(),
            "kv_group": kv_group(),
            "length": length,
            "row": row,
            "layer": layer,
            "encoder-decoder": encoder_decoder,
        },
        **by_kind(KINDS),
    }


# ---------------------------------------------------------------- check


def check_schema() -> Schema:
    comparison = obj(
        {
            "a": string(),
            "b": string(),
            "what": string(),
            "max_abs_diff": {"type": "number", "minimum": 0, "description": "float noise"},
            "tolerance": {"type": "number", "minimum": 0},
            "ok": {"type": "boolean"},
        }
    )
    document = obj(
        {
            **header("check", LAYER),
            "config": ref("config"),
            "seq_len": POSITIVE,
            "batch": POSITIVE,
            "device": string(),
            "comparisons": array(comparison, 1),
            "skipped": array(string(), description="pairs no oracle could express"),
            "gradcheck": {"type": "boolean"},
            "gradcheck_note": string(),
            "ok": {"type": "boolean"},
        }
    )
    return {"$defs": {"config": COMMON_DEFS["config"]}, **document}


# ---------------------------------------------------------------- files

DESCRIPTIONS = {
    "run": "attnctl run --json: one document of kind 'layer' (the seeded layer, --context, "
    "--model --layer N or all, --generate: the same keys whatever the options, null where "
    "one does not apply) or of kind 'encoder-decoder' (a translation).",
    "shapes": "attnctl shapes --json: kind 'layer' (one plan's stages) or 'encoder-decoder' "
    "(its encoder and decoder blocks).",
    "memory": "attnctl memory --json: kind 'layer' (what every length shares, one entry per "
    "length under results, the budget's fit or null) or 'encoder-decoder'.",
    "check": "attnctl check --json: the comparisons, gradcheck and the verdict.",
}
BUILDERS = {
    "run": run_schema,
    "shapes": shapes_schema,
    "memory": memory_schema,
    "check": check_schema,
}


def schema(command: str) -> Schema:
    return {
        "$schema": DIALECT,
        "$id": f"urn:attnctl:schema:{command}:v{SCHEMA_VERSION}",
        "title": f"attnctl {command} --json (schema_version {SCHEMA_VERSION})",
        "description": DESCRIPTIONS[command],
        **BUILDERS[command](),
    }


def text(command: str) -> str:
    return json.dumps(schema(command), ensure_ascii=False, indent=2) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a file is out of date")
    args = parser.parse_args()
    stale = []
    SCHEMA_DIR.mkdir(parents=True, exist_ok=True)
    for command in COMMANDS:
        path = SCHEMA_DIR / f"{command}.schema.json"
        wanted = text(command)
        if path.exists() and path.read_text(encoding="utf-8") == wanted:
            continue
        stale.append(path.relative_to(ROOT))
        if not args.check:
            path.write_text(wanted, encoding="utf-8")
    for path in stale:
        print(f"{'out of date' if args.check else 'wrote'}: {path}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
