"""The README is the short front door: under 8 kB, and every link in it reaches a page of the site."""

from __future__ import annotations

import re

from tests.docs.snippets import ROOT


def test_the_readme_is_under_8_kb() -> None:
    size = len((ROOT / "README.md").read_bytes())
    assert size < 8 * 1024, f"README.md is {size} bytes: move the detail into a page of docs/"


def test_every_link_of_the_readme_reaches_a_file() -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    local = [link for link in links if "://" not in link]
    assert local, "the README links into no page of the site"
    missing = [link for link in local if not (ROOT / link).is_file()]
    assert not missing, f"README links to files that do not exist: {missing}"


def test_every_test_the_feature_table_names_exists() -> None:
    table = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| ")]
    named = [path for line in table for path in re.findall(r"`(tests/[^`]+)`", line)]
    assert len(named) >= 10, "the feature table names no test for some rows"
    assert not [path for path in named if not (ROOT / path).exists()], (
        "the feature table names tests that do not exist"
    )
