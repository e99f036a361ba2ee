"""benchmarks/parallel_references.py: the references it calls give the figures recorded here.

Megatron's theoretical memory (the megatron-bridge wheel) and DeepSpeed's ZeRO estimators
are not test extras (megatron-bridge installs only with --no-deps): each test that calls
one skips, saying which, where it is not installed, and fails instead when
ATTNCTL_REQUIRE_REFERENCES=1, which ``.ci/run`` sets after installing both. The rest (the
layouts' data, the shard counts, the "n/a" path) always runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import sys
from pathlib import Path

import pytest
import tiny_models

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import parallel_references as references

GPT = references.CONFIGURATIONS[0]  # Megatron-LM's functional-test GPT, TP 2, PP 2, DP 2


REQUIRED = os.environ.get("ATTNCTL_REQUIRE_REFERENCES") == "1"  # CI installs them


def missing(reason: str) -> None:
    """Skip, or in CI fail: a reference that should be there and is not."""
    if REQUIRED:
        pytest.fail(f"{reason}; CI installs it (ATTNCTL_REQUIRE_REFERENCES=1)")
    pytest.skip(reason)


def megatron_or_skip():
    try:
        return references.megatron_functions()
    except ImportError as error:
        missing(f"megatron-bridge is not installed (not a test extra): {error}")


def deepspeed_or_skip() -> None:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        missing("deepspeed is not installed (not a test extra)")


def test_the_small_gpt_is_megatron_s_functional_test_layout():
    assert (GPT.tp, GPT.pp, GPT.dp, GPT.seq_len, GPT.micro_batch, GPT.global_batch) == (
        2, 2, 2, 1024, 4, 32
    )  # fmt: skip
    assert GPT.micro_batches == 4 and GPT.gpus == 8
    model = references.MODELS[GPT.model]
    assert (model.layers, model.hidden, model.heads, model.ffn) == (12, 512, 8, 2048)
    assert model.vocab % (128 * GPT.tp) == 0 and model.vocab - 50257 < 128 * GPT.tp


def test_every_figure_names_a_source_that_exists():
    for layout in references.CONFIGURATIONS:
        assert set(layout.sources.values()) <= set(references.SOURCES), layout.name
        assert layout.model in references.MODELS
        assert layout.global_batch % (layout.dp * layout.micro_batch) == 0
    for source, _, _ in references.PUBLISHED_MEMORY_NOTES:
        assert source in references.SOURCES
    paper = [c for c in references.CONFIGURATIONS if "paper" in c.name]
    # Table 4: 8,192 and 16,384 GPUs, TP 8, PP 16, 16M tokens per batch in every row
    assert [c.gpus for c in paper] == [8192, 16384, 16384]
    assert all(c.seq_len * c.global_batch == 16 * 2**20 for c in paper)


def test_the_pipeline_split_takes_llama_3_s_two_blocks_from_the_ends():
    assert references.stage_layers(126, 16) == [7] + [8] * 14 + [7]
    assert references.stage_layers(80, 4) == [20] * 4
    assert references.stage_layers(126, 9) == [14] * 9
    assert references.stage_layers(10, 4) == [2, 3, 3, 2]


def test_the_shards_add_up_to_the_published_parameter_count(tmp_path):
    folder = tiny_models.write_header_only("llama-3-70b", tmp_path / "l")
    shapes = references.header_shapes(folder)
    stages = references.shard_parameters(shapes, tp=1, pp=4)
    assert sum(count for count, _ in stages) == tiny_models.PUBLISHED_PARAMETERS["llama-3-70b"]
    # the largest tensor of the first stage: the embedding, over TP 4 by vocabulary rows
    (_, largest), *_ = references.shard_parameters(shapes, tp=4, pp=4)
    assert largest == 128256 * 8192 // 4


def test_megatron_s_functions_give_the_recorded_bytes_for_the_small_gpt():
    _, version = megatron_or_skip()
    result = references.megatron_reference(references.MODELS[GPT.model], GPT)
    assert result["what"].startswith("megatron-bridge ") and version in result["what"]
    # the transformer 2·12·512²·(2 + 4 + 2/512 + 1/(12·512)) = 37,774,336, the embedding
    # 512·50,432: (37,774,336 / PP 2 + 25,821,184) / TP 2 = 22,354,176 parameters, 18 bytes
    assert result["weight_and_optimizer_bytes"] == 22_354_176 * 18 == 402_375_168
    # (s·b·h·34 · 12 layers + 8·s·b·P + s·b·h·P) / TP 2, s 1024, b 4, h 512, P 2
    assert result["activation_bytes"] == (1024 * 4 * 512 * 34 * 12 + 8 * 1024 * 4 * 2
                                          + 1024 * 4 * 512 * 2) / 2 == 429_948_928  # fmt: skip


def test_the_transcribed_without_sp_formula_gives_the_recorded_bytes():
    # (s·b·h·(10 + 24/2) · 12 + 8·s·b·P + s·b·h·P) · min(1, 4/2) · 1.05; P > 1: no logits
    bytes_ = references.megatron_lm_activation_without_sp(references.MODELS[GPT.model], GPT)
    s, b, h = 1024, 4, 512
    assert bytes_ == (s * b * h * 22 * 12 + 8 * s * b * 2 + s * b * h * 2) * 1.05
    assert round(bytes_) == 585_803_366


def test_megatron_ignores_context_parallelism():
    """What docs/parallel-references.md says: the activations are the same at CP 1 and 16."""
    megatron_or_skip()
    paper_128k = references.CONFIGURATIONS[-1]
    model = references.MODELS[paper_128k.model]
    alone = references.megatron_reference(model, paper_128k)
    no_cp = dataclasses.replace(paper_128k, cp=1)
    assert references.megatron_reference(model, no_cp) == alone


def test_deepspeed_s_estimators_give_the_recorded_bytes_for_the_small_gpt(tmp_path):
    deepspeed_or_skip()
    folder = references.write_folder(references.MODELS[GPT.model], tmp_path)
    stages = references.shard_parameters(references.header_shapes(folder), GPT.tp, GPT.pp)
    assert stages == [(22_649_856, 12_910_592), (22_388_736, 12_910_592)]
    assert GPT.model not in tiny_models.FULL_SIZE  # held only while it was written
    result = references.deepspeed_reference(*max(stages), GPT.dp * GPT.cp)
    assert result["zero1_bytes"] is None  # DeepSpeed has no ZeRO-1 estimator
    assert result["zero2_bytes"] == 2 * 22_649_856 + 18 * 22_649_856 // 2 == 249_148_416
    assert result["zero3_bytes"] == 4 * 12_910_592 + 18 * 22_649_856 // 2 == 255_491_072


def test_the_numbers_are_those_all_cold_prints():
    deepspeed_or_skip()
    from deepspeed.runtime.zero.stage_1_and_2 import (
        estimate_zero2_model_states_mem_needs_all_cold,
    )

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        estimate_zero2_model_states_mem_needs_all_cold(22_649_856, num_gpus_per_node=2)
    (line,) = [x for x in printed.getvalue().splitlines() if "offload_optimizer=none" in x]
    per_gpu = float(re.findall(r"([\d.]+)GB", line)[1])
    ours = references.deepspeed_reference(22_649_856, 12_910_592, 2)["zero2_bytes"]
    assert per_gpu == round(ours / 2**30, 2)


def test_attnctl_s_column_says_why_it_is_empty(tmp_path):
    """A command that fails gives one "n/a (reason)", never a traceback."""
    result = references.attnctl_reference(tmp_path / "missing", GPT, "none")
    assert set(result) == {"na"}
    assert result["na"].startswith("attnctl: error: ")
    assert references.attnctl_text(result).startswith("attnctl: n/a (attnctl: error: ")


def test_per_device_is_found_wherever_the_document_holds_it():
    stage = {"weights_bytes": 1, "gradients_bytes": 2, "optimizer_bytes": 3,
             "activations_bytes": 4, "kv_cache_bytes": 0, "peak_bytes": 10}  # fmt: skip
    document = json.loads(json.dumps({"results": [{"per_device": [stage, stage]}]}))
    assert references.find_per_device(document) == [stage, stage]
    assert references.find_per_device({"results": []}) is None
    text = references.attnctl_text({"stages": [stage]})
    assert text.startswith("attnctl: stage 0: states ") and "peak" in text
