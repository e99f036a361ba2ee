"""Refresh the example output in README.md and docs/*.md from the real commands.

    python scripts/update_readme.py           # rewrite the blocks
    python scripts/update_readme.py --check   # exit 1 if any block is out of date

Each example is a ```text block whose first line is "$ attnctl ..."; every such block in
README.md and docs/*.md must be listed in EXAMPLES below, and every entry must have a block.
The command runs in-process at the width given, without colour; some blocks show an excerpt,
with a line "⋮" where output is left out.
The --model examples read the folders scripts/make_example_models.py writes into models/.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"

# command -> (columns, excerpt's first line prefix, its last line: a substring, or
# "<prefix" to stop before the line starting with prefix; None for the whole output).
# Every number shown must be the same on any CPU, thread count and free memory: weights
# rounded where float noise cannot reach (see docs/run.md), bytes, counts.
EXAMPLES = {
    "attnctl run 猫吃鱼 --config cat-eats-fish --head 0 --digits 4 --device cpu": (
        100, "attention weights", "<heads at a glance"),
    "attnctl run 猫吃鱼 --config cat-eats-fish --digits 4 --device cpu": (
        100, "attention weights", "<memory"),
    'attnctl run "Are you OK?" --head 0 --device cpu': (100, None, None),
    'attnctl run "Are you OK?" --heads 8 --device cpu': (100, None, None),
    "attnctl run --file scripts/corpus/en.txt --head 0 --rows last:6 --device cpu": (
        100, "attention weights", "strongest keys"),
    'attnctl run "the cat eats the fish" --mask causal --head 0 --view heatmap --device cpu': (
        80, "attention heatmaps", None),
    'attnctl run "the cat eats the fish" --model models/gpt2-tiny --layer all --head 0 --head 1 '
    "--view heatmap --device cpu": (80, "attention heatmaps", "<block 1"),
    'attnctl run "Are you OK?" --model models/gpt2-tiny --generate 5 --head 0 --view heatmap '
    "--device cpu": (80, "attention heatmaps", "a query row"),
    'attnctl run "Are you OK?" --model models/marian-tiny --generate 6 --head 0 --view heatmap '
    "--device cpu": (80, "encoder self-attention heatmaps", "a query row"),
    "attnctl shapes --device cpu": (100, None, None),
    "attnctl check --device cpu": (80, None, None),
    "attnctl memory --seq-len 2048": (100, None, None),
    "attnctl memory --seq-len 1024 --measure --device cpu": (80, "activations", "vs measured"),
    "attnctl memory --seq-len 512,2048,8192 --budget 16GiB": (80, None, None),
    "attnctl memory --layers 6 --pp 3 --tp 2 --sp --dp 4 --zero 1 --train --dtype bfloat16 "
    "--batch 8 --micro-batch 2 --seq-len 1024": (100, None, None),
    "attnctl memory --seq-len 2048 --train --dtype bfloat16 --measure --device cpu": (
        80, "training step", "vs measured"),
    'attnctl run "the cat eats the fish, the cat eats" --model models/gpt2-tiny --layer 2 '
    "--head 0 --device cpu": (100, None, "<memory"),
    'attnctl run "the cat eats the fish, the cat eats" --model models/gpt2-tiny --layer all '
    "--device cpu": (100, "every block", "weights and stages of one block"),
    'attnctl run "Are you OK?" --model models/gpt2-tiny --generate 5 --device cpu': (
        100, None, "<attention weights of the final"),
    'attnctl run "Are you OK?" --model models/marian-tiny --generate 6 --device cpu': (
        100, "steps", "→"),
    "attnctl run 猫吃鱼 --model models/marian-tiny --generate 6 --device cpu": (
        100, "alignment", "→"),
    "attnctl memory --model models/marian-tiny --src-len 48 --tgt-len 32 --measure --device cpu": (
        100, "weights", "<encoder block 0"),
    "attnctl memory --model models/llama-2-7b --seq-len 4096": (100, "one attention matrix", None),
    "attnctl memory --seq-len 2048 --kv-heads 2 --impl sdpa --gpu h200 --torch 2.11": (
        80, "GPU", "<parameters"),
    "attnctl memory --seq-len 2048 --impl sdpa --dtype bfloat16 --gpu h200 --torch 2.11": (
        80, "on the GPU", "<by dtype"),
    "attnctl memory --impl math --dtype float32 --fit --gpu h200 --torch 2.11": (
        80, "one forward pass fits", None),
    "attnctl memory --model models/gemma-3-1b --seq-len 32768": (100, "peak", "<by dtype"),
}  # fmt: skip

BLOCK = re.compile(r"^```text\n\$ (attnctl[^\n]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def pages() -> list[Path]:
    """README.md and every docs page, in a fixed order."""
    return [README, *sorted(DOCS.glob("*.md"))]


def prepare_models() -> None:
    """The folders the --model examples read: models/ is not committed, so write them
    each time from tests/tiny_models.py, as a newcomer's fresh clone does."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_example_models import write_example_models

    write_example_models(ROOT / "models")


def output_of(command: str, columns: int) -> str:
    from typer.testing import CliRunner

    from attnctl.cli import app

    env = {"COLUMNS": str(columns), "NO_COLOR": "1", "TERM": "dumb"}
    result = CliRunner().invoke(app, shlex.split(command)[1:], env=env)
    if result.exit_code != 0:
        raise SystemExit(f"{command!r} failed: {result.output}")
    return "\n".join(line.rstrip() for line in result.stdout.rstrip("\n").splitlines())


CUT = "⋮"  # a line of its own where an excerpt leaves output out (before or after it)


# What float noise does reach, and is compared only by its shape: `check`'s bounds on the
# differences between implementations (a power of ten above the largest difference, which
# another CPU's kernels move by a power or so). The pages show this machine's.
NOISE = re.compile(r"< 1e[-+]\d\d")


def _unnoised(text: str) -> str:
    return NOISE.sub("< 1e…", text)


def excerpt(text: str, first: str | None, last: str | None) -> str:
    """The lines from the one starting with FIRST to LAST, marked where output is cut."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first)) if first else 0
    end = len(lines) - 1
    if last and last.startswith("<"):  # stop before the line that starts so
        end = next(i for i in range(start, len(lines)) if lines[i].startswith(last[1:])) - 1
    elif last:  # stop at the line that contains it
        end = next(i for i in range(start, len(lines)) if last in lines[i])
    shown = lines[start : end + 1]
    while shown and not shown[-1].strip():
        shown.pop()
    return "\n".join([CUT] * (start > 0) + shown + [CUT] * (end < len(lines) - 1))


def refreshed(text: str, page: str, outputs: dict[str, str], stale: list[str] | None = None) -> str:
    """TEXT with every example block's body replaced by the command's real output; the
    commands whose block changed are appended to STALE."""

    def body(match: re.Match[str]) -> str:
        command = match.group(1)
        if command not in EXAMPLES:
            raise SystemExit(f"{page}: example {command!r} is not listed in EXAMPLES")
        if command not in outputs:
            columns, first, last = EXAMPLES[command]
            outputs[command] = excerpt(output_of(command, columns), first, last)
        if stale is not None and _unnoised(match.group(2)) != _unnoised(outputs[command] + "\n"):
            stale.append(f"{page}: $ {command}")
        return f"```text\n$ {command}\n{outputs[command]}\n```"

    return BLOCK.sub(body, text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    os.chdir(ROOT)  # examples name files relative to the repository
    prepare_models()
    outputs: dict[str, str] = {}
    unused = sorted(set(EXAMPLES) - {m.group(1) for p in pages() for m in BLOCK.finditer(
        p.read_text(encoding="utf-8"))})  # fmt: skip
    if unused:
        raise SystemExit(f"no example block for {unused!r} in README.md or docs/")
    stale: list[str] = []
    for path in pages():
        name = path.relative_to(ROOT).as_posix()
        current = path.read_text(encoding="utf-8")
        new = refreshed(current, name, outputs, stale)
        if new != current and not args.check:
            path.write_text(new, encoding="utf-8")
    if args.check:
        print("\n".join(["examples are stale:", *stale]) if stale else "examples are current")
        return 1 if stale else 0
    print("\n".join(["examples refreshed:", *stale]) if stale else "examples were current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
