"""The documentation: the site builds with no broken link, every page is in its nav, and the README stays short.

``mkdocs build --strict`` fails on any warning, and ``mkdocs.yml`` makes warnings of a link to a missing page or
anchor, a page left out of the nav, and a nav entry without a page; ``docs/hooks.py`` adds a link to a file the
site does not carry and a ``FlexDeMoConfig`` field without help text. README.md and BENCHMARKS.md are pages of the
site (their links are checked as they work on GitHub, see ``docs/hooks.py``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest
import yaml
from support.launch import REPO_ROOT

from hf_flexdemo import FlexDeMoConfig

pytestmark = pytest.mark.unit

README_MAX_LINES = 120
GENERATED_PAGES = {"index.md", "benchmarks/index.md"}
"""Pages docs/hooks.py makes from README.md and BENCHMARKS.md."""


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about MkDocs 2.0, not about these pages
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if "No module named mkdocs" in result.stderr:
        pytest.fail("mkdocs is not installed: pip install -e '.[test]' (or '.[docs]')")
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    return out


def test_the_site_builds_strictly(site):
    assert (site / "index.html").exists() and (site / "benchmarks" / "index.html").exists()


def test_the_settings_page_lists_every_field_of_the_config(site):
    html = (site / "settings" / "index.html").read_text()
    missing = [f.name for f in dataclasses.fields(FlexDeMoConfig) if f"<code>{f.name}</code>" not in html]
    assert not missing, f"the generated settings table lacks {missing}"
    assert "generated: the FlexDeMoConfig table" not in html  # the marker was replaced


def _nav_pages(entries) -> set[str]:
    pages = set()
    for entry in entries:
        if isinstance(entry, str):
            pages.add(entry)
        elif isinstance(entry, dict):
            for value in entry.values():
                pages |= _nav_pages(value) if isinstance(value, list) else {value}
    return pages


def test_every_page_under_docs_is_in_the_nav():
    class Loader(yaml.SafeLoader):  # mkdocs.yml names Python objects (!!python/name:...) for its extensions
        pass

    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
    config = yaml.load((REPO_ROOT / "mkdocs.yml").read_text(), Loader=Loader)
    nav = _nav_pages(config["nav"])
    docs = REPO_ROOT / config.get("docs_dir", "docs")
    pages = {path.relative_to(docs).as_posix() for path in docs.rglob("*.md")}
    assert pages - nav == set(), f"pages missing from mkdocs.yml's nav: {sorted(pages - nav)}"
    assert nav - pages - GENERATED_PAGES == set(), f"nav entries without a page: {sorted(nav - pages - GENERATED_PAGES)}"


def test_the_readme_is_one_screenful_and_starts_with_the_two_commands():
    text = (REPO_ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"
    assert lines[0].startswith("# "), "README.md starts with its title"
    first_block = re.search(r"^```[^\n]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    assert first_block, "README.md has no code block"
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines()]
    assert commands[:2] == ["make demo", "make test"], f"README's first code block is {commands}"
