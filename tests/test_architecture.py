"""The architecture as a test: every module's imports (read with ``ast``, the ones inside
functions too) point down the layer order of docs/design.md, and none forms a cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "attnctl"

# Bottom to top. A module may import from a lower layer or from its own package; two
# packages on one layer (app and render) may not import each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors",),
    ("literal",),
    ("output_files",),
    ("trace",),
    ("window",),
    ("stats",),
    ("model",),
    ("text",),
    ("stages",),
    ("nn",),
    ("replay",),
    ("memory",),
    ("parallel",),
    ("report",),
    ("app", "render"),
    ("cli",),
    ("__main__",),
)
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The attnctl modules ``name`` imports, at the top or inside a function."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "attnctl")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            if source.split(".")[0] != "attnctl":
                continue
            for alias in node.names:
                member = f"{source}.{alias.name}"
                found.add(member if member in known else source)
    found.discard(name)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, set(known)) for name, path in known.items()}


def part_of(name: str) -> str:
    """The layer entry a module belongs to: its package, or itself at the top."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(n for n in modules() if n != "attnctl" and part_of(n) not in RANK)
    assert not unplaced, f"modules outside the layer order: {unplaced}"


def test_imports_point_down_the_layers() -> None:
    upward = []
    for name, targets in graph().items():
        if name == "attnctl":
            continue
        own = part_of(name)
        for target in targets:
            other = part_of(target)
            if target == "attnctl" or other == own:
                continue
            if RANK[other] >= RANK[own]:
                upward.append(f"{name} -> {target}")
    assert not upward, "imports against the layer order:\n" + "\n".join(sorted(upward))


def test_no_import_cycles() -> None:
    edges = graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for target in sorted(edges.get(name, ())):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target)
        path.pop()
        state[name] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_at_most_sixteen_modules_beside_the_packages() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 16, top


def test_the_checker_sees_an_upward_import_and_a_cycle(tmp_path: Path) -> None:
    """The checks above can fail: a module of a fake tree importing upward is found."""
    source = tmp_path / "low.py"
    source.write_text("from attnctl.cli import main\n", "utf-8")
    found = imports("attnctl.model.low", source, {"attnctl.cli"})
    assert found == {"attnctl.cli"}
    assert RANK[part_of("attnctl.cli")] > RANK[part_of("attnctl.model.low")]


# ---------------------------------------------------------------- start-up

LOADED = """\
import io, contextlib, sys
sys.argv = ["attnctl", *sys.argv[1:]]
from attnctl.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        main()
    except SystemExit as exit:
        assert not exit.code, exit.code
print(" ".join(sorted(sys.modules)))
"""
HEAVY = ("torch", "tokenizers", "safetensors", "numpy")
UNUSED = ("attnctl.replay", "attnctl.model.families.", "attnctl.nn", "attnctl.parallel",
          "attnctl.render.html", "attnctl.render.json", "attnctl.text.sentencepiece")  # fmt: skip


@pytest.mark.parametrize(
    "args", [("--help",), ("shapes",), ("shapes", "--json"), ("memory", "-L", "256")]
)
def test_start_up_loads_only_what_the_command_uses(args):
    """``--help``, ``shapes`` and ``memory`` of the seeded layer import neither torch nor
    the tokenizers, the training replay, the families, the torch twins or the renderers
    they do not draw with: their start-up is a benchmark's target (benchmarks/startup.py)."""
    done = subprocess.run(
        [sys.executable, "-c", LOADED, *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    loaded = set(done.stdout.split())
    assert not loaded & set(HEAVY)
    wrongly = sorted(m for m in loaded for unused in UNUSED if _within(m, unused))
    if "--json" in args:  # json_memory draws the document, with render.json's helpers
        wrongly = [m for m in wrongly if m != "attnctl.render.json"]
    assert not wrongly, wrongly


def _within(module: str, unused: str) -> bool:
    """``module`` is ``unused`` or inside it (``unused`` ending in a dot: inside only)."""
    if unused.endswith("."):
        return module.startswith(unused)
    return module == unused or module.startswith(unused + ".")


# ---------------------------------------------------------------- sizes a reader can hold


def test_no_module_is_over_600_lines():
    long = {name: n for name, path in modules().items()
            if (n := len(path.read_text("utf-8").splitlines())) > 600}  # fmt: skip
    assert not long, long


def test_each_command_body_is_at_most_40_lines():
    """A Typer command parses, calls one use case and hands the report to cli/output.py."""
    tree = ast.parse((PACKAGE / "cli" / "commands.py").read_text("utf-8"))
    commands = [node for node in tree.body if isinstance(node, ast.FunctionDef)
                and any("command" in ast.unparse(d) for d in node.decorator_list)]  # fmt: skip
    assert {c.name for c in commands} >= {"run", "shapes", "memory", "check", "tokenizer"}
    long = {c.name: c.end_lineno - c.body[0].lineno + 1 for c in commands}
    assert max(long.values()) <= 40, long


def test_at_most_ten_functions_are_over_80_lines():
    """A function fits a screen; the few longer ones are declarative (a family's tensor
    table, a command's options)."""
    long = sorted(
        (node.end_lineno - node.lineno + 1, f"{name}.{node.name}")
        for name, path in modules().items()
        for node in ast.walk(ast.parse(path.read_text("utf-8")))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > 80
    )
    assert len(long) <= 10, long


def test_the_families_listed_without_importing_them_are_the_modules():
    """--help lists the families from their sources (attnctl.model.families.declared):
    what it reads is what each module declares."""
    import importlib

    from attnctl.model.families import declared

    listed = declared()
    assert len(listed) == len(list((PACKAGE / "model" / "families").glob("*.py"))) - 2
    for family in listed:
        module = importlib.import_module(f"attnctl.model.families.{family.module}")
        assert (family.model_types, family.kind) == (module.MODEL_TYPES, module.KIND)
