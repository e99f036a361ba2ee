"""``run TEXT --model DIR`` on an encoder–decoder (Marian, BART, T5 v1, T5 v1.1): it encodes
TEXT and generates greedily, held to transformers (tests/hf_seq2seq.py) on a padded batch of
three texts: the ids equal ``generate(do_sample=False, num_beams=1)``'s, and the encoder's,
decoder's and cross-attention's weights of the chosen blocks equal its eager attention to
1e-5, at every step; the alignment is the arg-max of the cross-attention row that chose each
token; the caches' bytes, estimated, equal those measured at every step.
"""

from __future__ import annotations

import json
from pathlib import Path

import hf_seq2seq
import pytest
import tiny_seq2seq
import torch

N = 8
TOLERANCE = 1e-5
TEXTS = list(tiny_seq2seq.TEST_TEXTS)  # three lengths: the batch is padded


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("seq2seq")
    return {f: tiny_seq2seq.write(f, root / f) for f in tiny_seq2seq.SEQ2SEQ_FAMILIES}


@pytest.fixture(scope="module")
def references(folders) -> dict[str, hf_seq2seq.Seq2SeqReference]:
    return {f: hf_seq2seq.generate_seq2seq(d, TEXTS, N) for f, d in folders.items()}


def _translate(invoke, folder: Path, *extra: str) -> dict:
    result = invoke(
        "run", *TEXTS, "--model", str(folder), "--generate", str(N), "--json",
        "--device", "cpu", *extra,
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize("family", tiny_seq2seq.SEQ2SEQ_FAMILIES)
@pytest.mark.parametrize(
    "blocks", [(), ("--layer", "0"), ("--layer", "0", "--encoder-layer", "-1")]
)
def test_ids_and_the_three_attentions_equal_transformers(
    invoke, folders, references, family, blocks
):
    document = _translate(invoke, folders[family], *blocks)
    reference = references[family]
    generated = reference.generated  # (B, T): the start token, then the generated ids
    assert document["generated_ids"] == generated[:, 1:].tolist()
    assert [[t["id"] for t in row] for row in document["target_tokens"]] == generated.tolist()
    assert [[t["id"] for t in row if not t["pad"]] for row in document["source_tokens"]] == [
        ids[mask.bool()].tolist()
        for ids, mask in zip(reference.source_ids, reference.source_mask, strict=True)
    ]
    encoder_block, decoder_block = document["encoder_layer"], document["decoder_layer"]
    if not blocks:  # the last blocks by default
        assert encoder_block == len(reference.encoder_attentions) - 1
        assert decoder_block == len(reference.teacher_forced.cross_attentions) - 1
    elif "--encoder-layer" in blocks:  # another encoder block than --layer's
        assert decoder_block == 0 and encoder_block == len(reference.encoder_attentions) - 1
    else:  # --layer N: decoder block N and encoder block N
        assert encoder_block == decoder_block == 0
    assert document["attention"] == document["encoder_attention"]  # run's keys too
    assert document["tokens"] == document["source_tokens"]
    real = reference.source_mask.bool()[:, None, :, None]  # padded query rows: not compared
    encoder = torch.tensor(document["encoder_attention"])  # (B, H, Ls, Ls)
    assert ((encoder - reference.encoder_attentions[encoder_block]).abs() * real).max() <= (
        TOLERANCE
    )
    forced = reference.teacher_forced
    decoder = torch.tensor(document["decoder_attention"])  # (B, H, Lt, Lt)
    cross = torch.tensor(document["cross_attention"])  # (B, H, Lt, Ls)
    assert (decoder - forced.decoder_attentions[decoder_block]).abs().max() <= TOLERANCE
    # the stages as planned: the same shapes as the weights the run kept
    planned = {s["name"]: s["shape"] for s in document["encoder_stages"]}
    assert planned["weights"] == list(encoder.shape)
    planned = {s["name"]: s["shape"] for s in document["decoder_stages"]}
    assert planned["weights"] == list(decoder.shape)
    assert planned["cross_weights"] == list(torch.tensor(document["cross_attention"]).shape)
    assert (cross - forced.cross_attentions[decoder_block]).abs().max() <= TOLERANCE
    steps = len(reference.cross_attentions)
    per_step_self = hf_seq2seq.step_rows(reference.decoder_attentions, decoder_block)
    per_step_cross = hf_seq2seq.step_rows(reference.cross_attentions, decoder_block)
    assert (decoder[:, :, :steps, :steps] - per_step_self).abs().max() <= TOLERANCE
    assert (cross[:, :, :steps] - per_step_cross).abs().max() <= TOLERANCE
    assert len(document["steps"]) == steps
    for number, step in enumerate(document["steps"]):
        assert step["position"] == number + 1
        assert step["kv_cache_shape"][2] == number + 1
        assert step["cross_kv_cache_shape"][2] == reference.source_ids.shape[1]
        assert step["kv_cache_bytes"] == step["measured_kv_cache_bytes"]
    assert document["kv_cache_bytes"] == document["measured_kv_cache_bytes"]
    # the alignment: the source token (not padding) the row before each token weighs most
    mean = cross.mean(dim=1)  # (B, Lt, Ls)
    lengths = reference.source_mask.sum(dim=1).tolist()
    for batch_row, aligned in enumerate(document["alignment"]):
        assert [a["target_position"] for a in aligned] == list(range(1, generated.shape[1]))
        for entry in aligned:
            row = mean[batch_row, entry["target_position"] - 1, : lengths[batch_row]]
            assert entry["source_position"] == int(row.argmax())
            assert entry["weight"] == pytest.approx(float(row.max()), abs=1e-6)


@pytest.mark.parametrize("family", ["bart", "t5v11"])  # t5v11: 3 encoder, 2 decoder blocks
def test_every_block_of_the_three_kinds_equals_transformers(invoke, folders, references, family):
    document = _translate(invoke, folders[family], "--layer", "all")
    reference = references[family]
    forced = reference.teacher_forced
    real = reference.source_mask.bool()[:, None, :, None]
    expected = {
        "encoder": (reference.encoder_attentions, real),
        "decoder": (forced.decoder_attentions, 1),
        "cross": (forced.cross_attentions, 1),
    }
    for kind, (theirs, mask) in expected.items():
        blocks = document["layers"][kind]
        assert [b["layer"] for b in blocks] == list(range(len(theirs)))
        for block in blocks:
            ours = torch.tensor(block["attention"])
            assert ((ours - theirs[block["layer"]]).abs() * mask).max() <= TOLERANCE, kind
            assert block["head_stats"]
    out = invoke(
        "run", *TEXTS, "--model", str(folders[family]), "--generate", str(N), "--layer", "all",
        "--device", "cpu", columns=80,
    ).stdout  # fmt: skip
    for kind in ("encoder self-attention", "decoder self-attention", "cross-attention"):
        assert f"heads by block ({kind}, text 0)" in out
    assert max(len(line) for line in out.splitlines()) <= 80


def test_the_terminal_view_shows_steps_alignment_and_tables(invoke, folders):
    for columns in (60, 100):
        result = invoke(
            "run", "猫吃鱼", "--model", str(folders["marian"]), "--generate", "4",
            "--device", "cpu", "--head", "1", columns=columns,
        )  # fmt: skip
        assert result.exit_code == 0, result.stderr
        out = result.stdout
        assert "steps · decoder block 1" in out
        assert "alignment · block 1 · mean of head 1" in out
        assert "cross-attention weights, decoder block 1" in out
        assert "cross_weights" in out and "B H L Lc" in out  # the decoder block's stages
        assert " → " in out
        assert max(len(line) for line in out.splitlines()) <= columns


def _refused(result, message: str) -> None:
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_bad_requests_are_refused_in_one_line(invoke, folders, tmp_path):
    marian = str(folders["marian"])
    _refused(invoke("run", "hi", "--model", marian, "--layer", "5"), "the decoder has 2 blocks")
    _refused(invoke("run", "hi", "--model", marian, "--encoder-layer", "x"), "block number")
    _refused(invoke("run", "hi", "--model", marian, "--context", "x"), "leave out --context")
    _refused(invoke("run", "hi", "--model", marian, "--generate", "0"), ">= 1, got 0")
    _refused(invoke("run", "hi", "--model", marian, "--generate", "64"), "at most 64")
    _refused(
        invoke("run", "hi " * 70, "--model", marian, "--generate", "2"),
        "takes at most 64 (rows of its sinusoidal position table)",
    )
    _refused(invoke("run", "hi", "--encoder-layer", "0"), "--encoder-layer")
    _refused(
        invoke("run", "hi", "--model", marian, "--encoder-layer", "all"),
        "--encoder-layer takes a block number",
    )
    _refused(
        invoke("run", "hi", "--model", marian, "--layer", "all", "--encoder-layer", "0"),
        "leave out --encoder-layer",
    )
    _refused(
        invoke("run", "hi", "--model", marian, "--generate", "99999999999999999999999"),
        "--generate must be below 2^63",
    )
    folder = tmp_path / "t5"
    tiny_seq2seq.write("t5", folder)
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        values = json.loads(path.read_text())
        values.pop("decoder_start_token_id", None)
        path.write_text(json.dumps(values))
    _refused(invoke("run", "hi", "--model", str(folder)), "decoder_start_token_id")


def test_an_encoder_decoder_generates_without_generate_and_refuses_sdpa(invoke, folders):
    result = invoke("run", "猫吃鱼", "--model", str(folders["bart"]), "--json", "--device", "cpu")
    assert result.exit_code == 0, result.stderr
    document = json.loads(result.stdout)
    steps = len(document["steps"])
    assert steps == 20 or (steps < 20 and document["stop"] == "eos")  # --generate 20
    assert len(document["target_tokens"][0]) == steps + 1
    assert (document["config"]["mask"], document["decoder_config"]["mask"]) == ("none", "causal")
    _refused(
        invoke("run", "hi", "--model", str(folders["bart"]), "--impl", "sdpa"),
        "leave out --impl sdpa",
    )


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"eos_token_id": "zero"}, "eos_token_id must be a token id or a list of them"),
        ({"bad_words_ids": 5}, "bad_words_ids attnctl bans single tokens only"),
        ({"pad_token_id": True}, "pad_token_id must be a token id"),
        ({"decoder_start_token_id": 1.5}, "decoder_start_token_id must be a token id"),
        ({"decoder_start_token_id": 99999}, "names token 99999, outside the vocabulary of"),
        ({"bad_words_ids": [[99999]]}, "bad_words_ids names token 99999"),
        ({"forced_bos_token_id": 5000}, "forced_bos_token_id names token 5000"),
        ({"suppress_tokens": [99999]}, "suppress_tokens names token 99999"),
    ],
)
def test_a_broken_generation_config_is_named_in_one_line(tmp_path, invoke, values, message):
    folder = tiny_seq2seq.write("marian", tmp_path / "marian")
    path = folder / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))
    _refused(invoke("run", "hi", "--model", str(folder), "--generate", "2"), message)


def test_a_generation_config_without_the_start_token_falls_back_to_config_json(tmp_path, invoke):
    folder = tiny_seq2seq.write("t5", tmp_path / "t5")
    path = folder / "generation_config.json"
    values = json.loads(path.read_text())
    values.pop("decoder_start_token_id")
    path.write_text(json.dumps(values))
    result = invoke("run", "hi", "--model", str(folder), "--generate", "2", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["target_tokens"][0][0]["id"] == 0


def test_a_forced_end_token_at_the_limit_is_said_so(folders, invoke):
    marian = str(folders["marian"])
    result = invoke("run", "Are you OK?", "--model", marian, "--generate", "3", "--json")
    document = json.loads(result.stdout)
    assert document["generated_ids"][0][-1] == 0 and document["stop"] == "forced_eos"
    shown = invoke("run", "Are you OK?", "--model", marian, "--generate", "3")
    assert "forces the last token to the end token (forced_eos_token_id)" in " ".join(
        shown.stdout.split()
    )


def test_the_stage_tables_name_the_device_the_run_used(folders, invoke):
    result = invoke("run", "hi", "--model", str(folders["bart"]), "--generate", "2", "--json")
    document = json.loads(result.stdout)
    devices = {s["device"] for s in document["encoder_stages"] + document["decoder_stages"]}
    assert devices == {"cpu"}


@pytest.mark.parametrize("family", ["marian", "t5"])
def test_the_blocks_shown_carry_the_statistics_of_their_three_attentions(invoke, folders, family):
    """encoder_/decoder_/cross_head_stats are the statistics --layer all gives those blocks."""
    shown = _translate(invoke, folders[family])
    every = _translate(invoke, folders[family], "--layer", "all")
    layers = {"encoder": shown["encoder_layer"], "decoder": shown["decoder_layer"]}
    layers["cross"] = layers["decoder"]
    for kind, block in layers.items():
        ours = shown[f"{kind}_head_stats"]
        theirs = every["layers"][kind][block]["head_stats"]
        heads = len(shown["attention_heads"])
        assert len(ours) == len(theirs) == heads * len(TEXTS), kind
        for mine, reference in zip(ours, theirs, strict=True):
            assert mine.keys() == reference.keys()
            for key, value in mine.items():
                if isinstance(value, float):
                    assert value == pytest.approx(reference[key], abs=1e-6), (kind, key)
                else:
                    assert value == reference[key], (kind, key)
