from __future__ import annotations

from pathlib import Path

import json_contract
import pytest
from typer.testing import CliRunner

from attnctl.cli import app

GOLDEN = Path(__file__).parent / "golden"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden",
        action="store_true",
        help="rewrite tests/golden/*.txt from the current output instead of comparing",
    )


def _half_sdpa_breaks_on_this_cpu() -> str | None:
    """Why torch cannot run CPU SDPA in bfloat16 here, or None. Under an emulated vector
    unit (ATEN_CPU_CAPABILITY below the CPU's own, as CI does to stand in for other
    CPUs) torch's CPU flash attention still packs for the real CPU's AMX/AVX-512 and
    fails ("pack_vnni2 is only supported when avx512 is supported"); a CPU that really
    lacks them never takes that path."""
    import torch
    import torch.nn.functional as F

    q = torch.zeros(2, 2, 64, 8, dtype=torch.bfloat16)
    try:
        F.scaled_dot_product_attention(q, q, q)
    except RuntimeError as error:
        return f"torch's CPU SDPA in bfloat16 fails under this emulated CPU: {error}"
    return None


def pytest_collection_modifyitems(config, items) -> None:
    reason = _half_sdpa_breaks_on_this_cpu()
    if reason is None:
        return
    for item in items:  # the measured and traced runs of half-precision SDPA on the CPU
        if "sdpa" in item.nodeid and ("bfloat16" in item.nodeid or "float16" in item.nodeid):
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def invoke():
    """Run the CLI in-process at a fixed width, colour off; returns click's Result."""
    runner = CliRunner()

    def _invoke(*args: str, columns: int = 80, input: str | None = None):
        env = {"COLUMNS": str(columns), "NO_COLOR": "1", "TERM": "dumb"}
        return runner.invoke(app, list(args), env=env, input=input)

    return _invoke


@pytest.fixture
def golden(request: pytest.FixtureRequest):
    """Compare text with tests/golden/NAME, or rewrite it under --update-golden."""
    update = request.config.getoption("--update-golden")

    def _check(name: str, text: str) -> None:
        path = GOLDEN / name
        if update:
            path.write_text(text, encoding="utf-8")
            return
        assert path.exists(), f"{path} missing: run pytest --update-golden"
        assert text == path.read_text(encoding="utf-8"), (
            f"output differs from {path.name}; if the change is intended, "
            "rerun with --update-golden and review the diff"
        )

    return _check


@pytest.fixture(autouse=True)
def _json_follows_its_schema(monkeypatch):
    """Every --json document a test produces in-process is checked against its command's
    schema (tests/json_contract.py): as JSON gives it back, schema_version first. A broken
    one fails the command (an internal error) and, whatever the test expected, the test."""
    import attnctl.cli.output

    broken: list[str] = []
    print_json = attnctl.cli.output.print_json

    def checked(document: dict, command: str) -> None:
        try:
            json_contract.check_printed(document, command)
        except AssertionError as error:
            broken.append(str(error))
            raise
        print_json(document, command)

    monkeypatch.setattr(attnctl.cli.output, "print_json", checked)
    yield broken  # a test that expects a broken document takes it out of this list
    if broken:
        pytest.fail("\n".join(broken), pytrace=False)


def pytest_terminal_summary(terminalreporter) -> None:
    spent = json_contract.spent
    if spent["documents"]:
        terminalreporter.write_line(
            f"json contract: {spent['documents']} documents checked against docs/schema "
            f"in {spent['seconds']:.2f} s"
        )


@pytest.fixture
def fewer_colours():
    """rich keeps a style's ANSI codes from the first colour system that printed it, and
    shares combined styles through its caches: after a test printing at 16 or 256 colours
    (one terminal a process in real use), empty them so later tests get truecolor codes."""
    yield
    from rich.style import Style

    for member in vars(Style).values():
        if hasattr(member, "cache_clear"):
            member.cache_clear()


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """The tiny checkpoints (``tests/tiny_models.py``), written and loaded once a session."""
    from rank_pool import TinyModels

    return TinyModels(tmp_path_factory.mktemp("tiny"))


def _rank_modules() -> set[str]:
    """The test modules that declare batches of the gloo ranks (``@rank_batch``) or
    rings of them (``declare_rings``)."""
    here = Path(__file__).parent
    marks = ("@rank_batch(", "declare_rings(")  # the gloo ranks' pool, the rings' pool
    return {p.name for p in here.glob("test_*.py")
            if any(mark in p.read_text("utf-8") for mark in marks)}  # fmt: skip


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (``-n``) every test of the gloo ranks runs in one worker, so the
    ranks start once a world size (``rank_pool``), not once in each worker; every other
    test is a unit of its own, sent to whichever worker is free."""
    from xdist.scheduler import LoadScopeScheduling

    ranks = _rank_modules()

    class RanksTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
            return "the gloo ranks" if module in ranks else nodeid

    return RanksTogether(config, log)


@pytest.fixture(scope="session")
def rank_pool(request, tiny):
    """One start of the gloo ranks per world size for the distributed modules selected."""
    from rank_pool import RankPool

    selected = {item.module.__name__ for item in request.session.items if item.module}
    return RankPool(selected, tiny)


@pytest.fixture(scope="session")
def ring_pool(request):
    """One start of the context-parallel ring per size for the ring modules selected."""
    from ring_ranks import RingPool

    return RingPool({item.module.__name__ for item in request.session.items if item.module})


@pytest.fixture
def ranks_once(monkeypatch):
    """The same tasks on the same world run once in a test: a second ``attnctl ...
    --measure`` of them (its text after its JSON) gets the first start's replies, so the
    test checks the rendering of one measurement without starting the ranks again."""
    import pickle

    import attnctl.parallel.distributed as distributed

    started = distributed.run_ranks
    replies: dict[bytes, list] = {}

    def once(world, tasks, device="cpu", timeout=None):
        key = pickle.dumps((world, tasks, device))
        if key not in replies:
            replies[key] = started(world, tasks, device, timeout)
        return replies[key]

    monkeypatch.setattr(distributed, "run_ranks", once)
    return replies
