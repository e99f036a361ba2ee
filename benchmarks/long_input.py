"""`attnctl run --file` on a long text against a plain script running the same layer with SDPA.

    python benchmarks/long_input.py [--tokens 8192 10016] [--rounds 3]

For each length, builds a text of about that many tokens (bundled tokenizer) from the
repository's corpus, then times whole processes, interleaved round by round: wall time
and peak RSS (from os.wait4) of each. Both import torch and tokenizers, tokenize the same
file and run an embedding + sinusoidal positions + 8-head attention (d_model 512) +
residual + LayerNorm layer with F.scaled_dot_product_attention. For context it also runs
the textbook math path, which builds the (1, 8, L, L) weights. Target (issue 10):
attnctl <= 1.15x the plain SDPA script in both time and peak RSS, at every length.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "attnctl" / "data" / "tokenizer.json"
TARGET = 1.15
LENGTHS = (8192, 10016)  # about 8k and 10k tokens

PLAIN_LAYER = r"""
import math, sys
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

tokenizer = Tokenizer.from_file(sys.argv[1])
ids = tokenizer.encode(open(sys.argv[2], encoding="utf-8").read()).ids
textbook = sys.argv[3] == "math"
d_model, heads = 512, 8
d_k = d_model // heads
torch.manual_seed(42)
embedding = torch.nn.Embedding(tokenizer.get_vocab_size(), d_model)
w_q, w_k, w_v, w_o = (torch.nn.Linear(d_model, d_model) for _ in range(4))
norm = torch.nn.LayerNorm(d_model)
with torch.inference_mode():
    token_ids = torch.tensor([ids])
    seq_len = token_ids.shape[1]
    position = torch.arange(seq_len).unsqueeze(1)
    frequency = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
    table = torch.zeros(seq_len, d_model)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency)
    x = embedding(token_ids) + table
    q, k, v = (w(x).view(1, seq_len, heads, d_k).transpose(1, 2) for w in (w_q, w_k, w_v))
    if textbook:
        weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d_k), dim=-1)
        attended = weights @ v
    else:
        attended = F.scaled_dot_product_attention(q, k, v)
    out = norm(x + w_o(attended.transpose(1, 2).reshape(1, seq_len, d_model)))
print(tuple(out.shape))
"""


def long_text(tokens: int) -> tuple[str, int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    corpus = "\n".join(
        p.read_text(encoding="utf-8") for p in sorted(ROOT.glob("scripts/corpus/*.txt"))
    )
    text = corpus
    while len(tokenizer.encode(text).ids) < tokens:
        text += "\n" + corpus
    words = text.split(" ")
    low, high = 1, len(words)  # the shortest prefix of words with >= tokens tokens
    while low < high:
        middle = (low + high) // 2
        if len(tokenizer.encode(" ".join(words[:middle])).ids) >= tokens:
            high = middle
        else:
            low = middle + 1
    text = " ".join(words[:low])
    return text, len(tokenizer.encode(text).ids)


def run(command: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS bytes of one whole process."""
    # bytecode caching on, as on a user's machine (see startup.py)
    env = {**os.environ, "COLUMNS": "120"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(process.pid, 0)
    elapsed = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"failed: {' '.join(command)}\n{process.stderr.read().decode()}")
    return elapsed, usage.ru_maxrss * 1024  # ru_maxrss is in KiB on Linux


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    failed = 0
    for tokens in args.tokens:
        failed |= one_length(tokens, args.rounds)
    return failed


def one_length(tokens: int, rounds: int) -> int:
    """Time the three commands, interleaved, on a text of about ``tokens`` tokens."""
    text, count = long_text(tokens)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "long.txt"
        path.write_text(text, encoding="utf-8")
        script = Path(folder) / "plain_layer.py"
        script.write_text(PLAIN_LAYER, encoding="utf-8")
        commands = {
            "attnctl run --file": [sys.executable, "-m", "attnctl", "run", "--file", str(path),
                                   "--device", "cpu"],
            "plain script, sdpa": [sys.executable, str(script), str(TOKENIZER), str(path), "sdpa"],
            "plain script, math": [sys.executable, str(script), str(TOKENIZER), str(path), "math"],
        }  # fmt: skip
        samples: dict[str, list[tuple[float, int]]] = {name: [] for name in commands}
        for _ in range(rounds):
            for name, command in commands.items():
                samples[name].append(run(command))
    print(f"{count} tokens, d_model 512, 8 heads, {rounds} interleaved rounds (medians)")
    return report(samples, "attnctl run --file", "plain script, sdpa")


def report(samples: dict[str, list[tuple[float, int]]], subject: str, baseline: str) -> int:
    """Print each command's median time and peak RSS with their ratios to ``baseline``;
    0 when ``subject`` meets TARGET in both, else 1."""
    base_time = statistics.median(t for t, _ in samples[baseline])
    base_rss = statistics.median(r for _, r in samples[baseline])
    print(f"{'command':<20} {'time':>8} {'ratio':>6} {'peak RSS':>10} {'ratio':>6}")
    ratios = {}
    for name, values in samples.items():
        seconds = statistics.median(t for t, _ in values)
        rss = statistics.median(r for _, r in values)
        ratios[name] = (seconds / base_time, rss / base_rss)
        print(f"{name:<20} {seconds:7.2f}s {ratios[name][0]:6.2f} {rss / 2**20:8.0f}MiB "
              f"{ratios[name][1]:6.2f}")  # fmt: skip
    time_ratio, rss_ratio = ratios[subject]
    ok = time_ratio <= TARGET and rss_ratio <= TARGET
    print(f"{subject} vs {baseline}: time {time_ratio:.2f}x, peak RSS {rss_ratio:.2f}x "
          f"(target <= {TARGET}): {'PASS' if ok else 'FAIL'}")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
