from __future__ import annotations

from pathlib import Path

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
