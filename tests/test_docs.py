"""The README a newcomer reads first, the docs/ pages it links, and how their examples stay real."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer.main

from attnctl.cli import app

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
FIRST_SCREEN = 60  # lines
# Written on another branch of the same change; checked like any page once it exists.
# Remove this once docs/model-config-keys.md is merged.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def update_readme():
    sys.path.insert(0, str(ROOT / "scripts"))
    import update_readme

    return update_readme


def without_code(text: str) -> str:
    """Markdown outside fenced code blocks (links inside code are not links)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a heading: lower case, punctuation dropped, spaces as '-'."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    headings = re.findall(r"^#+ (.+)$", without_code(path.read_text(encoding="utf-8")), re.M)
    return {github_anchor(h) for h in headings}


def test_readme_first_screen_installs_runs_tests_and_lists_every_command():
    lines = README.read_text(encoding="utf-8").splitlines()
    screen = "\n".join(lines[:FIRST_SCREEN])
    cpu_torch = screen.find("pip install torch --index-url https://download.pytorch.org/whl/cpu")
    install = screen.find("pip install . && attnctl run")
    assert 0 <= cpu_torch < install, "the CPU torch step comes before `pip install .`"
    marker = screen.find("<!-- test-command")
    assert marker > install
    assert re.search(r'```bash\npython -m pip install -e "\.\[test\]" && python -m pytest\n```',
                     screen[marker:]), "the test command block follows its marker"  # fmt: skip
    example = re.search(r"```text\n\$ attnctl [^\n]+\n.+?\n```", screen, re.DOTALL)
    assert example, "one short example, whole, on the first screen"
    commands = sorted(typer.main.get_command(app).commands)  # every command the CLI has
    assert len(commands) >= 4
    for name in commands:
        assert re.search(rf"^- `attnctl {name}\b", screen, re.MULTILINE), name
    assert re.search(r"^- `--model DIR`", screen, re.MULTILINE)
    assert "(docs/index.md)" in screen, "the reference pages are linked from the first screen"


def test_readme_is_short_and_the_reference_lives_in_docs():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 320
    for page in ("run", "memory", "models", "options", "json", "benchmarks", "design"):
        assert (DOCS / f"{page}.md").is_file(), page


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    text = without_code(page.read_text(encoding="utf-8"))
    links = LINK.findall(text)
    assert links or page == README or page.parent == DOCS
    for link in links:
        if re.match(r"[a-z]+:", link):  # https:, mailto:
            continue
        target, _, fragment = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        assert path.exists(), f"{page.name}: {link} does not exist"
        if fragment:
            assert fragment in anchors(path), f"{page.name}: {link} names no heading"


def test_every_docs_page_is_reachable_from_the_readme():
    reached, todo = {README}, [README]
    while todo:
        page = todo.pop()
        for link in LINK.findall(without_code(page.read_text(encoding="utf-8"))):
            path = (page.parent / link.partition("#")[0]).resolve()
            if path.suffix == ".md" and path.exists() and path not in reached:
                reached.add(path)
                todo.append(path)
    assert set(DOCS.glob("*.md")) <= reached


def test_the_model_folders_are_made_before_an_example_reads_them():
    for page in pages():
        text = page.read_text(encoding="utf-8")
        uses = [m.start() for m in re.finditer(r"^\$ attnctl .*--model models/", text, re.M)]
        if uses:
            made = text.find("python scripts/make_example_models.py")
            assert 0 <= made < min(uses), f"{page.name}: an example reads models/ first"


def test_make_example_models_writes_exactly_the_folders_the_examples_read(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_example_models import write_example_models

    write_example_models(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "gemma-3-1b", "gpt2-tiny", "llama-2-7b", "marian-tiny"
    ]  # fmt: skip
    gpt2 = {p.name for p in (tmp_path / "gpt2-tiny").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= gpt2
    marian = {p.name for p in (tmp_path / "marian-tiny").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= (
        marian
    )
    llama = {p.name for p in (tmp_path / "llama-2-7b").iterdir()}
    assert {"config.json", "model.safetensors"} <= llama
    used = set()
    for page in pages():
        used |= set(re.findall(r"--model models/([\w.-]+)", page.read_text(encoding="utf-8")))
    assert used == {"gpt2-tiny", "marian-tiny", "llama-2-7b", "gemma-3-1b"}


def test_ci_reads_the_readme_test_command():
    script = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    awk = re.search(r"command=\$\((awk .+ README\.md)\)", script).group(1)
    done = subprocess.run(["bash", "-c", awk], cwd=ROOT, capture_output=True, text=True)
    assert done.stdout.strip() == 'python -m pip install -e ".[test]" && python -m pytest'
    for rerun in ("ATEN_CPU_CAPABILITY=default", "OMP_NUM_THREADS=1"):
        assert re.search(rf"^run_pass .*env {rerun} (\w+=\S+ )*python -m pytest", script,
                         re.M), rerun  # fmt: skip


def test_example_blocks_in_docs_are_refreshed_and_unknown_ones_refused():
    module = update_readme()
    command = "attnctl shapes --device cpu"
    page = f"intro\n\n```text\n$ {command}\nold output\n```\n"
    stale: list[str] = []
    assert module.refreshed(page, "docs/x.md", {command: "new output"}, stale) == (
        f"intro\n\n```text\n$ {command}\nnew output\n```\n"
    )
    assert stale == [f"docs/x.md: $ {command}"]
    module.refreshed(page, "docs/x.md", {command: "old output"}, stale)
    assert len(stale) == 1, "a current block is not stale"
    with pytest.raises(SystemExit, match=r"docs/x\.md.*not listed"):
        module.refreshed("```text\n$ attnctl shapes --bogus\n```\n", "docs/x.md", {})
    assert DOCS in {p.parent for p in module.pages()}
    blocks = [m.group(1) for p in pages()
              for m in module.BLOCK.finditer(p.read_text(encoding="utf-8"))]  # fmt: skip
    assert set(blocks) == set(module.EXAMPLES)
    assert any(p.parent == DOCS for p in pages() if module.BLOCK.search(p.read_text("utf-8")))
