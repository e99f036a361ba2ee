"""`memory --measure --tp 2` against one device's `memory --measure`, side by side.

    python benchmarks/distributed.py [--lengths 256,1024] [--tp 2] [--cp C] [--train]

For d_model 512, 8 heads, a causal mask and the bundled tokenizer's vocabulary, at each
length it measures block 0 on one device (``measure.measure_forward``, in this process)
and split over T gloo processes (``distributed.measure_split``: the ranks started,
torch imported in each, the group joined, each rank measured), with and without
sequence parallelism, and prints the wall times, their ratio and where a rank's time
goes. ``--train``: a training step instead (``measure.measure_training`` on one device,
``measure_split(..., train=True)`` split: each rank's step on gloo, its collectives'
gradients too). ``--cp C``: context parallelism too (``--tp 1 --cp C``: the ring alone;
with ``--train`` ring attention's own backward). Target: every rank's measured peak
equal to its estimate, to the byte.
"""

from __future__ import annotations

import argparse
import sys
import time

from attnctl.memory.estimate import estimate, format_bytes
from attnctl.memory.measure import measure_forward, measure_training
from attnctl.model.config import build_config, resolve_impl, validate
from attnctl.model.layout import Layout
from attnctl.parallel.distributed import measure_split
from attnctl.parallel.launch import threads_per_rank
from attnctl.parallel.run_split import collective_buffers
from attnctl.replay.step import estimate_training
from attnctl.stages.plan import build_plan
from attnctl.text.tokenize import vocab_size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="256,1024")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--cp", type=int, default=1, help="context-parallel ranks besides")
    parser.add_argument("--train", action="store_true", help="a training step, not a forward")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    vocab = vocab_size("bundled", 1)
    config = resolve_impl(validate(build_config(mask="causal", device="cpu")))
    world = args.tp * args.cp
    print(f"d_model {config.d_model}, {config.heads} heads, causal, {config.impl}, vocab {vocab}; "
          f"{world} ranks of {threads_per_rank(world)} thread(s)")  # fmt: skip
    print(f"{'L':>5} {'layout':<10} {'seconds':>8} {'ratio':>6} {'peak (rank 0)':>14} "
          f"{'exact':>6}  rank 0: import / join / work")  # fmt: skip
    exact = True
    measure_forward(build_plan(config, 16, 1, vocab))  # warm: the first call's imports
    for length in lengths:
        start = time.perf_counter()
        plan = build_plan(config, length, 1, vocab)
        if args.train:
            one = measure_training(config, plan)
            predicted = estimate_training(plan).peak_bytes
        else:
            one, predicted = measure_forward(plan), estimate(plan).peak_bytes
        single = time.perf_counter() - start
        equal = one.peak_bytes == predicted
        print(f"{length:>5} {'one device':<10} {single:>8.2f} {1:>6.1f} "
              f"{format_bytes(one.peak_bytes):>14} {equal!s:>6}", flush=True)  # fmt: skip
        layouts = [Layout(tp=args.tp, sp=sp, cp=args.cp) for sp in (False, True)]
        for layout in layouts if args.tp > 1 else layouts[:1]:
            start = time.perf_counter()
            ranks = measure_split(config, length, 1, vocab, layout, train=args.train)
            split = time.perf_counter() - start
            equal = all(r.measured_peak_bytes == r.peak_bytes for r in ranks)
            exact = exact and equal
            t = ranks[0].timings
            print(f"{length:>5} {layout.summary():<10} {split:>8.2f} {split / single:>6.1f} "
                  f"{format_bytes(ranks[0].measured_peak_bytes):>14} {equal!s:>6}  "
                  f"{t['import_seconds']:.2f} / {t['join_seconds']:.2f} / "
                  f"{t['work_seconds']:.2f} s; resident peak "
                  f"{format_bytes(ranks[0].resident_peak_bytes or 0)}", flush=True)  # fmt: skip
    if sys.platform.startswith("linux"):  # gloo's own buffers, which no rank's count sees
        for mebibytes in (32, 128):
            found = collective_buffers(max(args.tp, 2), mebibytes)[0]["buffers"]
            print(f"gloo's buffers inside a collective of a {mebibytes} MiB (B, L, D), rank 0: "
                  + ", ".join(f"{k} {format_bytes(v)}" for k, v in found.items()))  # fmt: skip
    print(f"every rank equal to its estimate: {'PASS' if exact else 'FAIL'}")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
