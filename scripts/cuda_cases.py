"""Write tests/data/cuda_h200_torch2.11.jsonl: the H200 recordings as test cases.

    python scripts/cuda_cases.py           # rewrite the file
    python scripts/cuda_cases.py --check   # exit 1 if it is out of date

One line per recorded ``attnctl memory ARGS --measure --json --device cuda`` that ran:
its id, where it was recorded, ARGS (checkpoint folders as ``CKPT/name``), and what the
H200 measured: the peak (a training step's for ``--train``), each stage's live bytes
where the document has them, and an encoder–decoder's peaks and caches. Sources:
``benchmarks/results/h200-torch2.11-reference/`` (the 56 public cases, as issue 26 gave
them) and ``benchmarks/results/h200-torch2.11-20261204/`` (86 more, recorded by
``benchmarks/cuda_memory.py``). tests/test_cuda_plan.py plans each for ``--gpu h200
--torch 2.11`` and compares.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SOURCES = (
    ("reference", RESULTS / "h200-torch2.11-reference" / "h200-torch2.11-memory.jsonl"),
    ("20261204", RESULTS / "h200-torch2.11-20261204" / "memory.jsonl"),
)
OUT = ROOT / "tests" / "data" / "cuda_h200_torch2.11.jsonl"
SEQ2SEQ_KEYS = ("encoder_peak_activation_bytes", "decoder_peak_activation_bytes",
                "kv_cache_bytes", "cross_kv_cache_bytes")  # fmt: skip


def cases() -> list[dict]:
    out = []
    for source, path in SOURCES:
        for number, line in enumerate(path.read_text("utf-8").splitlines()):
            row = json.loads(line)
            if row.get("exit_code", 0) != 0 or not row.get("document"):
                continue
            args = [re.sub(r"^/tmp/[^/]+/checkpoints/", "CKPT/", a) for a in row["args"]]
            args = [a for a in args if a != "--measure"]
            case = {"id": row.get("id", f"p{number:02d}"), "source": source, "args": args}
            document = row["document"]
            if document.get("kind") == "encoder-decoder":
                measured = {c["what"]: c["measured"] for c in row["comparisons"]}
                case["seq2seq"] = {key: measured[key] for key in SEQ2SEQ_KEYS}
            else:
                case["peak_bytes"] = row["measured_peak_bytes"]
                result = document["results"][0]
                if "--train" not in args:
                    stages = result["stages"]
                    case["stages"] = [[s["name"], s["measured_live_bytes"]] for s in stages]
            out.append(case)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    text = "".join(json.dumps(case, separators=(",", ":")) + "\n" for case in cases())
    if parser.parse_args().check:
        same = OUT.is_file() and OUT.read_text("utf-8") == text
        print("up to date" if same else f"out of date: python {Path(__file__).name}")
        return 0 if same else 1
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text, "utf-8")
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
