"""Marian, BART, T5 v1 and T5 v1.1 against transformers: greedy generation and every attention.

The oracle is transformers' own ``generate(do_sample=False, num_beams=1, max_new_tokens=N)``
with eager attention on tiny checkpoints it wrote (tests/tiny_seq2seq.py): the generated ids
must be identical, and every encoder, decoder and cross-attention of every block equal to its
weights (``output_attentions=True``) within 1e-5, at every generation step, on a batch of
several source texts padded on the right. attnctl's last row (the last token, fed once more
so that its row exists) is held to transformers' teacher-forced forward over the whole target.
"""

from __future__ import annotations

import json

import hf_seq2seq
import pytest
import tiny_seq2seq
import torch

from attnctl.errors import AttnctlError
from attnctl.model.describe import CROSS_ATTENTION
from attnctl.model.families import read_model
from attnctl.nn.generate import decoder_weights, encode, greedy
from attnctl.nn.weights import model_weights

TEXTS = list(tiny_seq2seq.TEST_TEXTS)
NEW_TOKENS = 8
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("seq2seq")
    return {f: tiny_seq2seq.write(f, root / f) for f in tiny_seq2seq.SEQ2SEQ_FAMILIES}


def attnctl_generate(folder, texts, new_tokens=NEW_TOKENS):
    """attnctl's engine on the folder: (encoded, decoded, the description)."""
    model = read_model(folder)
    config = model.layer_config(dtype="float32", impl="math")
    run = model.with_run(config)
    weights = model_weights(run, config, torch.device("cpu"), blocks=None, head=True).named
    ids, mask = hf_seq2seq.encode_source(folder, texts)
    padding = mask.bool()
    decoder = run.decoder
    with torch.inference_mode():
        encoded = encode(run, weights, ids, padding, range(run.layers), list(range(run.heads)))
        start = torch.full((len(texts), 1), decoder.generation.start_id)
        decoded = greedy(
            decoder,
            decoder_weights(weights),
            start,
            new_tokens,
            shown=range(decoder.layers),
            heads=list(range(decoder.heads)),
            encoder_output=encoded.output,
            encoder_padding=padding,
        )
    return encoded, decoded, run


@pytest.mark.parametrize("family", tiny_seq2seq.SEQ2SEQ_FAMILIES)
def test_generation_and_every_attention_equal_transformers_at_every_step(folders, family):
    folder = folders[family]
    reference = hf_seq2seq.generate_seq2seq(folder, TEXTS, NEW_TOKENS, dtype="float32")
    encoded, decoded, model = attnctl_generate(folder, TEXTS)
    start = model.decoder.generation.start_id
    assert [[start, *row] for row in decoded.generated] == reference.generated.tolist()
    assert len(decoded.generated[0]) >= 4  # the fixtures' draw generates before it ends
    for n, expected in enumerate(reference.encoder_attentions):  # (B, H, Ls, Ls)
        assert (encoded.attention[n, "attention"] - expected).abs().max() <= TOLERANCE
    steps = len(reference.decoder_attentions)
    for n in range(model.decoder.layers):
        own = decoded.attention[n, "attention"]  # (B, H, Lt, Lt)
        cross = decoded.attention[n, "cross_attention"]  # (B, H, Lt, Ls)
        for step in range(steps):
            expected = reference.decoder_attentions[step][n]  # (B, H, 1, step + 1)
            row = own[:, :, step : step + 1, : step + 1]
            assert (row - expected).abs().max() <= TOLERANCE, (family, n, step)
            assert own[:, :, step, step + 1 :].abs().max() == 0  # causal: later keys unseen
            expected_cross = reference.cross_attentions[step][n]  # (B, H, 1, Ls)
            assert (cross[:, :, step : step + 1] - expected_cross).abs().max() <= TOLERANCE
        forced = reference.teacher_forced  # the whole target at once: every row, the last too
        assert own.shape == forced.decoder_attentions[n].shape
        assert (own - forced.decoder_attentions[n]).abs().max() <= TOLERANCE
        assert (cross - forced.cross_attentions[n]).abs().max() <= TOLERANCE


@pytest.mark.parametrize("family", tiny_seq2seq.SEQ2SEQ_FAMILIES)
def test_padding_gives_each_text_what_it_gets_alone(folders, family):
    _, batch, _ = attnctl_generate(folders[family], TEXTS)
    for row, text in enumerate(TEXTS):
        _, alone, _ = attnctl_generate(folders[family], [text])
        length = len(alone.generated[0])
        assert batch.generated[row][:length] == alone.generated[0]
        cross = batch.attention[0, "cross_attention"][row, :, : length + 1]
        own_keys = alone.attention[0, "cross_attention"].shape[-1]
        expected = alone.attention[0, "cross_attention"][0]
        assert (cross[..., :own_keys] - expected).abs().max() <= TOLERANCE
        assert cross[..., own_keys:].abs().sum() == 0  # padded source keys: weight exactly 0


def test_a_row_that_ends_early_is_padded_while_the_others_go_on(folders):
    texts = [tiny_seq2seq.EARLY_EOS_TEXT["t5v11"], TEXTS[2]]
    reference = hf_seq2seq.generate_seq2seq(folders["t5v11"], texts, NEW_TOKENS, dtype="float32")
    _, decoded, model = attnctl_generate(folders["t5v11"], texts)
    start, pad = model.decoder.generation.start_id, model.decoder.generation.pad_id
    assert [[start, *row] for row in decoded.generated] == reference.generated.tolist()
    eos = model.decoder.generation.eos_ids[0]
    first = decoded.generated[0]
    assert eos in first and all(t == pad for t in first[first.index(eos) + 1 :])


def test_cross_attention_keys_and_values_are_made_once_per_block(folders):
    _, decoded, model = attnctl_generate(folders["bart"], TEXTS[:1])
    source_len = decoded.attention[0, "cross_attention"].shape[-1]
    for step, record in enumerate(decoded.steps):
        for block in record.cache:
            assert block["cross_attention"][2] == source_len  # the encoder output's length
            assert block["attention"][2] == step + 1  # one more position a step
    kinds = {s.kind for s in model.decoder.blocks[0].sublayers if hasattr(s, "config")}
    assert CROSS_ATTENTION in kinds


def test_the_descriptions_say_what_the_specs_say(folders):
    marian, bart, t5, t5v11 = (read_model(folders[f]) for f in tiny_seq2seq.SEQ2SEQ_FAMILIES)
    assert marian.embeddings.positions == "sinusoidal_halves" and marian.embeddings.scale
    assert bart.embeddings.positions == "learned" and bart.embeddings.position_offset == 2
    assert bart.embeddings.norm == "layer"
    assert marian.decoder.head.bias and bart.decoder.head.bias and marian.decoder.head.tied
    assert marian.generation.banned_ids == (marian.generation.pad_id,)
    assert marian.generation.forced_eos_id == marian.generation.eos_ids[0]
    assert t5.config.pos == "relative" and t5.config.query_scale == 1.0
    assert [b.attention.computes_bias for b in t5.blocks] == [True, False]
    assert t5.final_norm is not None and t5.decoder.final_norm is not None
    assert t5.decoder.head.tied and t5.decoder.head.scale == pytest.approx(32**-0.5)
    assert not t5v11.decoder.head.tied and t5v11.decoder.head.scale == 0.0
    assert t5v11.blocks[0].sublayers[1].gated and not t5.blocks[0].sublayers[1].gated
    assert (t5v11.layers, t5v11.decoder.layers) == (3, 2)


def _edit(folder, **values):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(values)
    path.write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("family", "values", "message"),
    [
        ("bart", {"normalize_before": True}, "normalize_before"),
        ("bart", {"add_final_layer_norm": True}, "add_final_layer_norm"),
        ("marian", {"d_model": 33}, "d_model"),
        ("t5", {"feed_forward_proj": "swiglu-gelu"}, "feed_forward_proj"),
        ("t5", {"dense_act_fn": "tanh"}, "dense_act_fn"),
        ("t5", {"relative_attention_num_buckets": 2}, "relative_attention_num_buckets"),
        ("bart", {"encoder_layers": 5}, "encoder_layers is 5 but the weights hold 2 blocks"),
        ("t5", {"num_decoder_layers": 9}, "num_decoder_layers is 9"),
    ],
)
def test_keys_that_change_the_math_are_honoured_or_refused_by_name(
    tmp_path, family, values, message
):
    folder = tiny_seq2seq.write(family, tmp_path / family)
    with pytest.raises(AttnctlError) as error:
        read_model(_edit(folder, **values))
    assert message in error.value.message
    assert "\n" not in error.value.message


def test_a_missing_decoder_start_token_is_a_generation_problem(tmp_path):
    folder = tiny_seq2seq.write("t5", tmp_path / "t5")
    (folder / "generation_config.json").unlink()
    config = json.loads((folder / "config.json").read_text())
    config.pop("decoder_start_token_id", None)
    config.pop("bos_token_id", None)
    (folder / "config.json").write_text(json.dumps(config))
    model = read_model(folder)  # shapes and memory still read it
    assert model.generation.start_id is None
    assert model.decoder.generation.problem.endswith(
        "has no decoder_start_token_id (nor bos_token_id): the decoder has no token to start from"
    )
