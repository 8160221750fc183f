"""Open every page of the built documentation site in headless Chromium and report broken pages.

    python spec/tools/check_site.py                 # build the site (mkdocs) into a scratch folder
    python spec/tools/check_site.py --site SITE     # check a site built already
    python spec/tools/check_site.py --shots DIR     # keep the screenshots in DIR

A page is broken when a link of it leads nowhere (a file of the site that does not exist, or
an #anchor the target page does not have), when it loads a script, stylesheet or image that is
not in the site (the site must read offline: nothing from another host), when Chromium logs a
console message on it (an uncaught JavaScript error, a failed script), or when its screenshot
is missing or blank. It lives with the other documentation tools (spec/tools/, outside the
site), not in benchmarks/: it measures nothing. tests/test_site_browser.py runs it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

REPO_DIR = Path(__file__).resolve().parents[2]
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
CONSOLE = re.compile(r":CONSOLE[:(]\d+\)?\] (.*)")
# a screenshot of a rendered page is tens of KiB; a blank one a few
BLANK_SCREENSHOT_BYTES = 12_000
SKIPPED_PAGES = {"404.html"}  # served by a web server for any missing URL, with absolute links


def find_browser() -> str | None:
    return next(filter(None, map(shutil.which, BROWSERS)), None)


class _Links(HTMLParser):
    """Ids of a page, its links (a href) and the resources it loads (script src, link href, img src)."""

    def __init__(self):
        super().__init__()
        self.ids, self.links, self.resources = set(), [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("href"):
            self.links.append(attrs["href"])
        elif tag in ("script", "img") and attrs.get("src"):
            self.resources.append(attrs["src"])
        elif tag == "link" and attrs.get("href"):
            self.resources.append(attrs["href"])


def _parse(page: Path) -> _Links:
    parser = _Links()
    parser.feed(page.read_text(encoding="utf-8"))
    return parser


def _target(site: Path, page: Path, url: str) -> tuple[Path | None, str]:
    """The site file ``url`` on ``page`` refers to (None for another host) and its #fragment."""
    parts = urlsplit(url)
    if parts.scheme or parts.netloc or url.startswith("//"):
        return None, ""
    if not parts.path:
        return page, unquote(parts.fragment)
    path = (site / parts.path.lstrip("/")) if parts.path.startswith("/") else (page.parent / unquote(parts.path))
    path = path.resolve()
    if path.is_dir():
        path = path / "index.html"
    return path, unquote(parts.fragment)


def link_problems(site: Path, pages: list[Path]) -> list[str]:
    parsed = {page: _parse(page) for page in pages}
    problems = []
    for page, found in parsed.items():
        name = page.relative_to(site)
        for url in found.resources:
            target, _ = _target(site, page, url)
            if target is None:
                problems.append(f"{name}: loads {url} from another host (the site must read offline)")
            elif not target.is_file():
                problems.append(f"{name}: loads {url}, which is not in the site")
        for url in found.links:
            target, fragment = _target(site, page, url)
            if target is None or url.startswith(("mailto:", "javascript:")):
                continue
            if not target.is_file():
                problems.append(f"{name}: links to {url}, which is not in the site")
            elif fragment and target.suffix == ".html":
                ids = parsed[target].ids if target in parsed else _parse(target).ids
                if fragment not in ids:
                    problems.append(f"{name}: links to {url}, but {target.name} has no #{fragment}")
    return problems


def browser_problems(browser: str, site: Path, pages: list[Path], shots: Path) -> list[str]:
    """Each page opened in headless Chromium: its console messages, and a screenshot that shows something."""
    problems = []
    shots.mkdir(parents=True, exist_ok=True)
    for page in pages:
        name = page.relative_to(site)
        shot = shots / (str(name).replace("/", "_").removesuffix(".html") + ".png")
        shot.unlink(missing_ok=True)
        proc = subprocess.run(
            [
                browser,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                "--no-first-run",
                "--window-size=1280,900",
                "--virtual-time-budget=2000",
                "--enable-logging=stderr",
                "--v=0",
                f"--screenshot={shot}",
                page.as_uri(),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        messages = [m.group(1) for m in map(CONSOLE.search, proc.stderr.splitlines()) if m]
        problems += [f"{name}: console: {message}" for message in messages]
        if not shot.is_file():
            problems.append(f"{name}: Chromium made no screenshot (exit {proc.returncode}): {proc.stderr[-500:]}")
        elif shot.stat().st_size < BLANK_SCREENSHOT_BYTES:
            problems.append(f"{name}: the screenshot is blank ({shot.stat().st_size} bytes)")
    return problems


def build_site(out: Path) -> None:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
        cwd=REPO_DIR,
        check=True,
        env=env,
    )


def site_pages(site: Path) -> list[Path]:
    return sorted(p for p in site.rglob("*.html") if str(p.relative_to(site)) not in SKIPPED_PAGES)


def check(site: Path, shots: Path, browser: str | None) -> list[str]:
    pages = site_pages(site)
    if not pages:
        return [f"{site}: no page"]
    problems = link_problems(site, pages)
    if browser is not None:
        problems += browser_problems(browser, site, pages, shots)
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", type=Path, help="a built site (default: build one)")
    parser.add_argument("--shots", type=Path, help="keep the screenshots here (default: a scratch folder)")
    args = parser.parse_args()
    browser = find_browser()
    if browser is None:
        print(f"no headless browser found ({', '.join(BROWSERS)}); Debian: apt-get install chromium", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="leanimg-site-") as scratch:
        site = args.site or Path(scratch) / "site"
        if args.site is None:
            build_site(site)
        shots = args.shots or Path(scratch) / "shots"
        problems = check(site.resolve(), shots, browser)
        pages = len(site_pages(site))
    for problem in problems:
        print(problem)
    print(
        f"{pages} pages checked in {browser}: {len(problems)} problem(s)"
        + (f"; screenshots in {args.shots}" if args.shots else "")
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
