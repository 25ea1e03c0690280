"""The lock of the main environment (tools/lock.py): what it pins, the releases it reports as newer, the docs table it
writes, and the message of a locked install whose pin the registry no longer serves."""

from __future__ import annotations

import importlib.util
import stat

import pytest
from support.launch import REPO_ROOT

pytestmark = pytest.mark.unit

spec = importlib.util.spec_from_file_location("lock", REPO_ROOT / "tools" / "lock.py")
lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lock)


def test_the_lock_pins_every_package_but_torch_and_the_checkout_sorted_by_canonical_name():
    frozen = "Jinja2==3.1.6\ntorch==2.13.0+cpu\ntyping_extensions==4.16.0\nhf-flexdemo==0.1\naccelerate==1.16.0\n"
    written = lock.render_lock(frozen)
    assert written.startswith("#")
    assert lock.parse_pins(written) == {"accelerate": "1.16.0", "jinja2": "3.1.6", "typing-extensions": "4.16.0"}
    assert [line for line in written.splitlines() if not line.startswith("#")] == [
        "accelerate==1.16.0",
        "jinja2==3.1.6",
        "typing-extensions==4.16.0",
    ]


def test_a_lock_line_without_an_exact_pin_is_refused():
    with pytest.raises(ValueError, match="name==version"):
        lock.parse_pins("transformers>=5\n")


def test_only_releases_newer_than_the_lock_are_reported():
    locked = {"transformers": "5.25.0", "accelerate": "1.16.0", "datasets": "5.2.0"}
    installed = {"transformers": "5.26.0", "accelerate": "1.16.0", "datasets": "5.1.0", "nvidia-nccl": "2.0"}
    assert lock.newer_than_lock(installed, locked) == [("transformers", "5.26.0", "5.25.0")]


def test_the_committed_lock_holds_the_release_the_main_suite_runs_on():
    pins = lock.parse_pins(lock.LOCK.read_text())
    assert "torch" not in pins and "hf-flexdemo" not in pins
    for name in lock.TABLE_PACKAGES:
        assert name in pins, f"{lock.LOCK.name} pins no {name}"


def test_the_docs_table_is_the_one_the_lock_command_writes(tmp_path, monkeypatch):
    """The table changes only with the files it describes (the lock, lowest.txt, the Makefile, setup.cfg)."""
    page = lock.PAGE.read_text()
    copy = tmp_path / "getting-started.md"
    copy.write_text(page)
    monkeypatch.setattr(lock, "PAGE", copy)
    assert not lock.write_table(), "docs/getting-started.md's table differs from `python3 tools/lock.py table`"
    table = page.split(lock.BEGIN, 1)[1].split(lock.END, 1)[0]
    assert f"| transformers | 4.57.1 | {lock.parse_pins(lock.LOCK.read_text())['transformers']} |" in table


def fake_venv(tmp_path, stderr: str, code: int):
    """A venv whose python answers every pip call with ``stderr`` and exit ``code`` (no registry needed)."""
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"#!/bin/sh\ncat >&2 <<'EOF'\n{stderr}\nEOF\nexit {code}\n")
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return python.parents[1]


def test_a_pin_the_registry_no_longer_serves_is_named_and_the_install_stops(tmp_path, monkeypatch):
    monkeypatch.setattr(lock, "LOCK", REPO_ROOT / "constraints" / "locked.txt")
    venv = fake_venv(
        tmp_path,
        "ERROR: Could not find a version that satisfies the requirement transformers==9.9.9 (from versions: 5.25.0)\n"
        "ERROR: No matching distribution found for transformers==9.9.9",
        1,
    )
    with pytest.raises(SystemExit) as stopped:
        lock.main(["explain", "--venv", str(venv)])
    message = str(stopped.value)
    assert "pins transformers==9.9.9" in message
    assert "does not serve" in message and "make lock" in message


def test_a_failure_with_every_pin_served_points_at_pips_own_error(tmp_path):
    venv = fake_venv(tmp_path, "", 0)
    with pytest.raises(SystemExit, match="every pin .* is served"):
        lock.main(["explain", "--venv", str(venv)])
