"""Run every benchmark in turn: python benchmarks/run_all.py (exit 1 if any misses its target)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = [
    "startup.py",
    "long_input.py",
    "memory_accuracy.py",
    "pretrained.py",
    "generate.py",
    "html_report.py",
    "distributed.py",
]


def main() -> int:
    failed = []
    for script in SCRIPTS:
        print(f"==> {script}", flush=True)
        if subprocess.run([sys.executable, str(HERE / script)]).returncode != 0:
            failed.append(script)
    print("all targets met" if not failed else f"missed targets: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
