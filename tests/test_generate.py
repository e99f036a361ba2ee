"""``run TEXT --model DIR --generate N``: greedy decoding with a KV cache, held to transformers.

Every decoder family with a tiny fixture that has an LM head: the ids generated equal
``generate(do_sample=False, num_beams=1, max_new_tokens=N)``'s, and every block's weights
of the final sequence, each row as its step computed it, equal transformers' eager
attention (per step from ``generate(output_attentions=True)``, and teacher-forced over the
final sequence) to 1e-5; the cache grows by a position a step (a sliding window keeps W),
its bytes estimated equal measured at every step; bad input is one line, exit 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tiny_models
import tiny_seq2seq
import torch
from family_checks import tolerance_of

from attnctl.report.generation import alignment_of

N = 6
TOLERANCE = 1e-5
# the families with an LM head in their fixture: GPT-2 tied to its GPT2Model embedding,
# the recent ones written as *ForCausalLM; and GPT-2, Llama, Mistral, Qwen2 written as
# *ForCausalLM (tiny_seq2seq.write_causal: "transformer."/"model." keys, lm_head.weight)
CAUSAL = ("gpt2", *tiny_models.RECENT_FAMILIES)
WRITTEN_CAUSAL = tuple(f"{family}-lm" for family in tiny_seq2seq.CAUSAL_FAMILIES)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("generate")
    written = {family: tiny_models.write(family, root / family) for family in CAUSAL}
    sliding = tiny_models.OPTIONS["qwen3"]["sliding"]
    written["qwen3-sliding"] = tiny_models.write("qwen3", root / "qwen3-sliding", **sliding)
    for name in WRITTEN_CAUSAL:
        written[name] = tiny_seq2seq.write_causal(name.removesuffix("-lm"), root / name)
    return written


def _hf_model(folder: Path):
    import transformers

    transformers.utils.logging.set_verbosity_error()
    config = json.loads((folder / "config.json").read_text())
    if config["model_type"] == "gpt2":  # saved as GPT2Model: the head is tied to wte
        model_class = transformers.GPT2LMHeadModel
    else:
        model_class = transformers.AutoModelForCausalLM
    return model_class.from_pretrained(folder, attn_implementation="eager").eval()


def _generate(invoke, folder: Path, *extra: str, text: str = tiny_models.LONG_TEXT) -> dict:
    result = invoke(
        "run", text, "--model", str(folder), "--generate", str(N), "--json",
        "--device", "cpu", *extra,
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def _prompt(document: dict) -> torch.Tensor:
    return torch.tensor([[t["id"] for t in row] for row in document["prompt_tokens"]])


@pytest.mark.parametrize("family", [*CAUSAL, "qwen3-sliding", *WRITTEN_CAUSAL])
def test_ids_and_every_attention_equal_transformers(invoke, folders, family):
    folder = folders[family]
    document = _generate(invoke, folder, "--layer", "all")
    prompt = _prompt(document)
    hf = _hf_model(folder)
    with torch.no_grad():
        reference = hf.generate(
            prompt, do_sample=False, num_beams=1, max_new_tokens=N,
            output_attentions=True, return_dict_in_generate=True,
            pad_token_id=hf.generation_config.pad_token_id or 0,
        )  # fmt: skip
    expected = reference.sequences[:, prompt.shape[1] :].tolist()
    assert document["generated_ids"] == expected
    final = torch.tensor([ids + gen for ids, gen in zip(prompt.tolist(), expected, strict=True)])
    with torch.no_grad():
        forced = hf(final, output_attentions=True, use_cache=False).attentions
    length = final.shape[1]
    assert [len(block["attention"][0][0]) for block in document["layers"]] == [length] * len(forced)
    for block in document["layers"]:
        ours = torch.tensor(block["attention"])  # (B, H, T, T)
        theirs = forced[block["layer"]]
        assert (ours - theirs).abs().max().item() <= tolerance_of(family), (family, block["layer"])
        # the rows as each generate() step computed them: the prompt's, then one a step
        # (its keys: the last ones the cache kept, which a sliding window may cut)
        for step, per_layer in enumerate(reference.attentions):
            step_rows = per_layer[block["layer"]]  # (B, H, q, k)
            last = prompt.shape[1] + step  # the row after the step's rows
            rows = ours[:, :, last - step_rows.shape[2] : last, last - step_rows.shape[3] : last]
            assert (rows - step_rows).abs().max().item() <= tolerance_of(family), (family, step)
    assert document["tokens"][0][-N:] == [
        {"id": i, **{k: v for k, v in t.items() if k != "id"}}
        for i, t in zip(expected[0], document["tokens"][0][-N:], strict=True)
    ]


def test_the_cache_grows_a_position_a_step_estimated_equals_measured(invoke, folders):
    document = _generate(invoke, folders["gpt2"])
    prompt_len = len(document["prompt_tokens"][0])
    steps = document["steps"]
    assert len(steps) == N and document["stop"] == "limit"
    assert document["layer"] == 2 == document["kv_cache_layer"]  # the last block by default
    for number, step in enumerate(steps):
        assert step["position"] == prompt_len + number
        assert step["kv_cache_shape"] == [1, 4, prompt_len + number, 8]  # (B, Hkv, T, d_k)
        assert step["kv_cache_bytes"] == step["measured_kv_cache_bytes"]
        assert step["kv_cache_bytes"] == 3 * 2 * (prompt_len + number) * 4 * 8 * 4
        assert step["token"] == [document["generated_ids"][0][number]]
    final = prompt_len + N  # the last token fed once more: its row and K, V exist
    assert document["kv_cache_bytes"] == document["measured_kv_cache_bytes"]
    assert document["kv_cache_bytes"] == 3 * 2 * final * 4 * 8 * 4
    assert document["attention_rows"] == list(range(final))
    assert len(document["tokens"][0]) == final
    # the run document's keys stay
    for key in ("model", "config", "stages", "head_stats", "attention_heads", "memory"):
        assert key in document


def test_a_sliding_window_keeps_its_last_keys_and_says_what_fell_out(invoke, folders):
    folder = folders["qwen3-sliding"]  # block 0 sees every key, blocks 1 and 2 slide over 6
    document = _generate(invoke, folder)
    window = tiny_models.SHORT_WINDOW
    prompt_len = len(document["prompt_tokens"][0])
    assert prompt_len > window
    for number, step in enumerate(document["steps"]):
        cached = prompt_len + number
        assert step["kv_cache_shape"][2] == window
        assert step["kv_cache_shapes"][0][2] == cached
        assert step["dropped"] == [0, cached - window, cached - window]
        assert step["kv_cache_bytes"] == step["measured_kv_cache_bytes"]
    attention = torch.tensor(document["attention"])  # block 2, (B, H, T, T)
    last = attention[0, :, -1]  # the last row: only the window's keys have weight
    assert (last[:, : attention.shape[-1] - window] == 0).all()
    assert (last[:, -window:] > 0).all()
    result = tiny_models_run(invoke, folder)
    final = prompt_len + N
    assert f"blocks 1–2 slide over {window} keys: positions 0–{final - window - 1} dropped" in (
        result.stdout
    )
    assert "dropped" in result.stdout.splitlines()[_line(result.stdout, "steps · block 2") + 2]


def tiny_models_run(invoke, folder: Path, *extra: str, columns: int = 100):
    result = invoke(
        "run", tiny_models.LONG_TEXT, "--model", str(folder), "--generate", str(N),
        "--device", "cpu", *extra, columns=columns,
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    return result


def _line(text: str, start: str) -> int:
    return next(i for i, line in enumerate(text.splitlines()) if line.startswith(start))


def test_terminal_view_steps_and_summary(invoke, folders):
    document = _generate(invoke, folders["gemma3"])
    result = tiny_models_run(invoke, folders["gemma3"], "--layer", "0", "--head", "1")
    out = result.stdout
    assert "steps · block 0" in out
    assert f"{N} · stopped by the limit of {N} (--generate)" in out
    assert "blocks 0–1 slide over 6 keys" in out
    assert "mean of head 1" in out
    prompt_len = len(document["prompt_tokens"][0])
    for number in range(N):
        assert any(
            line.split()[:2] == [str(number), str(prompt_len + number)] for line in out.splitlines()
        )
    for line in out.splitlines():
        assert line == line.rstrip()


@pytest.mark.parametrize("columns", [60, 80, 120])
def test_every_width_keeps_every_line_within_it(invoke, folders, columns):
    for extra in ((), ("--layer", "all")):
        out = tiny_models_run(invoke, folders["gemma2"], *extra, columns=columns).stdout
        widest = max(len(line) for line in out.splitlines())
        assert widest <= columns, (columns, extra, widest)


def test_generation_stops_when_every_text_has_ended(invoke, folders, tmp_path):
    first = _generate(invoke, folders["gpt2"])["generated_ids"][0][0]
    folder = tmp_path / "gpt2-ends"
    tiny_models.write("gpt2", folder)
    tiny_models.rewrite_config(folder, eos_token_id=first)  # the first token chosen ends it
    document = _generate(invoke, folder)
    assert document["generated_ids"] == [[first]]
    assert document["stop"] == "eos" and len(document["steps"]) == 1
    out = tiny_models_run(invoke, folder).stdout
    assert "1 · stopped by every text ended with an end-of-sequence token" in out


def test_a_batch_of_texts_of_one_length(invoke, folders):
    document = _generate(invoke, folders["phi3"], text="the cat")
    result = invoke(
        "run", "the cat", "the dog", "--model", str(folders["phi3"]), "--generate", str(N),
        "--json", "--device", "cpu",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    batch = json.loads(result.stdout)
    assert batch["generated_ids"][0] == document["generated_ids"][0]
    assert [len(row) for row in batch["generated_ids"]] == [N, N]
    assert batch["steps"][0]["kv_cache_shape"][0] == 2
    prompt = _prompt(batch)
    hf = _hf_model(folders["phi3"])
    with torch.no_grad():
        expected = hf.generate(
            prompt, do_sample=False, num_beams=1, max_new_tokens=N, pad_token_id=0
        )
    assert batch["generated_ids"] == expected[:, prompt.shape[1] :].tolist()


def test_each_steps_strongest_keys_are_its_row_averaged_over_the_heads(invoke, folders):
    for extra, heads in (((), [0, 1, 2, 3]), (("--head", "2", "--head", "0"), [2, 0])):
        document = _generate(invoke, folders["olmo2"], "--layer", "1", *extra)
        assert document["attention_heads"] == heads and document["layer"] == 1
        attention = torch.tensor(document["attention"])[0]  # (h, T, T)
        for step in document["steps"]:
            row = attention[:, step["position"] - 1].mean(dim=0)  # the row that chose it
            top = row.topk(len(step["top_keys"][0]))
            assert [key for key, _ in step["top_keys"][0]] == top.indices.tolist()
            weights = [weight for _, weight in step["top_keys"][0]]
            assert weights == pytest.approx(top.values.tolist(), abs=1e-6)


def _refused(result, message: str) -> None:
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert lines[0].startswith("attnctl: error: ")


def test_bad_requests_are_refused_in_one_line(invoke, folders, tmp_path):
    gpt2 = str(folders["gpt2"])
    _refused(invoke("run", "hi", "--generate", "3"), "--generate needs a pretrained model")
    _refused(invoke("run", "hi", "--model", gpt2, "--generate", "0"), ">= 1, got 0")
    _refused(invoke("run", "hi", "--model", gpt2, "--generate", "-2"), ">= 1, got -2")
    _refused(
        invoke("run", "hi", "--model", gpt2, "--generate", "64"),
        "takes at most 64 positions (learned positions)",
    )
    _refused(
        invoke("run", tiny_models.LONG_TEXT, "--model", gpt2, "--generate", "50"),
        "positions: GPT-2 takes at most 64 (learned positions); generate at most",
    )
    _refused(
        invoke("run", "the cat", "the big dog", "--model", gpt2, "--generate", "2"),
        "a decoder would generate after the padding; give one text, or texts of one length",
    )
    _refused(invoke("run", "hi", "--model", gpt2, "--generate", "2", "--rows", "0:1"), "--rows")
    _refused(
        invoke("run", "hi", "--model", gpt2, "--generate", "2", "--impl", "sdpa"),
        "it runs the math path; leave out --impl sdpa",
    )
    _refused(
        invoke("run", "hi", "--model", gpt2, "--generate", "2", "--context", "x"),
        "no cross-attention",
    )
    bert = tiny_models.write("bert", tmp_path / "bert")
    _refused(invoke("run", "hi", "--model", str(bert), "--generate", "2"), "encoder-only")
    llama = tiny_models.write("llama", tmp_path / "llama")  # LlamaModel: no lm_head.weight
    _refused(invoke("run", "hi", "--model", str(llama), "--generate", "2"), "holds no LM head")
    (folders["gpt2"] / "generation_config.json").write_text('{"guidance_scale": 3.0}')
    try:
        _refused(
            invoke("run", "hi", "--model", gpt2, "--generate", "2"),
            "guidance_scale",
        )
        plain = invoke("run", "hi", "--model", gpt2, "--device", "cpu")
        assert plain.exit_code == 0, plain.stderr  # a plain run is not refused
    finally:
        (folders["gpt2"] / "generation_config.json").unlink()


def test_alignment_takes_the_row_that_chose_each_token():
    # one text, two heads, a target of the start token and two generated, three sources
    cross = [[
        [[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [0.2, 0.6, 0.2]],
        [[0.5, 0.4, 0.1], [0.2, 0.3, 0.5], [0.1, 0.8, 0.1]],
    ]]  # fmt: skip  # (B, h, Lt, Ls)
    matrix, aligned = alignment_of(cross, [0, 1], [0, 1], [[9, 5, 7]], [3])
    assert matrix[0][0] == pytest.approx([0.6, 0.3, 0.1])
    assert [(a.target_position, a.target_id, a.source_position) for a in aligned[0]] == [
        (1, 5, 0),
        (2, 7, 2),
    ]
    _, one_head = alignment_of(cross, [0, 1], [1], [[9, 5, 7]], [2])  # padding: 2 sources
    assert [a.source_position for a in one_head[0]] == [0, 1]
    _, ended = alignment_of(cross, [0, 1], [0, 1], [[9, 5, 7]], [3], eos_ids=(5,))
    assert [a.target_id for a in ended[0]] == [5]  # the pad after the end chose nothing


def _render(renderables, width: int) -> str:
    from rich.console import Console, Group

    console = Console(width=width, no_color=True, highlight=False, emoji=False)
    with console.capture() as captured:
        console.print(Group(*renderables))
    return captured.get()


def test_alignment_view_of_a_translation_built_by_hand():
    from attnctl.render.json import translation_dict
    from attnctl.render.terminal_generation import alignment_view
    from attnctl.report.generation import TranslationView
    from attnctl.trace import Token

    source = [[Token(5, "猫", 0, 1), Token(6, "吃", 1, 2), Token(7, "鱼", 2, 3)]]
    target = [[Token(0, "<s>", -1, -1), Token(11, "cat", 0, 3), Token(12, " eats", 3, 8),
               Token(13, " fish", 8, 13)]]  # fmt: skip
    cross = [[
        [[0.8, 0.1, 0.1], [0.2, 0.7, 0.1], [0.1, 0.1, 0.8], [0.3, 0.3, 0.4]],
        [[0.6, 0.3, 0.1], [0.1, 0.8, 0.1], [0.2, 0.2, 0.6], [0.4, 0.3, 0.3]],
    ]]  # fmt: skip  # (B, h, Lt, Ls)
    matrix, aligned = alignment_of(cross, [0, 1], [0, 1], [[0, 11, 12, 13]], [3])
    view = TranslationView(
        source_tokens=source, target_tokens=target, encoder_block=0, decoder_block=1,
        heads=[0, 1], encoder_attention=[], decoder_attention=[], cross_attention=cross,
        averaged_heads=[0, 1], alignment_matrix=matrix, alignment=aligned,
    )  # fmt: skip
    wide = _render(alignment_view(view, 100), 100)
    assert "cat → 猫" in wide and "eats → 吃" in wide and "fish → 鱼" in wide
    assert "0.70*" in wide  # row 0 chose "cat": 猫 at 0.7 = (0.8 + 0.6) / 2
    for width in (40, 60):
        narrow = _render(alignment_view(view, width), width)
        assert max(len(line.rstrip()) for line in narrow.splitlines()) <= width
    document = translation_dict(view)
    assert [a["source_position"] for a in document["alignment"][0]] == [0, 1, 2]
    assert document["cross_attention"] == cross


@pytest.mark.parametrize("width", [20, 37, 60, 80, 200])
def test_every_shape_and_size_stays_whole_at_every_width(invoke, folders, width):
    from test_terminal import assert_fits

    from attnctl.memory.estimate import format_bytes

    args = ("run", "the cat eats", "--model", str(folders["qwen3-sliding"]), "--generate", "3")
    document = json.loads(invoke(*args, "--json", "--device", "cpu").stdout)
    result = invoke(*args, "--device", "cpu", columns=width)
    assert result.exit_code == 0, result.stderr
    values = []
    for step in document["steps"]:
        values += [format_bytes(step["kv_cache_bytes"]), str(step["position"])]
        values.append("(" + ", ".join(map(str, step["kv_cache_shape"])) + ")")
    values.append(format_bytes(document["kv_cache_bytes"]))
    assert_fits(result.stdout, width, values)


def test_generated_tokens_decode_in_place(folders):
    from tokenizers import Tokenizer

    from attnctl.text.tokenize import decode_pieces, decode_texts

    spec = str(folders["gpt2"] / "tokenizer.json")  # byte-level: 猫 may be split in bytes
    tokenizer = Tokenizer.from_file(spec)
    prompt, generated = tokenizer.encode("the").ids, tokenizer.encode(" 猫 eats").ids
    pieces = decode_pieces([generated], spec, [prompt])[0]
    assert "".join(p for p in pieces if p != "\ufffd") == " 猫 eats"
    assert decode_texts([generated], spec, [prompt]) == [" 猫 eats"]
    spec = str(folders["llama-lm"] / "tokenizer.json")  # Metaspace: "▁eats" after a word
    tokenizer = Tokenizer.from_file(spec)
    before, whole = tokenizer.encode("the").ids, tokenizer.encode("the cat").ids
    assert whole[: len(before)] == before
    pieces = decode_pieces([whole[len(before) :]], spec, [before])[0]
    assert pieces[0].startswith(" ") and "".join(pieces) == " cat"
    # without the prompt before it, the word's space is lost as at the start of a text
    assert decode_pieces([whole[len(before) :]], spec)[0][0] == pieces[0][1:]


def test_a_text_that_ends_first_is_padded_as_transformers_pads_it(invoke, folders, tmp_path):
    import shutil

    texts = ("the cat", "the dog")
    args = ("--generate", str(N), "--json", "--device", "cpu")
    first = json.loads(invoke("run", *texts, "--model", str(folders["phi3"]), *args).stdout)
    ended, going = first["generated_ids"]
    eos = ended[1]  # text 0 ends at step 1, text 1 never
    assert eos not in going and eos != ended[0]
    folder = shutil.copytree(folders["phi3"], tmp_path / "phi3")
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        path.write_text(json.dumps({**json.loads(path.read_text()), "eos_token_id": eos}))
    result = invoke("run", *texts, "--model", str(folder), *args)
    assert result.exit_code == 0, result.stderr
    document = json.loads(result.stdout)
    hf = _hf_model(folder)
    prompt = _prompt(document)
    with torch.no_grad():
        expected = hf.generate(prompt, do_sample=False, num_beams=1, max_new_tokens=N)
    assert document["generated_ids"] == expected[:, prompt.shape[1] :].tolist()
    pad = hf.generation_config.pad_token_id
    assert document["generated_ids"][0] == [ended[0], eos] + [pad] * (N - 2)
    assert document["stop"] == "limit"  # text 1 never ended
    assert [step["finished"] for step in document["steps"][:2]] == [[False, False], [True, False]]


@pytest.mark.parametrize("columns", [74, 80, 100, 140])
def test_each_step_is_one_line_where_the_table_fits(invoke, folders, columns):
    out = tiny_models_run(invoke, folders["gemma3"], "--layer", "0", columns=columns).stdout
    lines = out.splitlines()
    title = _line(out, "steps · block 0")
    start = next(i for i in range(title, len(lines)) if lines[i].lstrip().startswith("─")) + 1
    rows = lines[start : start + N]
    assert [row.split()[0] for row in rows] == [str(n) for n in range(N)], rows
    assert lines[start + N] == ""  # no step wrapped onto a second line
    shown = [row.count(" · ") + 1 for row in rows]
    assert all(1 <= count <= 3 for count in shown)
    if columns >= 140:
        assert shown == [3] * N
