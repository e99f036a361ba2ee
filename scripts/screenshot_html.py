"""Make docs/images/html-report.png: a real `attnctl run … --html` page, shot in Chromium.

    python scripts/screenshot_html.py            # docs/images/html-report.png
    python scripts/screenshot_html.py OUT.png    # elsewhere

It runs `attnctl run "The cat sat on the mat because it was tired." --mask causal --device
cpu --html …` (the seeded layer: no model folder needed), opens the page in Debian's
Chromium through Playwright (a test extra; it never downloads a browser) with every request
but the file refused, pins query row "it" in the head view and saves the top of the page.
The browser: $ATTNCTL_CHROMIUM, else `chromium` on PATH (apt-get install chromium).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "docs" / "images" / "html-report.png"
TEXT = "The cat sat on the mat because it was tired."
RUN = ("run", TEXT, "--mask", "causal", "--device", "cpu")
LAUNCH_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--font-render-hinting=none",
]
WIDTH, HEIGHT = 1280, 1010  # the viewport; the picture is its top HEIGHT pixels


def write_page(path: Path) -> None:
    command = [sys.executable, "-m", "attnctl", *RUN, "--html", str(path)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"screenshot_html: attnctl failed: {done.stderr.strip()}")


def shoot(page_path: Path, out: Path) -> None:
    from playwright.sync_api import sync_playwright

    browser_path = os.environ.get("ATTNCTL_CHROMIUM") or shutil.which("chromium")
    if browser_path is None:
        raise SystemExit("screenshot_html: needs Chromium: apt-get install chromium")
    url = page_path.resolve().as_uri()
    problems: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=browser_path, args=LAUNCH_ARGS)
        context = browser.new_context(viewport={"width": WIDTH, "height": HEIGHT})
        context.route(
            "**/*", lambda route: route.continue_() if route.request.url == url else route.abort()
        )
        page = context.new_page()
        page.on("pageerror", lambda error: problems.append(str(error)))
        page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
        page.goto(url)
        page.wait_for_selector("html[data-ready='1']", state="attached")
        # pin the query row of "it": its lines alone, the keys shaded by their weight
        page.click('#head-view g.token-slot[data-side="query"][data-pos="8"]')
        page.mouse.move(WIDTH - 5, HEIGHT - 5)
        out.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(out), clip={"x": 0, "y": 0, "width": WIDTH, "height": HEIGHT})
        browser.close()
    if problems:
        raise SystemExit(f"screenshot_html: the page reported: {problems[0]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, default=DEFAULT_OUT)
    out = parser.parse_args().out
    with tempfile.TemporaryDirectory() as folder:
        page = Path(folder) / "report.html"
        write_page(page)
        shoot(page, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
