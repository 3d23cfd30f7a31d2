"""The site builds with ``mkdocs build --strict`` and no network, needs nothing from the network to be
read, and works in a browser: headless Chromium shows the home page and a reference page, and the
site's search, opened from the file system as on a cluster's login node, finds a config key."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from PIL import Image

import spikingsail
from tests.docs.site import build

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# A config key that only the generated config table holds (no page's prose names it).
GENERATED_KEY = "fault_tolerance.connect_timeout_seconds"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site_dir = tmp_path_factory.mktemp("site")
    done = build(site_dir, offline=True)
    assert done.returncode == 0, (
        f"mkdocs build --strict failed without network:\n{done.stdout}\n{done.stderr}"
    )
    return site_dir


def chromium(*args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM, "chromium is not installed: scripts/system-deps.sh installs Debian's chromium package"
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def external_loads(html: str) -> list[str]:
    """The tags of a page that make a browser fetch something from the network as it opens the page."""
    tags = re.findall(r"<(?:script|link|img|iframe|source)\b[^>]*>", html)
    return [tag for tag in tags if re.search(r"""(?:src|href)=["']?(?:https?:)?//""", tag)]


def test_the_external_load_check_sees_a_cdn_script() -> None:
    page = '<a href="https://github.com/pytorch/torchft">x</a><script src="https://unpkg.com/iframe-worker/shim"></script>'
    assert external_loads(page) == ['<script src="https://unpkg.com/iframe-worker/shim">']


def test_the_built_pages_load_nothing_from_the_network(site: Path) -> None:
    found = [
        f"{page.relative_to(site)}: {tag}"
        for page in site.rglob("*.html")
        for tag in external_loads(page.read_text())
    ]
    found += [
        f"{sheet.relative_to(site)}: {url}"
        for sheet in site.rglob("*.css")
        for url in re.findall(r"(?:url\(|@import\s+)[\"']?(?:https?:)?//[^\"')\s]+", sheet.read_text())
    ]
    assert not found, "the site loads from the network:\n" + "\n".join(sorted(found))
    assert (site / "search" / "search_index.js").is_file(), (
        "the offline plugin's inlined search index is missing"
    )
    assert (site / "reference" / "config.html").is_file()


def test_every_page_names_the_version_it_documents(site: Path) -> None:
    stamp = f"SpikingSail {spikingsail.__version__}: built from the source of this version"
    unstamped = [
        str(page.relative_to(site)) for page in site.rglob("*.html") if stamp not in page.read_text()
    ]
    assert not unstamped, f"pages without the version: {unstamped}"


@pytest.mark.parametrize("page", ["index.html", "reference/config.html"])
def test_a_page_renders_in_chromium(site: Path, page: str, tmp_path: Path) -> None:
    shot = tmp_path / "page.png"
    done = chromium(f"--screenshot={shot}", "--window-size=1280,900", (site / page).as_uri())
    assert shot.is_file(), f"no screenshot of {page}:\n{done.stderr[-3000:]}"
    with Image.open(shot) as image:
        assert image.size == (1280, 900)
        colours = image.convert("RGB").getcolors(maxcolors=1 << 16)
    # a blank or unstyled page has a handful of colours; the Material theme's header, navigation and
    # anti-aliased text have hundreds
    assert colours is None or len(colours) > 200, f"{page} looks blank: {len(colours)} colours"


def test_search_finds_a_config_key_from_the_file_system(site: Path) -> None:
    url = (site / "index.html").as_uri() + f"?q={GENERATED_KEY}"
    done = chromium("--virtual-time-budget=30000", "--dump-dom", url)
    results = re.findall(r'<a href="([^"]*)" class="md-search-result__link"', done.stdout)
    assert any("reference/config.html" in link for link in results), (
        f"searching {GENERATED_KEY} found {results or 'nothing'}\n{done.stderr[-3000:]}"
    )


def test_search_of_a_word_in_no_page_finds_nothing(site: Path) -> None:
    url = (site / "index.html").as_uri() + "?q=qwxzvbnmkj"
    done = chromium("--virtual-time-budget=30000", "--dump-dom", url)
    assert "md-search-result__meta" in done.stdout, "the search box did not open"
    assert 'class="md-search-result__link"' not in done.stdout
