"""How far `attnctl memory` is from measured bytes: inference and training, math and sdpa.

    python benchmarks/memory_accuracy.py [--lengths 128,512,1024,2048,4096]

For d_model 512, 8 heads, the bundled tokenizer's vocabulary and a causal mask, at each
length it runs one forward pass (--measure) and one training step (--measure --train)
on the CPU and prints the estimate, the measurement and the error. Target (issue 4):
every error within 2 %.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

from attnctl.memory.estimate import estimate
from attnctl.memory.measure import measure_forward, measure_training
from attnctl.model.config import build_config
from attnctl.replay.step import estimate_training
from attnctl.stages.plan import build_plan
from attnctl.text.tokenize import vocab_size

TARGET = 2.0  # percent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="128,512,1024,2048,4096")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    vocab = vocab_size("bundled", 1)
    print(f"{'mode':<9} {'impl':<5} {'dtype':<9} {'L':>5} {'estimate':>14} {'measured':>14} "
          f"{'error':>8}")  # fmt: skip
    worst = 0.0
    start = time.perf_counter()
    for mode, impl, dtype, length in itertools.product(
        ("forward", "train"), ("math", "sdpa"), ("float32", "bfloat16"), lengths
    ):
        config = build_config(impl=impl, dtype=dtype, mask="causal", device="cpu")
        plan = build_plan(config, length, 1, vocab)
        if mode == "train":
            predicted = estimate_training(plan).peak_bytes
            measured = measure_training(config, plan).peak_bytes
        else:
            predicted = estimate(plan).peak_bytes
            measured = measure_forward(plan).peak_bytes
        error = (predicted - measured) / measured * 100
        worst = max(worst, abs(error))
        print(f"{mode:<9} {impl:<5} {dtype:<9} {length:>5} {predicted:>14,} {measured:>14,} "
              f"{error:>+7.3f}%", flush=True)  # fmt: skip
    ok = worst <= TARGET
    print(f"worst error {worst:.3f}% (target <= {TARGET}%): {'PASS' if ok else 'FAIL'} "
          f"in {time.perf_counter() - start:.0f} s")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
