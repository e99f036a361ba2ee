"""Start-up time of attnctl commands that must not import torch, against `import torch`.

    python benchmarks/startup.py [--rounds 15]

Whole processes, interleaved round by round so machine noise hits every command alike;
reports the median wall time of each and its ratio to `python -c "import torch"`.
Bytecode caching is on, as on a user's machine (pip compiles an installed package's
modules; torch's are), even where PYTHONDONTWRITEBYTECODE is set: without it every run
would compile attnctl from source, and only attnctl. Target (issue 4): every ratio <= 0.15.
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
    "attnctl --help": [PY, "-m", "attnctl", "--help"],
    "attnctl shapes": [PY, "-m", "attnctl", "shapes"],
    "attnctl memory": [PY, "-m", "attnctl", "memory", "--seq-len", "2048"],
}
TARGET = 0.15


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
    print(f"{'command':<18} {'median':>9} {'ratio':>7}  (target <= {TARGET})")
    worst = 0.0
    for name, times in samples.items():
        median = statistics.median(times)
        ratio = median / baseline
        if name != "import torch":
            worst = max(worst, ratio)
        print(f"{name:<18} {median * 1000:7.0f}ms {ratio:7.3f}")
    print(f"worst ratio {worst:.3f}: {'PASS' if worst <= TARGET else 'FAIL'}")
    return 0 if worst <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
