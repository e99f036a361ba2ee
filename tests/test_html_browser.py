"""run --html in a real browser: Debian's Chromium, driven by Playwright, the network blocked.

The browser is found by ATTNCTL_CHROMIUM, else ``chromium`` on PATH. Without one the tests
skip, naming the package, except under ATTNCTL_REQUIRE_BROWSER=1 (CI), where they fail.

The page's DOM contract that these tests read (attnctl/render/html_assets/report.js):
``html[data-ready="1"]`` once drawn; ``svg#head-view`` (``data-layer``, ``data-source``,
``data-batch``, ``data-mode``: all, topk or row) with ``text.token.query`` /
``text.token.key`` (``data-pos``; classes ``pad``, ``generated``), ``rect.token-bg``
(``fill-opacity``: the focused row's weight) and ``line.edge`` (``data-h``, ``data-q``,
``data-k``, ``data-w``, ``stroke-opacity``; class ``hidden`` when another row or column is
isolated); ``table#focus-weights`` (the focused token's weights, a column a head);
``input.head-toggle[data-head]``; ``canvas.matrix[data-head]``; ``#model-view
canvas.cell[data-layer][data-head]``; selects ``#layer-select``, ``#source-select``,
``#batch-select``; tables ``#tokens``, ``#stages``, ``#memory``, ``#head-stats``.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import zlib
from pathlib import Path

import pytest
import tiny_models
import tiny_seq2seq
from typer.testing import CliRunner

from attnctl.cli import app

LAUNCH_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SMALL = ("--d-model", "32", "--heads", "4", "--device", "cpu")
INJECTION = "</script><img src=x onerror=alert(1)>&\"'"
RUNNER = CliRunner()


def chromium_path() -> str | None:
    return os.environ.get("ATTNCTL_CHROMIUM") or shutil.which("chromium")


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium for the module (fails instead of skipping in CI)."""
    required = os.environ.get("ATTNCTL_REQUIRE_BROWSER") == "1"
    path = chromium_path()
    if path is None:
        if required:
            pytest.fail(
                "ATTNCTL_REQUIRE_BROWSER=1 but no Chromium was found (ATTNCTL_CHROMIUM unset, "
                "no chromium on PATH): apt-get install chromium"
            )
        pytest.skip("needs Chromium: apt-get install chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        if required:
            pytest.fail(
                'ATTNCTL_REQUIRE_BROWSER=1 but playwright is missing: pip install -e ".[test]"'
            )
        pytest.skip('needs playwright: pip install -e ".[test]"')
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=path, args=LAUNCH_ARGS)
        yield launched
        launched.close()


def write_page(folder: Path, name: str, *args: str) -> tuple[Path, dict]:
    """run ARGS --html FOLDER/NAME.html --json: the page and the JSON document."""
    path = folder / f"{name}.html"
    env = {"COLUMNS": "100", "NO_COLOR": "1", "TERM": "dumb"}
    result = RUNNER.invoke(app, ["run", *args, "--json", "--html", str(path)], env=env)
    assert result.exit_code == 0, result.output
    return path, json.loads(result.stdout)


@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    folder = tmp_path_factory.mktemp("html-browser")
    gpt2 = str(tiny_models.write("gpt2", folder / "gpt2"))
    marian = str(tiny_seq2seq.write("marian", folder / "marian"))
    long_text = ("the cat sat on the mat. " * 20)[:400]
    cpu = ("--device", "cpu")
    return {
        "seeded": write_page(folder, "seeded", "Are you OK?", *SMALL),
        "batch": write_page(folder, "batch", "the cat", "a dog sat down", *SMALL),
        "blocks": write_page(
            folder, "blocks", "hello world", "--model", gpt2, "--layer", "all", *cpu
        ),
        "generate": write_page(
            folder, "generate", "hello", "--model", gpt2, "--generate", "3", *cpu
        ),
        "seq2seq": write_page(
            folder, "seq2seq", "猫吃鱼", "--model", marian, "--generate", "4", *cpu
        ),
        "seq2seq-all": write_page(
            folder,
            "seq2seq-all",
            "猫吃鱼",
            "--model",
            marian,
            *words("--generate 3 --layer all"),
            *cpu,
        ),
        "context": write_page(
            folder, "context", "the cat sat", "--context", "a dog ran off", *SMALL
        ),
        "long": write_page(
            folder, "long", long_text, *words("--tokenizer char --mask causal"), *SMALL
        ),
        "inject": write_page(
            folder, "inject", INJECTION, *words("--tokenizer char --rows all"), *SMALL
        ),
    }


class Opened:
    """A page opened in a fresh context, every request recorded and all but the file refused."""

    def __init__(self, browser, path: Path) -> None:
        self.url = path.resolve().as_uri()
        self.context = browser.new_context(viewport={"width": 1280, "height": 900})
        self.requests: list[str] = []
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.context.route("**/*", self._route)
        self.page = self.context.new_page()
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda error: self.errors.append(f"page error: {error}"))
        self.page.on("dialog", self._dialog)
        self.page.goto(self.url)
        self.page.wait_for_selector("html[data-ready='1']", state="attached", timeout=15_000)

    def _route(self, route) -> None:
        self.requests.append(route.request.url)
        if route.request.url == self.url:
            route.continue_()
        else:
            route.abort()

    def _console(self, message) -> None:
        if message.type in ("error", "warning"):
            self.errors.append(f"console {message.type}: {message.text}")

    def _dialog(self, dialog) -> None:
        self.dialogs.append(dialog.message)
        dialog.dismiss()

    def attribute_list(self, selector: str, name: str) -> list[str]:
        return self.page.eval_on_selector_all(
            selector, f"nodes => nodes.map(n => n.getAttribute({name!r}))"
        )

    def texts(self, selector: str) -> list[str]:
        return self.page.eval_on_selector_all(selector, "nodes => nodes.map(n => n.textContent)")

    def visible_edges(self) -> list[dict[str, str]]:
        return self.page.eval_on_selector_all(
            "#head-view line.edge:not(.hidden)",
            "nodes => nodes.map(n => ({h: n.dataset.h, q: n.dataset.q, k: n.dataset.k,"
            " o: n.getAttribute('stroke-opacity'), w: n.dataset.w}))",
        )

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def opened(browser):
    made: list[Opened] = []

    def _open(path: Path) -> Opened:
        made.append(Opened(browser, path))
        return made[-1]

    yield _open
    for each in made:
        each.close()


def words(text: str) -> list[str]:
    return text.split()


def full_label(token: dict) -> str:
    """The token table's label: the whole text, spaces alone shown as ␣, nothing as ∅."""
    text = token["text"]
    return text.replace(" ", "\u2423") or "\u2205" if text.strip() == "" else text


def label(token: dict) -> str:
    """The head view's label of a token, as report.js makes it (short, ASCII tests)."""
    text = token["text"]
    if text.strip() == "":
        text = text.replace(" ", "\u2423") or "\u2205"
    return "pad" if token["pad"] else (text if len(text) <= 12 else text[:11] + "\u2026")


# ---------------------------------------------------------------- loading


NAMES = ("seeded", "batch", "context", "blocks", "generate", "seq2seq", "seq2seq-all", "long",
         "inject")  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
def test_the_page_draws_with_no_error_and_no_request_but_itself(name, pages, opened):
    path, _ = pages[name]
    page = opened(path)
    assert page.errors == []
    assert page.requests == [page.url]  # the file, and nothing else: no font, script or image
    assert page.dialogs == []
    for table in ("#tokens", "#alignment" if name.startswith("seq2seq") else "#memory"):
        assert page.page.locator(table).count() == 1, table


def test_the_dom_holds_every_token_and_every_head(pages, opened):
    path, document = pages["seeded"]
    page = opened(path)
    tokens = document["tokens"][0]
    want = [f"{i} {label(t)}" for i, t in enumerate(tokens)]
    assert page.texts("#head-view text.token.query") == want
    assert page.texts("#head-view text.token.key") == want
    heads = [str(h) for h in document["attention_heads"]]
    assert page.attribute_list("input.head-toggle", "data-head") == heads
    assert page.attribute_list("canvas.matrix", "data-head") == heads
    # every key of every row of every head is a line (none is under 0.002 here)
    assert len(page.visible_edges()) == len(heads) * len(tokens) ** 2
    token_cells = page.texts("#tokens tr td:nth-child(3)")
    assert token_cells == [t["text"] for t in tokens]
    assert page.texts("#stages tr td:nth-child(2)") == [s["name"] for s in document["stages"]]
    assert len(page.texts("#head-stats tr td:first-child")) == len(document["head_stats"])


def test_a_line_shows_its_weight(pages, opened):
    path, document = pages["seeded"]
    page = opened(path)
    weights = document["attention"][0]  # (heads, rows, keys)
    edges = page.visible_edges()
    assert edges
    for edge in edges:
        want = weights[int(edge["h"])][int(edge["q"])][int(edge["k"])]
        assert abs(float(edge["w"]) - want) <= 0.0001
        assert abs(float(edge["o"]) - want**0.5) <= 0.0006  # opacity √w, as the shading


def test_a_document_with_extra_keys_and_nulls_draws(pages, opened, tmp_path):
    from attnctl.render.html import html_page

    _, document = pages["seeded"]
    nulls = words(
        "prompt_tokens source_tokens target_tokens layers steps alignment encoder_attention "
        "decoder_attention cross_attention generated_text head_stats memory stages"
    )
    path = tmp_path / "nulls.html"
    path.write_text(html_page({"schema_version": "1.0", **document, **dict.fromkeys(nulls)}))
    page = opened(path)
    assert page.errors == [] and page.requests == [page.url]
    assert page.page.locator("#head-view text.token.query").count() == 4
    assert page.page.locator("#stages").count() == page.page.locator("#memory").count() == 0


# ---------------------------------------------------------------- interaction


def test_hovering_a_token_isolates_its_row_or_column(pages, opened):
    path, document = pages["seeded"]
    page = opened(path)
    header = dict(zip(page.texts("header dt"), page.texts("header dd"), strict=True))
    assert f"seed {document['config']['seed']}" in header["layer"]  # the seeded layer's
    assert page.texts("#head-view-section .legend span") == []  # nothing generated or padded
    every = page.visible_edges()
    assert page.attribute_list("#head-view rect.token-bg", "fill-opacity") == ["0"] * 8
    page.page.hover('#head-view text.token.query[data-pos="2"]')
    row = page.visible_edges()
    assert row and len(row) < len(every) and {e["q"] for e in row} == {"2"}
    assert page.page.get_attribute("#head-view", "data-focus") == "query:2"
    shaded = page.attribute_list('#head-view rect.token-bg[data-side="key"]', "fill-opacity")
    assert all(float(value) > 0 for value in shaded)  # each key shaded by row 2's weight
    assert "focus" in page.page.get_attribute('text.token.query[data-pos="2"]', "class")
    # beside it, row 2's weights as numbers: a row a key, a column a head (and the mean)
    cells = page.page.eval_on_selector_all(
        "#focus-weights tr", "rows => rows.slice(1).map(r => [...r.cells].map(c => c.textContent))"
    )
    weights = document["attention"][0]
    assert len(cells) == len(document["tokens"][0])
    for key, row in enumerate(cells):
        for head, text in enumerate(row[1 : 1 + len(weights)]):
            assert abs(float(text) - weights[head][2][key]) <= 0.0051
    page.page.hover('#head-view text.token.key[data-pos="1"]')
    column = page.visible_edges()
    assert column and {e["k"] for e in column} == {"1"}
    page.page.mouse.move(5, 5)  # away: every line again
    assert len(page.visible_edges()) == len(every)
    page.page.click('#head-view text.token.query[data-pos="0"]')  # a click pins the row
    page.page.mouse.move(5, 5)
    assert {e["q"] for e in page.visible_edges()} == {"0"}


def test_unticking_a_head_removes_its_lines(pages, opened):
    path, _ = pages["seeded"]
    page = opened(path)
    assert "0" in {e["h"] for e in page.visible_edges()}
    page.page.uncheck('input.head-toggle[data-head="0"]')
    assert "0" not in {e["h"] for e in page.visible_edges()}
    assert "off" in page.page.get_attribute('figure.head-matrix[data-head="0"]', "class")
    page.page.click("#heads-none")
    assert page.visible_edges() == []


def test_the_layer_selector_and_the_model_view_switch_blocks(pages, opened):
    path, document = pages["blocks"]
    page = opened(path)
    layers = [str(block["layer"]) for block in document["layers"]]
    assert page.texts("#layer-select option") == [f"block {n}" for n in layers]
    first = page.visible_edges()
    assert page.page.get_attribute("#head-view", "data-layer") == layers[0]
    page.page.select_option("#layer-select", str(len(layers) - 1))
    assert page.page.get_attribute("#head-view", "data-layer") == layers[-1]
    last = page.visible_edges()
    assert [e["o"] for e in last] != [e["o"] for e in first]
    heads = len(document["attention_heads"])
    assert page.page.locator("#model-view canvas.cell").count() == len(layers) * heads
    page.page.click('#model-view canvas.cell[data-layer="1"][data-head="2"]')
    assert page.page.get_attribute("#head-view", "data-layer") == "1"
    assert page.page.input_value("#layer-select") == "1"
    assert {e["h"] for e in page.visible_edges()} == {"2"}
    assert page.texts("#model-view table th")[-1] == f"block {layers[-1]}"
    # block 0's stage table, as the document has it
    assert page.texts("#stages tr td:nth-child(2)") == [s["name"] for s in document["stages"]]
    assert "block 0" in page.texts("#stages-section h2")[0]


def test_the_encoder_decoder_switches_between_its_three_attentions(pages, opened):
    path, document = pages["seq2seq"]
    page = opened(path)
    source, target = document["source_tokens"][0], document["target_tokens"][0]
    expected = {"0": (source, source), "1": (target, target), "2": (target, source)}
    kinds = {"0": "encoder", "1": "decoder", "2": "cross"}
    for value, (queries, keys) in expected.items():
        page.page.select_option("#source-select", value)
        assert page.page.locator("#head-view text.token.query").count() == len(queries)
        assert page.page.locator("#head-view text.token.key").count() == len(keys)
        # each attention's own statistics, one row a head and text
        stats = document[f"{kinds[value]}_head_stats"]
        assert stats and len(page.texts("#head-stats tr td:first-child")) == len(stats)
    # the target after its start token is generated
    assert page.page.locator("#head-view text.token.query.generated").count() == len(target) - 1
    # the legend names only what the view shows: nothing generated in the encoder's
    for value, legend in (("2", ["generated tokens"]), ("1", ["generated tokens"]), ("0", [])):
        page.page.select_option("#source-select", value)
        assert page.texts("#head-view-section .legend span") == legend
    # its memory, as memory --src-len S --tgt-len T gives it (tests/test_seq2seq_memory.py)
    exact = page.texts("#memory tr td:nth-child(3)")
    memory = document["memory"]
    keys = words("encoder_peak_activation_bytes decoder_peak_activation_bytes kv_cache_bytes "
                 "cross_kv_cache_bytes peak_bytes parameters_bytes")  # fmt: skip
    for key in keys:
        assert f"{memory[key]:,} B" in exact
    assert "encoder peak activations (block 0)" in page.texts("#memory tr td:first-child")


def test_generated_tokens_and_padding_are_marked(pages, opened):
    path, document = pages["generate"]
    page = opened(path)
    generated = len(document["tokens"][0]) - len(document["prompt_tokens"][0])
    assert generated == 3
    assert page.page.locator("#head-view text.token.query.generated").count() == generated
    # the header: a checkpoint's own positions (GPT-2's are learned), no seed; quoted text
    header = dict(zip(page.texts("header dt"), page.texts("header dd"), strict=True))
    assert document["model"]["positions"] == "learned" and document["config"]["pos"] == "none"
    assert "positions learned" in header["attention layer"]
    assert "seed" not in header["attention layer"] and "pos none" not in header["attention layer"]
    assert header["generated"] == f"“{document['generated_text'][0]}”"
    path, document = pages["batch"]
    page = opened(path)
    assert page.page.get_attribute("#head-view", "data-batch") == "0"
    padded = sum(t["pad"] for t in document["tokens"][0])
    assert padded > 0
    assert page.page.locator("#head-view text.token.key.pad").count() == padded
    # a padding query row draws no fan of lines (its weights are noise)
    padding = {str(i) for i, t in enumerate(document["tokens"][0]) if t["pad"]}
    assert page.visible_edges() and not {e["q"] for e in page.visible_edges()} & padding
    assert page.texts("#head-view-section .legend span") == [
        "padding (weight 0 as a key, no lines as a query)"
    ]
    page.page.select_option("#batch-select", "1")
    assert page.page.get_attribute("#head-view", "data-batch") == "1"
    assert page.page.locator("#head-view text.token.key.pad").count() == 0
    assert page.texts("#head-view-section .legend span") == []  # the longest: no padding


def test_a_long_input_draws_only_the_computed_rows_and_their_strongest_keys(pages, opened):
    path, document = pages["long"]
    page = opened(path)
    rows = document["attention_rows"]
    assert len(rows) == 32 < len(document["tokens"][0])
    queries = page.attribute_list("#head-view text.token.query", "data-pos")
    assert queries == [str(r) for r in rows]
    mode = page.page.get_attribute("#head-view", "data-mode")
    assert mode in ("topk", "row")
    k = int(page.page.input_value("#top-k"))
    edges = page.visible_edges()
    heads = len(document["attention_heads"])
    assert 0 < len(edges) <= (1 if mode == "row" else len(rows)) * heads * k
    assert any("not drawn" in text for text in page.texts("#head-view text.gap"))
    page.page.fill("#top-k", "2")
    page.page.dispatch_event("#top-k", "change")
    assert len(page.visible_edges()) <= len(rows) * heads * 2


def test_small_weights_keep_their_digits_and_masked_keys_say_so(pages, opened):
    path, document = pages["long"]
    page = opened(path)
    rows, weights = document["attention_rows"], document["attention"][0]  # (heads, rows, keys)
    page.page.uncheck('input.head-toggle[data-head="1"]')  # head 0 alone: no mean column
    for head in document["attention_heads"][2:]:
        page.page.uncheck(f'input.head-toggle[data-head="{head}"]')
    for index in (0, len(rows) - 1):  # an early row (most keys masked), the last (400 keys)
        page.page.hover(f'#head-view text.token.query[data-pos="{rows[index]}"]')
        cells = page.page.eval_on_selector_all(
            "#focus-weights tr",
            "rows => rows.slice(1).map(r => [...r.cells].map(c => c.textContent))",
        )
        assert len(cells) == 24
        for key_text, weight_text in cells:
            weight = weights[0][index][int(key_text.split()[0])]
            if weight == 0:
                assert weight_text == "—"
            else:
                assert float(weight_text) == pytest.approx(weight, rel=6e-3)
        shown = [float(w) for _, w in cells if w != "—"]
        if index == 0:
            assert {w for _, w in cells} >= {"—"} and len(shown) == rows[0] + 1  # causal
        else:  # 400 keys: every listed weight is small, and none reads 0
            assert max(shown) < 0.05 and min(shown) > 0 and all(w != "0.00" for _, w in cells)
    # a matrix cell's readout: the masked key says so, the first key gives its weight
    canvas = page.page.locator('canvas.matrix[data-head="0"]').bounding_box()
    keys = len(document["tokens"][0])
    page.page.mouse.move(canvas["x"] + 96 + keys - 0.5, canvas["y"] + 6 + 6)  # row 0, last key
    readout = page.page.text_content("#matrices-section .readout")
    assert readout.endswith(": masked (weight exactly 0)"), readout
    page.page.mouse.move(canvas["x"] + 96 + 0.5, canvas["y"] + 6 + 6)  # row 0, key 0
    readout = page.page.text_content("#matrices-section .readout")
    assert float(readout.rsplit(": ", 1)[1]) == pytest.approx(weights[0][0][0], rel=6e-3)


def test_user_text_is_text_not_markup(pages, opened):
    path, document = pages["inject"]
    page = opened(path)
    assert page.dialogs == [] and page.errors == []
    assert page.page.locator("img").count() == 0
    assert page.page.locator("#report script").count() == 0
    cells = page.texts("#tokens tr td:nth-child(3)")
    assert cells == [full_label(t) for t in document["tokens"][0]]
    assert "<" in cells and "&" in cells and '"' in cells
    assert page.page.title().startswith("attnctl run: </script><img")


def test_the_context_is_the_key_side(pages, opened):
    path, document = pages["context"]
    page = opened(path)
    texts, context = document["tokens"][0], document["context_tokens"][0]
    assert len(texts) != len(context)
    assert page.page.get_attribute("#head-view", "data-source") == "cross"
    assert page.texts("#head-view text.token.query") == [
        f"{i} {label(t)}" for i, t in enumerate(texts)
    ]
    assert page.texts("#head-view text.token.key") == [
        f"{i} {label(t)}" for i, t in enumerate(context)
    ]
    assert page.page.locator("#key-tokens").count() == 1


def test_every_block_of_every_attention_of_an_encoder_decoder(pages, opened):
    path, document = pages["seq2seq-all"]
    page = opened(path)
    for value, kind in enumerate(("encoder", "decoder", "cross")):
        page.page.select_option("#source-select", str(value))
        blocks = [str(block["layer"]) for block in document["layers"][kind]]
        assert page.texts("#layer-select option") == [f"block {n}" for n in blocks]
        page.page.select_option("#layer-select", str(len(blocks) - 1))
        assert page.page.get_attribute("#head-view", "data-layer") == blocks[-1]
        assert page.page.get_attribute("#head-view", "data-source") == kind
        heads = len(document["attention_heads"])
        assert page.page.locator("#model-view canvas.cell").count() == len(blocks) * heads
    assert page.errors == []


# ---------------------------------------------------------------- the picture


def png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """Width, height and each row's pixels (RGBA or RGB bytes) of an 8-bit PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    position, chunks, header = 8, [], None
    while position < len(data):
        (length,) = struct.unpack(">I", data[position : position + 4])
        kind = data[position + 4 : position + 8]
        body = data[position + 8 : position + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            chunks.append(body)
        position += 12 + length
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and interlace == 0
    channels = 4 if colour == 6 else 3
    raw = zlib.decompress(b"".join(chunks))
    stride = width * channels
    rows: list[bytes] = []
    previous = bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1 : start + 1 + stride])
        for i in range(stride):
            left = line[i - channels] if i >= channels else 0
            up = previous[i]
            corner = previous[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + left) & 255
            elif kind == 2:
                line[i] = (line[i] + up) & 255
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 255
            elif kind == 4:
                guess = left + up - corner
                best = min((abs(guess - left), 0, left), (abs(guess - up), 1, up),
                           (abs(guess - corner), 2, corner))[2]  # fmt: skip
                line[i] = (line[i] + best) & 255
        rows.append(bytes(line))
        previous = line
    return width, height, [bytes(row) for row in rows]


def test_a_screenshot_is_not_blank(pages, opened):
    path, _ = pages["seeded"]
    page = opened(path)
    shot = page.page.locator("#head-view").screenshot()
    width, height, rows = png_pixels(shot)
    channels = len(rows[0]) // width
    colours: dict[bytes, int] = {}
    for row in rows:
        for x in range(0, len(row), channels):
            pixel = row[x : x + 3]
            colours[pixel] = colours.get(pixel, 0) + 1
    assert width > 300 and height > 60
    assert len(colours) > 50  # lines in the heads' colours, anti-aliased text
    assert max(colours.values()) < 0.97 * width * height  # not one flat colour
    saturated = sum(n for (r, g, b), n in ((tuple(c), n) for c, n in colours.items())
                    if max(r, g, b) - min(r, g, b) > 60)  # fmt: skip
    assert saturated > 100  # the heads' coloured lines are drawn
