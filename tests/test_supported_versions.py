"""The "newest tested" versions of docs/getting-started.md are not older than the ones the tests run on."""

from __future__ import annotations

import importlib.metadata
import re

import pytest
from support.launch import REPO_ROOT

PAGE = REPO_ROOT / "docs" / "getting-started.md"

pytestmark = pytest.mark.unit


def release(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:2])


@pytest.mark.parametrize("package", ["transformers", "accelerate"])
def test_the_installed_version_is_not_newer_than_the_newest_tested(package):
    row = re.search(rf"^\| {package} \| .* \| ([\d.]+) \|$", PAGE.read_text(), re.MULTILINE)
    assert row, f"{PAGE.name} has no row for {package} in 'Supported versions'"
    installed = importlib.metadata.version(package)
    assert release(installed) <= release(row.group(1)), (
        f"the tests run on {package} {installed}, but {PAGE.name} says the newest tested is {row.group(1)}: "
        "update the 'Supported versions' table"
    )
