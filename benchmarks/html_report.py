"""`run --file --html` on a long text: the page's size, time beside `--json`, opening in Chromium.

    python benchmarks/html_report.py [--tokens 8192] [--rounds 3]

Builds a text of about that many tokens (bundled tokenizer, the repository's corpus, as
long_input.py does), then times whole processes interleaved round by round: `run --file
--html` against `run --file --json` (the same computed rows and every head, written as
text). Then opens the page in Debian's Chromium (Playwright, network blocked) and times it
from navigation until its scripts have drawn the head view. Targets (issue 13): the page at
most 5 MiB, open in at most 3 s, and `--html` at most 1.15x the time and peak RSS of `--json`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from long_input import long_text

TARGET = 1.15
MAX_BYTES = 5 * 2**20
MAX_OPEN_SECONDS = 3.0
READY = "document.documentElement.dataset.ready === '1'"  # the page's scripts have drawn it
BROWSER_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]  # fmt: skip


def timed(command: list[str], stdout_path: Path | None = None) -> tuple[float, int]:
    """Wall seconds and peak RSS bytes of one whole process."""
    env = {**os.environ, "COLUMNS": "120"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    with open(stdout_path or os.devnull, "wb") as out:
        start = time.perf_counter()
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.PIPE, env=env)
        _, status, usage = os.wait4(process.pid, 0)
        elapsed = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"failed: {' '.join(command)}\n{process.stderr.read().decode()}")
    return elapsed, usage.ru_maxrss * 1024


def open_seconds(page_path: Path) -> float:
    """Seconds from navigation to the page's scripts having run, network blocked."""
    from playwright.sync_api import sync_playwright

    browser_path = os.environ.get("ATTNCTL_CHROMIUM") or shutil.which("chromium")
    if browser_path is None:
        raise SystemExit("needs Chromium: apt-get install chromium")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=browser_path, args=BROWSER_ARGS)
        page = browser.new_page()
        page.route("**/*", lambda route: route.continue_()
                   if route.request.url == page_path.as_uri() else route.abort())  # fmt: skip
        samples = []
        for _ in range(3):
            start = time.perf_counter()
            page.goto(page_path.as_uri(), wait_until="load")
            page.wait_for_function(READY)
            samples.append(time.perf_counter() - start)
        browser.close()
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    text, count = long_text(args.tokens)
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "long.txt"
        source.write_text(text, encoding="utf-8")
        page = Path(folder) / "report.html"
        document = Path(folder) / "report.json"
        base = [sys.executable, "-m", "attnctl", "run", "--file", str(source), "--device", "cpu"]
        samples: dict[str, list[tuple[float, int]]] = {"--html": [], "--json": []}
        for _ in range(args.rounds):
            samples["--html"].append(timed([*base, "--html", str(page)]))
            samples["--json"].append(timed([*base, "--json"], document))
        size, json_size = page.stat().st_size, document.stat().st_size
        seconds = open_seconds(page)
    medians = {
        name: (statistics.median(t for t, _ in v), statistics.median(r for _, r in v))
        for name, v in samples.items()
    }
    time_ratio = medians["--html"][0] / medians["--json"][0]
    rss_ratio = medians["--html"][1] / medians["--json"][1]
    print(f"{count} tokens, 8 heads, default rows, {args.rounds} interleaved rounds (medians)")
    for name, (wall, rss) in medians.items():
        print(f"run --file {name:<7} {wall:6.2f}s {rss / 2**20:7.0f}MiB")
    print(f"page {size / 2**20:.2f} MiB (the --json document: {json_size / 2**20:.2f} MiB); "
          f"opens in {seconds:.2f}s in Chromium")  # fmt: skip
    ok = (time_ratio <= TARGET and rss_ratio <= TARGET and size <= MAX_BYTES
          and seconds <= MAX_OPEN_SECONDS)  # fmt: skip
    verdict = "PASS" if ok else "FAIL"
    print(f"--html vs --json: time {time_ratio:.2f}x, peak RSS {rss_ratio:.2f}x (target <= "
          f"{TARGET}); page <= 5 MiB, open <= {MAX_OPEN_SECONDS:.0f}s: {verdict}")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
