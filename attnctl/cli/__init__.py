"""The command line: the only package that prints or exits.

- ``application``: the Typer app; every error becomes one line on stderr and its exit
  code (2 for usage, 1 for run-time failures); ``--debug`` adds the traceback
- ``commands``: ``run``, ``shapes``, ``memory``, ``check``, ``tokenizer``
- ``options``: the options commands share
- ``output``: which report goes to which view (terminal, JSON, heatmap)
"""

from __future__ import annotations

from attnctl.cli.commands import app

__all__ = ["app", "main"]


def main() -> None:
    app()
