"""run --save FILE.safetensors: stages and attention, loadable with safetensors, equal to --json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tiny_models
import tiny_seq2seq
import torch
from safetensors import safe_open
from safetensors.torch import load_file

ATTENTION_KEYS = ("attention", "encoder_attention", "decoder_attention", "cross_attention")


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Path:
    return tiny_models.write("gpt2", tmp_path_factory.mktemp("save") / "gpt2")


@pytest.fixture(scope="module")
def marian(tmp_path_factory) -> Path:
    return tiny_seq2seq.write("marian", tmp_path_factory.mktemp("save") / "marian")


def _run_both(invoke, path: Path, *args: str) -> tuple[dict, dict, dict]:
    """The --json document, the saved tensors and the saved metadata of the same run."""
    as_json = invoke("run", *args, "--device", "cpu", "--json")
    assert as_json.exit_code == 0, as_json.stderr
    saved = invoke("run", *args, "--device", "cpu", "--save", str(path))
    assert saved.exit_code == 0, saved.stderr
    with safe_open(str(path), "pt") as handle:
        meta = handle.metadata()
    return json.loads(as_json.stdout), load_file(str(path)), meta


def _assert_attention_equal(document: dict, tensors: dict) -> None:
    expected = {k: document[k] for k in ATTENTION_KEYS if document.get(k) is not None}
    layers = document.get("layers")
    groups = layers.items() if isinstance(layers, dict) else [("", layers or [])]
    for kind, blocks in groups:
        for block in blocks:
            expected[f"{kind + '.' if kind else ''}block.{block['layer']}.attention"] = block[
                "attention"
            ]
    assert expected
    for name, weights in expected.items():
        assert tensors[name].dtype == torch.float32
        assert torch.equal(tensors[name], torch.tensor(weights, dtype=torch.float32)), name


def _assert_metadata(document: dict, meta: dict) -> None:
    assert json.loads(meta["schema_version"]) == document["schema_version"] == 1
    assert json.loads(meta["config"]) == document["config"]
    assert json.loads(meta["tokens"]) == document["tokens"]
    assert all(isinstance(v, str) for v in meta.values())


def test_seeded_layer_batch_saves_every_stage_and_the_attention(invoke, tmp_path):
    document, tensors, meta = _run_both(
        invoke,
        tmp_path / "a.safetensors",
        "the cat sat",
        "a dog",
        "--heads",
        "4",
        "--d-model",
        "32",
    )
    _assert_attention_equal(document, tensors)
    _assert_metadata(document, meta)
    for stage in document["stages"]:
        assert list(tensors[stage["name"]].shape) == stage["shape"], stage["name"]
        assert str(tensors[stage["name"]].dtype).removeprefix("torch.") == stage["dtype"]
    # the recorded weights are the attention the JSON shows (every row, every head)
    assert torch.allclose(tensors["weights"], tensors["attention"], atol=0, rtol=0)
    assert not list(tmp_path.glob(".*"))  # no temporary file left


def test_context_saves_the_cross_attention(invoke, tmp_path):
    document, tensors, meta = _run_both(
        invoke,
        tmp_path / "c.safetensors",
        "the cat",
        "--context",
        "le chat noir",
        "--d-model",
        "32",
    )
    _assert_attention_equal(document, tensors)
    assert json.loads(meta["context_tokens"]) == document["context_tokens"]
    assert tensors["attention"].shape[-1] == len(document["context_tokens"][0])


def test_model_one_layer_names_its_stages_by_block(invoke, tmp_path, gpt2):
    args = ("the cat sat on the mat", "--model", str(gpt2), "--layer", "1")
    document, tensors, meta = _run_both(invoke, tmp_path / "m.safetensors", *args)
    _assert_attention_equal(document, tensors)
    _assert_metadata(document, meta)
    assert document["stages"]
    for stage in document["stages"]:
        assert list(tensors[f"block.1.{stage['name']}"].shape) == stage["shape"]
    assert json.loads(meta["layer"]) == 1


def test_model_every_layer_saves_each_block(invoke, tmp_path, gpt2):
    args = ("the cat sat", "--model", str(gpt2), "--layer", "all")
    document, tensors, _ = _run_both(invoke, tmp_path / "all.safetensors", *args)
    _assert_attention_equal(document, tensors)
    blocks = [block["layer"] for block in document["layers"]]
    assert len(blocks) > 1
    assert {f"block.{n}.attention" for n in blocks} <= set(tensors)


def test_generate_saves_the_attention_of_the_final_sequence(invoke, tmp_path, gpt2):
    args = ("the cat", "--model", str(gpt2), "--generate", "3")
    document, tensors, meta = _run_both(invoke, tmp_path / "g.safetensors", *args)
    _assert_attention_equal(document, tensors)
    _assert_metadata(document, meta)
    assert json.loads(meta["generated_text"]) == document["generated_text"]


def test_encoder_decoder_saves_its_three_attentions(invoke, tmp_path, marian):
    args = ("the cat", "--model", str(marian), "--generate", "3")
    document, tensors, meta = _run_both(invoke, tmp_path / "t.safetensors", *args)
    _assert_attention_equal(document, tensors)
    assert {"encoder_attention", "decoder_attention", "cross_attention"} <= set(tensors)
    assert json.loads(meta["target_tokens"]) == document["target_tokens"]


@pytest.mark.parametrize(
    "name, says",
    [
        ("out.json", "must end in .safetensors"),
        ("missing/out.safetensors", "no folder missing"),
        (".", "must end in .safetensors"),
    ],
)
def test_a_bad_path_is_one_line_and_writes_nothing(invoke, tmp_path, monkeypatch, name, says):
    monkeypatch.chdir(tmp_path)
    result = invoke("run", "the cat", "--save", name)
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.startswith("attnctl: error: --save") and says in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_a_directory_named_like_the_file_is_refused(invoke, tmp_path):
    (tmp_path / "d.safetensors").mkdir()
    result = invoke("run", "the cat", "--save", str(tmp_path / "d.safetensors"))
    assert result.exit_code == 2 and "is a folder, not a file" in result.stderr
    assert list((tmp_path / "d.safetensors").iterdir()) == []


def test_an_existing_file_is_replaced_whole(invoke, tmp_path):
    target = tmp_path / "r.safetensors"
    target.write_bytes(b"old")
    result = invoke("run", "the cat", "--d-model", "32", "--save", str(target))
    assert result.exit_code == 0, result.stderr
    assert "attention" in load_file(str(target))


def test_the_kept_stages_count_in_the_memory_check(invoke, tmp_path, monkeypatch):
    asked = _recorded_need(monkeypatch)
    args = ("run", "the cat sat", "--d-model", "32", "--device", "cpu")
    as_json = invoke(*args, "--json")
    saved = invoke(*args, "--save", str(tmp_path / "s.safetensors"))
    assert as_json.exit_code == 0 and saved.exit_code == 0, saved.stderr
    stage_bytes = sum(stage["bytes"] for stage in json.loads(as_json.stdout)["stages"])
    assert asked[1] - asked[0] == stage_bytes > 0


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(invoke, tmp_path, monkeypatch):
    import attnctl.output_files as output_files

    def full_disk(source, destination):  # the temporary file is written whole by then
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(output_files.os, "replace", full_disk)
    target = tmp_path / "f.safetensors"
    target.write_bytes(b"old")
    result = invoke("run", "the cat", "--d-model", "32", "--save", str(target))
    assert result.exit_code == 1
    assert result.stderr.strip().endswith("No space left on device")
    assert len(result.stderr.strip().splitlines()) == 1
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.safetensors"]


def test_save_with_json_prints_the_same_document(invoke, tmp_path):
    args = ("run", "the cat", "--d-model", "32", "--device", "cpu", "--json")
    alone = invoke(*args)
    both = invoke(*args, "--save", str(tmp_path / "j.safetensors"))
    assert both.exit_code == 0, both.stderr
    assert json.loads(both.stdout) == json.loads(alone.stdout)
    _assert_attention_equal(json.loads(both.stdout), load_file(str(tmp_path / "j.safetensors")))


SAVED_VIEWS = {
    "seeded": lambda gpt2, marian: ("the cat", "a dog eats"),
    "every block": lambda gpt2, marian: ("the cat sat", "--model", str(gpt2), "--layer", "all"),
    "generate": lambda gpt2, marian: ("the cat", "--model", str(gpt2), "--generate", "3"),
    "generate every block": lambda gpt2, marian: (
        "the cat", "--model", str(gpt2), "--generate", "2", "--layer", "all"),
    "encoder–decoder": lambda gpt2, marian: ("the cat", "--model", str(marian), "--generate", "3"),
    "encoder–decoder every block": lambda gpt2, marian: (
        "the cat", "a dog", "--model", str(marian), "--generate", "2", "--layer", "all"),
}  # fmt: skip


@pytest.mark.parametrize("name", SAVED_VIEWS)
def test_every_view_saves_its_attention_with_tables_and_with_the_heatmap(
    invoke, tmp_path, gpt2, marian, name
):
    args = SAVED_VIEWS[name](gpt2, marian)
    document, tensors, meta = _run_both(invoke, tmp_path / "tables.safetensors", *args)
    _assert_attention_equal(document, tensors)
    heatmap = tmp_path / "heatmap.safetensors"
    result = invoke("run", *args, "--device", "cpu", "--view", "heatmap", "--save", str(heatmap))
    assert result.exit_code == 0, result.stderr
    assert "legend:" in result.stdout  # the heatmap was drawn
    drawn = load_file(str(heatmap))
    assert drawn.keys() == tensors.keys()
    assert all(torch.equal(drawn[key], tensors[key]) for key in tensors)
    with safe_open(str(heatmap), "pt") as handle:
        assert handle.metadata() == meta
    if "every block" in name and "encoder" in name:  # each kind of each block
        assert {"encoder.block.1.attention", "decoder.block.1.attention",
                "cross.block.1.attention"} <= set(tensors)  # fmt: skip


def _recorded_need(monkeypatch) -> list[int]:
    """The bytes each run after this asks the pre-flight for, in order (the use cases
    import it from ``app/preflight.py``; generation when it starts)."""
    import attnctl.app.preflight as preflight
    import attnctl.app.use_cases as use_cases

    asked: list[int] = []
    real = preflight.preflight

    def recording(plan, need_bytes, *rest, **kwargs):
        asked.append(need_bytes)
        return real(plan, need_bytes, *rest, **kwargs)

    monkeypatch.setattr(preflight, "preflight", recording)
    monkeypatch.setattr(use_cases, "preflight", recording)
    return asked


def _block_documents(invoke, gpt2: Path, text: str) -> list[dict]:
    """``--layer N --json`` for each block of the tiny GPT-2: the stages the plan names."""
    documents = []
    for n in range(3):
        result = invoke("run", text, "--model", str(gpt2), "--layer", str(n), "--device", "cpu",
                        "--json")  # fmt: skip
        assert result.exit_code == 0, result.stderr
        documents.append(json.loads(result.stdout))
    return documents


def _own_stages(document: dict) -> list[dict]:
    """A block's stages from its input on: the inputs and embeddings are block 0's."""
    stages = document["stages"]
    names = [stage["name"] for stage in stages]
    return stages if document["layer"] == 0 else stages[names.index("hidden") :]


def test_model_every_layer_saves_every_blocks_stages(invoke, tmp_path, gpt2):
    text = "the cat sat on the mat"
    args = (text, "--model", str(gpt2), "--layer", "all")
    document, tensors, meta = _run_both(invoke, tmp_path / "stages.safetensors", *args)
    dims = json.loads(meta["stages"])
    groups = json.loads(meta["stage_groups"])
    assert list(groups) == ["block.0.", "block.1.", "block.2."]
    per_block = _block_documents(invoke, gpt2, text)
    alone = tmp_path / "alone.safetensors"
    expected_names = set()
    for n, block_document in enumerate(per_block):
        result = invoke("run", *args[:3], "--layer", str(n), "--device", "cpu", "--save",
                        str(alone))  # fmt: skip
        assert result.exit_code == 0, result.stderr
        one_block = load_file(str(alone))
        for stage in _own_stages(block_document):
            name = f"block.{n}.{stage['name']}"
            expected_names.add(name)
            assert list(tensors[name].shape) == stage["shape"], name
            assert str(tensors[name].dtype).removeprefix("torch.") == stage["dtype"], name
            assert dims[name] == stage["dims"], name
            # the same values as the block's own --layer N run (the same pass through it)
            assert torch.equal(tensors[name], one_block[name]), name
        # the recorded weights are the attention the JSON shows for that block
        shown = torch.tensor(document["layers"][n]["attention"], dtype=torch.float32)
        assert torch.equal(tensors[f"block.{n}.weights"], shown)
    assert set(dims) == expected_names
    assert set(tensors) == expected_names | {f"block.{n}.attention" for n in range(3)}
    # the inputs once, with block 0
    assert "block.0.token_ids" in tensors and "block.1.token_ids" not in tensors


def test_every_layer_kept_stages_count_in_the_memory_check(invoke, tmp_path, monkeypatch, gpt2):
    text = "the cat sat on the mat"
    per_block = _block_documents(invoke, gpt2, text)
    asked = _recorded_need(monkeypatch)
    args = ("run", text, "--model", str(gpt2), "--layer", "all", "--device", "cpu")
    assert invoke(*args, "--json").exit_code == 0
    target = tmp_path / "big.safetensors"
    assert invoke(*args, "--save", str(target)).exit_code == 0
    kept = sum(stage["bytes"] for document in per_block for stage in _own_stages(document))
    assert asked[1] - asked[0] == kept > 0
    # refused, --force-less, when the copies would not fit: nothing written, nothing printed
    import attnctl.memory.resources as resources
    from attnctl.memory.resources import Available

    target.unlink()
    between = Available(asked[0] + kept // 2, "x")
    monkeypatch.setattr(resources, "available_memory", lambda device: between)
    assert invoke(*args, "--json").exit_code == 0  # without the copies it fits
    refused = invoke(*args, "--save", str(target))
    assert refused.exit_code == 1 and refused.stdout == ""
    assert "use --force to try anyway" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    assert not target.exists() and not list(tmp_path.glob(".*"))


def test_generate_saves_the_prefills_stages_of_every_block(invoke, tmp_path, gpt2):
    text = "the cat sat on the mat"
    args = (text, "--model", str(gpt2), "--generate", "3")
    document, tensors, meta = _run_both(invoke, tmp_path / "prefill.safetensors", *args)
    dims = json.loads(meta["stages"])
    assert list(json.loads(meta["stage_groups"])) == [f"prefill.block.{n}." for n in range(3)]
    alone = tmp_path / "alone.safetensors"
    expected = set()
    for n, block_document in enumerate(_block_documents(invoke, gpt2, text)):
        result = invoke("run", text, "--model", str(gpt2), "--layer", str(n), "--device", "cpu",
                        "--save", str(alone))  # fmt: skip
        assert result.exit_code == 0, result.stderr
        one_block = load_file(str(alone))
        for stage in _own_stages(block_document):
            name = f"prefill.block.{n}.{stage['name']}"
            expected.add(name)
            assert list(tensors[name].shape) == stage["shape"], name
            assert dims[name] == stage["dims"], name
            # the prefill is a pass over the prompt: the same values as run --layer N's
            assert torch.equal(tensors[name], one_block[f"block.{n}.{stage['name']}"]), name
    assert set(dims) == expected and set(tensors) == expected | {"attention"}
    # the JSON's stages are the prefill's, as planned for the block shown (the last)
    for stage in _own_stages({**document, "layer": 2}):
        assert list(tensors[f"prefill.block.2.{stage['name']}"].shape) == stage["shape"]
    # the prompt's rows of the final sequence's attention are the prefill's weights
    prompt = len(document["prompt_tokens"][0])
    shown = torch.tensor(document["attention"], dtype=torch.float32)[:, :, :prompt, :prompt]
    assert torch.equal(tensors["prefill.block.2.weights"], shown)


def test_generate_with_save_generates_the_same(invoke, tmp_path, gpt2):
    args = ("run", "the cat", "--model", str(gpt2), "--generate", "4", "--device", "cpu")
    alone = invoke(*args, "--json")
    both = invoke(*args, "--json", "--save", str(tmp_path / "same.safetensors"))
    assert alone.exit_code == 0 and both.exit_code == 0, both.stderr
    assert json.loads(both.stdout) == json.loads(alone.stdout)


def test_generate_kept_stages_count_in_the_memory_check(invoke, tmp_path, monkeypatch, gpt2):
    text = "the cat sat on the mat"
    kept = sum(
        stage["bytes"]
        for document in _block_documents(invoke, gpt2, text)
        for stage in _own_stages(document)
    )
    asked = _recorded_need(monkeypatch)
    args = ("run", text, "--model", str(gpt2), "--generate", "2", "--device", "cpu")
    assert invoke(*args, "--json").exit_code == 0
    assert invoke(*args, "--json", "--save", str(tmp_path / "g.safetensors")).exit_code == 0
    assert asked[1] - asked[0] == kept > 0


def _seq2seq_block_documents(invoke, marian: Path, texts: tuple[str, ...]) -> list[dict]:
    """``--layer N --json`` for each block N of the tiny Marian: encoder block N's and
    decoder block N's planned stages, and their attentions."""
    documents = []
    for n in range(2):
        result = invoke("run", *texts, "--model", str(marian), "--generate", "3", "--layer",
                        str(n), "--device", "cpu", "--json")  # fmt: skip
        assert result.exit_code == 0, result.stderr
        documents.append(json.loads(result.stdout))
    return documents


def _own(stages: list[dict], block: int) -> list[dict]:
    names = [stage["name"] for stage in stages]
    return stages if block == 0 else stages[names.index("hidden") :]


@pytest.mark.parametrize("texts", [("the cat",), ("the cat", "a dog eats fish")])
def test_encoder_decoder_saves_every_blocks_stages(invoke, tmp_path, marian, texts):
    args = (*texts, "--model", str(marian), "--generate", "3")
    document, tensors, meta = _run_both(invoke, tmp_path / "seq2seq.safetensors", *args)
    dims = json.loads(meta["stages"])
    assert list(json.loads(meta["stage_groups"])) == [
        "encoder.block.0.", "encoder.block.1.", "decoder.block.0.", "decoder.block.1."
    ]  # fmt: skip
    target_len = len(document["target_tokens"][0])
    expected = set()
    for n, block_document in enumerate(_seq2seq_block_documents(invoke, marian, texts)):
        assert block_document["target_tokens"] == document["target_tokens"]
        for kind in ("encoder", "decoder"):
            for stage in _own(block_document[f"{kind}_stages"], n):
                name = f"{kind}.block.{n}.{stage['name']}"
                expected.add(name)
                assert dims[name] == stage["dims"], name
                # planned for the whole target the steps may fill (L = N + 1)
                sizes = zip(stage["dims"], stage["shape"], strict=True)
                shape = [target_len if kind == "decoder" and d == "L" else s for d, s in sizes]
                assert list(tensors[name].shape) == shape, name
        # the encoder's weights are the JSON's; the teacher-forced decoder pass's are the
        # steps' (each row computed in its own step), to float error
        encoder = torch.tensor(block_document["encoder_attention"], dtype=torch.float32)
        assert torch.equal(tensors[f"encoder.block.{n}.weights"], encoder)
        for stage, key in (("weights", "decoder_attention"), ("cross_weights", "cross_attention")):
            steps = torch.tensor(block_document[key], dtype=torch.float32)
            recorded = tensors[f"decoder.block.{n}.{stage}"]
            assert recorded.shape == steps.shape
            assert torch.allclose(recorded, steps, atol=1e-5, rtol=0), stage
    assert set(dims) == expected
    assert set(tensors) == expected | {k for k in ATTENTION_KEYS if document.get(k) is not None}
    if len(texts) > 1:  # a padded source: its mask among the encoder's and decoder's inputs
        assert {"encoder.block.0.padding_mask", "decoder.block.0.padding_mask"} <= expected


def test_encoder_decoder_kept_stages_count_in_the_memory_check(
    invoke, tmp_path, monkeypatch, marian
):
    texts = ("the cat", "a dog eats fish")

    def planned_bytes(stage: dict, kind: str, target_len: int) -> int:
        """The JSON plans the decoder for the target made; the pre-flight, for the longest
        (the start token and all 3 tokens): L = 4."""
        scale = 1
        for dim, size in zip(stage["dims"], stage["shape"], strict=True):
            if kind == "decoder" and dim == "L":
                assert size == target_len
                scale *= 4
                stage = {**stage, "bytes": stage["bytes"] // size}
        return stage["bytes"] * scale

    kept = sum(
        planned_bytes(stage, kind, len(document["target_tokens"][0]))
        for n, document in enumerate(_seq2seq_block_documents(invoke, marian, texts))
        for kind in ("encoder", "decoder")
        for stage in _own(document[f"{kind}_stages"], n)
    )
    asked = _recorded_need(monkeypatch)
    args = ("run", *texts, "--model", str(marian), "--generate", "3", "--device", "cpu")
    assert invoke(*args, "--json").exit_code == 0
    target = tmp_path / "t.safetensors"
    assert invoke(*args, "--json", "--save", str(target)).exit_code == 0
    assert asked[1] - asked[0] == kept > 0
    import attnctl.memory.resources as resources
    from attnctl.memory.resources import Available

    target.unlink()
    between = Available(asked[0] + kept // 2, "x")
    monkeypatch.setattr(resources, "available_memory", lambda device: between)
    refused = invoke(*args, "--save", str(target))
    assert refused.exit_code == 1 and refused.stdout == ""
    assert "use --force to try anyway" in refused.stderr
    assert not target.exists()


def test_encoder_decoder_with_save_translates_the_same(invoke, tmp_path, marian):
    args = ("run", "the cat", "a dog", "--model", str(marian), "--generate", "3", "--device",
            "cpu", "--layer", "all", "--json")  # fmt: skip
    alone = invoke(*args)
    both = invoke(*args, "--save", str(tmp_path / "same.safetensors"))
    assert alone.exit_code == 0 and both.exit_code == 0, both.stderr
    assert json.loads(both.stdout) == json.loads(alone.stdout)
