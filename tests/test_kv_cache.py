"""The KV cache by kind of block: a sliding block keeps min(N, W) positions, each block its
own Hkv and d_k; --measure keeps K and V in a real run of every block and sums them."""

from __future__ import annotations

import json

import pytest
import tiny_models
from json_contract import only_length

CPU = ("--device", "cpu")


def memory_json(invoke, *args: str) -> dict:
    """memory's document of one length: its entry."""
    result = invoke("memory", *args, *CPU, "--json")
    assert result.exit_code == 0, result.output
    return only_length(json.loads(result.stdout))


def kv_per_block(tokens: int, kv_heads: int, head_dim: int, element: int = 4) -> int:
    return 2 * tokens * kv_heads * head_dim * element


@pytest.mark.parametrize("length", [5, 8, 40])
def test_a_sliding_block_keeps_its_window(invoke, tmp_path, length):
    folder = tiny_models.write("mistral", tmp_path / "m", sliding_window=8)
    data = memory_json(invoke, "--model", str(folder), "--seq-len", str(length), "--measure")
    kept = min(length, 8)
    heads, head_dim = (
        data["config"]["kv_heads"],
        data["config"]["d_model"] // data["config"]["heads"],
    )
    assert data["kv_cache"] == [
        {"window": 8, "layers": 3, "tokens": kept, "kv_heads": heads, "head_dim": head_dim,
         "bytes": 3 * kv_per_block(kept, heads, head_dim)}
    ]  # fmt: skip
    assert (
        data["kv_cache_bytes"]
        == data["measured_kv_cache_bytes"]
        == 3 * kv_per_block(kept, heads, head_dim)
    )


def test_full_and_sliding_blocks_are_summed_by_kind(invoke, tmp_path):
    folder = tiny_models.write(
        "qwen2", tmp_path / "q", use_sliding_window=True, sliding_window=8,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
    )  # fmt: skip
    data = memory_json(invoke, "--model", str(folder), "--seq-len", "30", "--measure")
    groups = {group["window"]: group for group in data["kv_cache"]}
    assert (groups[None]["layers"], groups[None]["tokens"]) == (1, 30)
    assert (groups[8]["layers"], groups[8]["tokens"]) == (2, 8)
    assert data["kv_cache_bytes"] == groups[None]["bytes"] + groups[8]["bytes"]
    assert data["measured_kv_cache_bytes"] == data["kv_cache_bytes"]
    text = invoke("memory", "--model", str(folder), "--seq-len", "30", *CPU).stdout
    assert "window 8" in text and "full attention" in text and "min(N, 8) = 8" in text


@pytest.mark.parametrize(
    "options", [(), ("--kv-heads", "2"), ("--layers", "3"), ("--context-len", "7")]
)
def test_the_seeded_layer_measures_what_it_estimates(invoke, options):
    data = memory_json(invoke, "--seq-len", "12", "--d-model", "32", "--heads", "4",
                       "--measure", *options)  # fmt: skip
    assert data["measured_kv_cache_bytes"] == data["kv_cache_bytes"] > 0
    [group] = data["kv_cache"]
    assert group["window"] is None and group["tokens"] == (7 if "--context-len" in options else 12)


def test_another_length_than_the_run_is_not_measured(invoke):
    data = memory_json(invoke, "--seq-len", "12", "--d-model", "32", "--kv-cache", "100",
                       "--measure")  # fmt: skip
    assert data["kv_cache_tokens"] == 100 and data["measured_kv_cache_bytes"] is None


def test_mistral_7b_keeps_its_window_at_32k(invoke, tmp_path):
    """Every block slides over 4096 keys: 1/8 of what full attention would keep."""
    folder = tiny_models.write_header_only("mistral-7b", tmp_path / "mistral", dtype="bfloat16")
    data = memory_json(invoke, "--model", str(folder), "--seq-len", "32768")
    assert data["parameters"] == 7_241_732_096
    assert data["kv_cache"] == [
        {"window": 4096, "layers": 32, "tokens": 4096, "kv_heads": 8, "head_dim": 128,
         "bytes": 32 * 2 * 4096 * 8 * 128 * 2}
    ]  # fmt: skip
    assert data["kv_cache_bytes"] == 512 * 2**20


def test_llama_without_windows_is_one_kind(invoke, tmp_path):
    folder = tiny_models.write_header_only("llama-2-7b", tmp_path / "llama")
    data = memory_json(invoke, "--model", str(folder), "--seq-len", "4096")
    assert data["kv_cache"] == [
        {"window": None, "layers": 32, "tokens": 4096, "kv_heads": 32, "head_dim": 128,
         "bytes": 32 * 2 * 4096 * 32 * 128 * 2}
    ]  # fmt: skip


def test_the_measure_preflight_counts_the_cache_it_keeps(invoke, monkeypatch):
    """--measure also keeps every block's K and V: the pre-flight asks for those bytes too."""
    import attnctl.memory.resources

    args = ("--seq-len", "512", "--d-model", "64", "--heads", "4")
    data = memory_json(invoke, *args)
    free = data["peak_bytes"] + data["kv_cache_bytes"] // 2  # the peak fits, the cache not
    monkeypatch.setattr(
        attnctl.memory.resources, "available_memory",
        lambda device: attnctl.memory.resources.Available(free, "MemAvailable"),
    )  # fmt: skip
    result = invoke("memory", *args, "--measure", *CPU)
    assert result.exit_code == 1 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1
