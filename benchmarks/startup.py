"""Start-up time of attnctl commands that must not import torch, against `import torch`
and against `import typer, rich` (what any Typer command with rich output loads).

    python benchmarks/startup.py [--rounds 15]

Whole processes, interleaved round by round so machine noise hits every command alike;
reports the median wall time of each and its ratio to `python -c "import torch"`.
Bytecode caching is on, as on a user's machine (pip compiles an installed package's
modules; torch's are), even where PYTHONDONTWRITEBYTECODE is set: without it every run
would compile attnctl from source, and only attnctl. Targets (issue 25): every command
at most 0.12x `import torch` and at most 2x `import typer, rich`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

PY = sys.executable
COMMANDS = {
    "import torch": [PY, "-c", "import torch"],
    "import typer, rich": [PY, "-c", "import typer, rich.console, rich.table"],
    "attnctl --help": [PY, "-m", "attnctl", "--help"],
    "attnctl shapes": [PY, "-m", "attnctl", "shapes"],
    "attnctl memory": [PY, "-m", "attnctl", "memory", "--seq-len", "2048"],
}
TARGET = 0.12  # of import torch
TARGET_TYPER = 2.0  # of import typer, rich


ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def time_once(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(
        command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV
    )
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    for command in COMMANDS.values():  # warm the file cache and write the bytecode once
        time_once(command)
    samples: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.rounds):
        for name, command in COMMANDS.items():
            samples[name].append(time_once(command))
    baseline = statistics.median(samples["import torch"])
    typer_rich = statistics.median(samples["import typer, rich"])
    print(f"{'command':<20} {'median':>9} {'/torch':>7} {'/typer+rich':>12}")
    print(f"{'targets':<20} {'':>9} {TARGET:>7.2f} {TARGET_TYPER:>12.1f}")
    worst = worst_typer = 0.0
    for name, times in samples.items():
        median = statistics.median(times)
        ratio, ratio_typer = median / baseline, median / typer_rich
        if name.startswith("attnctl"):
            worst, worst_typer = max(worst, ratio), max(worst_typer, ratio_typer)
        print(f"{name:<20} {median * 1000:7.0f}ms {ratio:7.3f} {ratio_typer:12.2f}")
    passed = worst <= TARGET and worst_typer <= TARGET_TYPER
    print(
        f"worst: {worst:.3f}x import torch, {worst_typer:.2f}x import typer, rich: "
        f"{'PASS' if passed else 'FAIL'}"
    )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
