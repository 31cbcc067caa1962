"""Screenshot of an HTML report for the README: `make screenshot` (Chromium via Playwright).

Usage: python docs/screenshot.py REPORT.html OUT.png
"""

from __future__ import annotations

import sys
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    from playwright.sync_api import sync_playwright

    page_path, out = Path(argv[0]).resolve(), Path(argv[1])
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1200, "height": 1480})
        # the page is self-contained: anything it would fetch is refused
        page.route("**/*", lambda r: r.continue_() if r.request.url.startswith("file://")
                   else r.abort())
        page.goto(page_path.as_uri())
        page.wait_for_selector("body[data-rendered]", timeout=60_000)
        page.screenshot(path=str(out))
        browser.close()
    print(f"{out}: screenshot of {page_path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
