"""MkDocs hooks (``hooks:`` in mkdocs.yml). Two jobs, both so that the site cannot drift from the repository:

- the settings reference: ``docs/settings.md`` holds a marker line, replaced at build time by the tables of
  :class:`hf_flexdemo.FlexDeMoConfig`'s settings (the common ones first, then one per group of ``SETTING_GROUPS``,
  the wire's knobs last), made from their dataclass fields (name, type, default, ``metadata["help"]``);
- the repository's own Markdown: ``README.md`` becomes the home page and ``BENCHMARKS.md`` the benchmark results,
  with the plots they show and each study's record (``benchmarks/results/**/README.md``, off the nav), and every relative link is written as it works on GitHub (from the file's place in
  the repository, ``docs/...`` included) and mapped here to the page or file it names on the site.

A field without help text, a missing marker, or a link to a repository file the site does not carry is a warning,
which ``mkdocs build --strict`` (``make docs``, ``tests/test_docs.py``) turns into a failed build.
"""

from __future__ import annotations

import ast
import dataclasses
import logging
import posixpath
import re
import sys
from fractions import Fraction
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("mkdocs.plugins.hf_flexdemo_docs")

PAGES = {"README.md": "index.md", "BENCHMARKS.md": "benchmarks/index.md"}
"""Repository Markdown files outside ``docs/`` shown as pages: repository path -> path on the site."""
ASSETS = "benchmarks/results"
"""The plots under this folder are copied to the same path on the site."""
SETTINGS_PAGE = "settings.md"
SETTINGS_MARKER = "<!-- generated: the FlexDeMoConfig table (docs/hooks.py) -->"

LINK = re.compile(r"(\]\()([^)\s#]*)(#[^)\s]*)?(\))")


def on_files(files, config):
    for repo_path, uri in PAGES.items():
        files.append(File.generated(config, uri, abs_src_path=str(ROOT / repo_path)))
    for plot in sorted((ROOT / ASSETS).rglob("*.png")):
        files.append(File.generated(config, plot.relative_to(ROOT).as_posix(), abs_src_path=str(plot)))
    for study in sorted((ROOT / ASSETS).rglob("README.md")):  # each study's full record, beside its results
        files.append(File.generated(config, study.relative_to(ROOT).as_posix(), abs_src_path=str(study)))
    return files


def on_page_markdown(markdown, page, config, files):
    uri = page.file.src_uri
    if uri == SETTINGS_PAGE:
        if SETTINGS_MARKER not in markdown:
            log.warning("%s lost its marker line %r: the settings table has nowhere to go", uri, SETTINGS_MARKER)
        markdown = markdown.replace(SETTINGS_MARKER, settings_table())
    here = next((repo for repo, site in PAGES.items() if site == uri), uri if uri.startswith(f"{ASSETS}/") else f"docs/{uri}")
    return LINK.sub(lambda match: _site_link(match, here, uri), markdown)


def _site_link(match: re.Match, repo_page: str, site_page: str) -> str:
    target = match.group(2)
    if not target or ":" in target or target.startswith("/"):
        return match.group(0)  # an anchor on the same page, a URL, an absolute path
    repo_target = posixpath.normpath(posixpath.join(posixpath.dirname(repo_page), target))
    if repo_target in PAGES:
        site_target = PAGES[repo_target]
    elif repo_target.startswith("docs/"):
        site_target = repo_target[len("docs/") :]
    elif repo_target.startswith(f"{ASSETS}/"):
        site_target = repo_target
    else:
        log.warning(
            "%s links to %s, which the site does not carry: name the file in backticks instead", repo_page, target
        )
        return match.group(0)
    relative = posixpath.relpath(site_target, posixpath.dirname(site_page) or ".")
    return f"{match.group(1)}{relative}{match.group(3) or ''}{match.group(4)}"


def settings_table() -> str:
    """The settings most users touch first (``COMMON_SETTINGS``), then the rest, one table per group of
    FlexDeMoConfig's settings (``SETTING_GROUPS``) in the code's order, and the wire's own knobs apart
    (``ADVANCED_WIRE_SETTINGS``): one row per field."""
    sys.path.insert(0, str(ROOT))
    from hf_flexdemo.config import ADVANCED_WIRE_SETTINGS, COMMON_SETTINGS, GROUP_KEYS, SETTING_GROUPS

    flags = _trainer_flags()
    fields = {field.name: field for group in SETTING_GROUPS for field in dataclasses.fields(group)}

    def table(heading: str, names) -> str:
        rows = [heading, "", "| setting | type | default | set with | per group | meaning |", "|---|---|---|---|---|---|"]
        for name in names:
            field = fields[name]
            help_text = field.metadata.get("help", "")
            if not help_text:
                log.warning("FlexDeMoConfig.%s has no metadata['help']: the settings page needs one", field.name)
            default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
            where = f"`{flags[field.name]}`" if field.name in flags else "`optim_args`"
            cells = [
                f"`{field.name}`",
                f"`{str(field.type).replace(' | ', ' or ')}`",
                f"`{_cell(_default(default))}`",
                where,
                "yes" if field.name in GROUP_KEYS else "",
                _cell(help_text),
            ]
            rows.append("| " + " | ".join(cells) + " |")
        return "\n".join(rows)

    apart = set(COMMON_SETTINGS) | set(ADVANCED_WIRE_SETTINGS)
    sections = [table("### The settings most users touch", COMMON_SETTINGS)]
    for group in SETTING_GROUPS:
        rest = [field.name for field in dataclasses.fields(group) if field.name not in apart]
        if rest:
            sections.append(table(f"### {group.__name__}: {group.__doc__.strip().splitlines()[0]}", rest))
    sections.append(table("### Advanced: the wire's knobs", ADVANCED_WIRE_SETTINGS))
    return "\n\n".join(sections)


def _trainer_flags() -> dict[str, str]:
    """The settings the Trainer takes from its own flags, read from the source (importing it needs transformers)."""
    source = (ROOT / "hf_flexdemo/integrations/training_args.py").read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "FROM_TRAINING_ARGUMENTS" for t in node.targets):
            return ast.literal_eval(node.value)
    log.warning("hf_flexdemo/integrations/training_args.py has no FROM_TRAINING_ARGUMENTS: 'set with' is a guess")
    return {}


def _default(value) -> str:
    if isinstance(value, float) and value and not value.is_integer():
        fraction = Fraction(value)
        if fraction.numerator == 1 and fraction.denominator > 16:  # 1/128 reads better than 0.0078125
            return f"1/{fraction.denominator}"
    return repr(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
