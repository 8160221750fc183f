"""The built documentation site opened page by page in headless Chromium (spec/tools/check_site.py):
no broken link or anchor, nothing loaded from another host, no console message, no blank page.
Skipped only where no Chromium is installed (.ci/install installs Debian's)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "spec" / "tools"))
import check_site  # noqa: E402

BROWSER = check_site.find_browser()
needs_browser = pytest.mark.skipif(BROWSER is None, reason="no Chromium installed (Debian: apt-get install chromium)")


def test_the_link_check_finds_what_is_broken(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "index.html").write_text(
        '<h1 id="top">x</h1><a href="sub/page.html#here">ok</a><a href="gone.html">gone</a>'
        '<a href="sub/page.html#nowhere">anchor</a><a href="https://kaitai.io/">elsewhere, fine</a>'
        '<script src="https://cdn.example/x.js"></script><link rel="stylesheet" href="missing.css">'
    )
    (tmp_path / "sub" / "page.html").write_text('<p id="here">y</p><a href="../index.html#top">back</a>')
    problems = check_site.link_problems(tmp_path, check_site.site_pages(tmp_path))
    assert sorted(problems) == sorted(
        [
            "index.html: links to gone.html, which is not in the site",
            "index.html: links to sub/page.html#nowhere, but page.html has no #nowhere",
            "index.html: loads https://cdn.example/x.js from another host (the site must read offline)",
            "index.html: loads missing.css, which is not in the site",
        ]
    )


@needs_browser
def test_chromium_reports_a_javascript_error_and_a_blank_page(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "error.html").write_text("<h1>" + "text " * 400 + "</h1><script>throw new Error('boom')</script>")
    (site / "blank.html").write_text("<html><body></body></html>")
    problems = check_site.browser_problems(BROWSER, site, check_site.site_pages(site), tmp_path / "shots")
    assert 'error.html: console: "Uncaught Error: boom"' in [p.split(", source:")[0] for p in problems]
    assert any(p.startswith("blank.html: the screenshot is blank") for p in problems)
    assert (tmp_path / "shots" / "error.png").stat().st_size > check_site.BLANK_SCREENSHOT_BYTES


@needs_browser
def test_every_page_of_the_site_opens_in_chromium(tmp_path):
    site = tmp_path / "site"
    check_site.build_site(site)
    pages = check_site.site_pages(site)
    assert {"index.html", "tutorial.html", "reference/cli.html", "guides/json.html", "ksy.html"} <= {
        str(p.relative_to(site)) for p in pages
    }
    problems = check_site.check(site, tmp_path / "shots", BROWSER)
    assert problems == []
    assert len(list((tmp_path / "shots").glob("*.png"))) == len(pages)
