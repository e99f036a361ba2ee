"""What every family's tests ask of attnctl against transformers, in one place.

``assert_every_layer_matches`` runs ``attnctl run --model DIR --layer all --json`` on a
batch and holds each block's weights to transformers' eager attention
(``hf_reference``), real query rows only (transformers computes padded query rows too,
and nothing shows them). Half-precision weights widen exactly, so a float16 or bfloat16
folder is compared with attnctl and transformers both in float32.
"""

from __future__ import annotations

import json
from pathlib import Path

import hf_reference
import torch
from json_contract import only_length

TOLERANCE = 1e-5
# Phi-3's third block, in float32 against transformers' eager: on an AMX Xeon under
# ATEN_CPU_CAPABILITY=default (no vector unit) attnctl's probabilities are 1.06e-05 from a
# float64 reference and transformers' 4.6e-06, 1.26e-05 apart (natively 4.3e-06 and
# 5.0e-06, 2.8e-06 apart): float32 noise of its scaled RoPE's near-saturated softmax
# across the blocks, the same on either side, not a difference of math
FAMILY_TOLERANCE = {"phi3": 2e-5}


def tolerance_of(family: str) -> float:
    return FAMILY_TOLERANCE.get(family, TOLERANCE)


CPU = ("--device", "cpu")


def attnctl_layers(invoke, folder: Path, texts: list[str], *options: str) -> dict:
    result = invoke("run", *texts, "--model", str(folder), "--layer", "all", "--rows", "all",
                    *CPU, "--json", *options)  # fmt: skip
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def assert_every_layer_matches(
    invoke, folder: Path, texts: list[str], dtype: str = "float32", tolerance: float = TOLERANCE
) -> float:
    """Every block's attention equals transformers' on every real row; the worst difference."""
    ids, mask = hf_reference.encode(folder, texts)
    expected = hf_reference.eager_attentions(folder, ids, mask, dtype=dtype)
    data = attnctl_layers(invoke, folder, texts, "--dtype", dtype)
    assert [[t["id"] for t in row if not t["pad"]] for row in data["tokens"]] == [
        row[: int(n)].tolist() for row, n in zip(ids, mask.sum(1), strict=True)
    ]
    assert len(data["layers"]) == len(expected)
    worst = 0.0
    for n, theirs in enumerate(expected):
        ours = torch.tensor(data["layers"][n]["attention"])  # (B, H, L, L)
        assert ours.shape == theirs.shape, f"layer {n}"
        for b, length in enumerate(mask.sum(1).tolist()):
            difference = (ours[b, :, :length] - theirs[b, :, :length].float()).abs().max()
            worst = max(worst, float(difference))
            assert difference <= tolerance, f"layer {n}, text {b}: {float(difference):.2e}"
    return worst


def parameters_of(invoke, folder: Path) -> int:
    """The parameter count ``memory --model`` reports for a (header-only) folder."""
    result = invoke("memory", "--model", str(folder), "--seq-len", "16", *CPU, "--json")
    assert result.exit_code == 0, result.output
    return only_length(json.loads(result.stdout))["parameters"]


def refused(invoke, folder: Path, *command: str) -> str:
    """The one error line a command gives on the folder (exit 2, nothing on stdout)."""
    result = invoke(*command, "--model", str(folder), *CPU)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnctl: error: "), result.stderr
    return lines[0]
