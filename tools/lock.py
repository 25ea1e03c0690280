"""The lock of the main test environment (``constraints/locked.txt``) and the supported-versions table it drives.

``.venv`` and ``.venv-lean`` install exactly the versions the lock pins, so a release elsewhere cannot turn
``make test`` red; ``.venv-newest`` ignores the lock and takes the newest releases on purpose. One command moves the
lock to the newest releases and rewrites the table in docs/getting-started.md from what it installed::

    make lock                                   # python3 tools/lock.py refresh
    python3 tools/lock.py table                 # only the table, from the committed lock
    .venv/bin/python tools/lock.py newer --venv .venv-newest   # releases newer than the lock (make test's summary)
    python3 tools/lock.py explain --venv .venv  # after a locked install failed: which pin the registry lacks

Standard library only (``newer`` compares versions with ``packaging``, which every environment here has).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "constraints" / "locked.txt"
LOWEST = ROOT / "constraints" / "lowest.txt"
PAGE = ROOT / "docs" / "getting-started.md"
MAKEFILE = ROOT / "Makefile"
SETUP = ROOT / "setup.cfg"
EXTRAS = "test,bench"
"""What ``.venv`` installs besides the package (the Makefile's main environment)."""
NOT_LOCKED = {"torch", "hf-flexdemo"}
"""torch comes from ``TORCH_SPEC`` (a user's own build on a GPU machine); the package is the checkout itself."""
TABLE_PACKAGES = ("transformers", "accelerate", "datasets")
BEGIN, END = "<!-- versions table: written by tools/lock.py -->", "<!-- end of the versions table -->"
HEADER = """\
# The exact versions `.venv` and `.venv-lean` install (pip -c), so that a release cannot change what `make test`
# runs. Written by `make lock` (tools/lock.py refresh) from a fresh install of the newest releases; do not edit.
# torch is not here: TORCH_SPEC in the Makefile pins it.
"""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_pins(text: str) -> dict[str, str]:
    """``name==version`` lines (comments and blanks skipped) as {canonical name: version}."""
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep:
            raise ValueError(f"{line!r}: a lock line is name==version")
        pins[canonical(name.strip())] = version.strip()
    return pins


def render_lock(frozen: str) -> str:
    """``pip freeze`` output as the lock: sorted, without torch and the package itself."""
    pins = {k: v for k, v in parse_pins(frozen).items() if k not in NOT_LOCKED}
    return HEADER + "".join(f"{name}=={pins[name]}\n" for name in sorted(pins))


def makefile_spec(variable: str) -> str:
    """``torch==2.13.0`` -> ``2.13.0`` for TORCH_SPEC / NEWEST_TORCH_SPEC."""
    found = re.search(rf"^{variable} \?= torch==([\w.]+)$", MAKEFILE.read_text(), re.MULTILINE)
    if not found:
        raise ValueError(f"Makefile: no `{variable} ?= torch==VERSION` line")
    return found.group(1)


def lowest_torch() -> str:
    found = re.search(r"^\s*torch>=([\w.]+)$", SETUP.read_text(), re.MULTILINE)
    if not found:
        raise ValueError("setup.cfg: no `torch>=VERSION` in install_requires")
    return found.group(1)


def render_table(lock: dict[str, str], lowest: dict[str, str]) -> str:
    rows = [
        "| package | lowest (`.venv-lowest`: `constraints/lowest.txt`) | locked (`.venv`: `constraints/locked.txt`) "
        "| newest (`.venv-newest`) |",
        "| --- | --- | --- | --- |",
    ]
    for name in TABLE_PACKAGES:
        floor = lowest.get(name, "not pinned: the newest release")
        rows.append(f"| {name} | {floor} | {lock[name]} | the newest release on the day `make test` runs |")
    rows.append(
        f"| torch | {lowest_torch()} (`setup.cfg`) | {makefile_spec('TORCH_SPEC')} (CPU build, `TORCH_SPEC`) "
        f"| {makefile_spec('NEWEST_TORCH_SPEC')} (its CUDA build on CPU, `NEWEST_TORCH_SPEC`) |"
    )
    return "\n".join(rows)


def write_table() -> bool:
    """Rewrite the table between the page's markers from the committed files; True where it changed."""
    page = PAGE.read_text()
    if BEGIN not in page or END not in page:
        raise ValueError(f"{PAGE}: the markers {BEGIN!r} and {END!r} are missing")
    head, rest = page.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    table = render_table(parse_pins(LOCK.read_text()), parse_pins(LOWEST.read_text()))
    new = f"{head}{BEGIN}\n{table}\n{END}{tail}"
    PAGE.write_text(new)
    return new != page


def run(*command: str) -> str:
    return subprocess.run(command, check=True, text=True, stdout=subprocess.PIPE).stdout


def refresh(args) -> None:
    """A fresh venv with the newest releases (torch from TORCH_SPEC), frozen into the lock; then the table."""
    old = parse_pins(LOCK.read_text()) if LOCK.exists() else {}
    with tempfile.TemporaryDirectory(prefix="flexdemo-lock-") as tmp:
        python = str(Path(tmp) / "bin" / "python")
        print(f"lock: installing the newest releases into a fresh venv ({tmp}), a few minutes", flush=True)
        run(sys.executable, "-m", "venv", tmp)
        run(python, "-m", "pip", "install", "--quiet", "--no-compile", f"torch=={makefile_spec('TORCH_SPEC')}")
        run(python, "-m", "pip", "install", "--quiet", "--no-compile", "-e", f"{ROOT}[{EXTRAS}]")
        frozen = run(python, "-m", "pip", "freeze", "--exclude-editable")
    LOCK.write_text(render_lock(frozen))
    new = parse_pins(LOCK.read_text())
    for name in sorted(old.keys() | new.keys()):
        if old.get(name) != new.get(name):
            print(f"lock: {name} {old.get(name, '(none)')} -> {new.get(name, '(none)')}")
    write_table()
    print(f"lock: wrote {LOCK.relative_to(ROOT)} and the table in {PAGE.relative_to(ROOT)}; commit both")


def newer_than_lock(installed: dict[str, str], lock: dict[str, str]) -> list[tuple[str, str, str]]:
    """(name, installed, locked) for each locked package installed at a higher version."""
    from packaging.version import InvalidVersion, Version

    found = []
    for name, version in sorted(installed.items()):
        if name not in lock:
            continue
        try:
            ahead = Version(version) > Version(lock[name])
        except InvalidVersion:
            continue
        if ahead:
            found.append((name, version, lock[name]))
    return found


def newer(args) -> None:
    """Print the releases ``.venv-newest`` installed that are newer than the lock. Never a failure."""
    python = str(Path(args.venv) / "bin" / "python")
    try:
        frozen = run(python, "-m", "pip", "freeze", "--exclude-editable")
        installed = parse_pins("\n".join(line for line in frozen.splitlines() if "==" in line))  # not `name @ url`
        ahead = newer_than_lock(installed, parse_pins(LOCK.read_text()))
    except (OSError, subprocess.CalledProcessError, ValueError) as error:
        print(f"lock: could not compare {args.venv} with the lock ({error}); the tests above are what counts")
        return
    if not ahead:
        print(f"lock: no release newer than {LOCK.relative_to(ROOT)} in {args.venv}")
        return
    print(f"lock: {len(ahead)} release(s) newer than {LOCK.relative_to(ROOT)}, tested in {args.venv} (passed):")
    for name, version, locked in ahead:
        print(f"  {name} {version} (locked {locked})")
    print("lock: to move the main suite to them, run `make lock` and commit constraints/locked.txt and the docs table")


MISSING = re.compile(r"No matching distribution found for ([\w.\-\[\]]+)==([^\s;]+)")


def explain(args) -> None:
    """After a locked install failed: ask pip for each pin alone (no dependencies) and name the one it lacks."""
    python = str(Path(args.venv) / "bin" / "python")
    checked = subprocess.run(
        [python, "-m", "pip", "install", "--dry-run", "--quiet", "--no-deps", "-r", str(LOCK)],
        text=True,
        capture_output=True,
    )
    found = MISSING.search(checked.stderr)
    if found and "(from versions: none)" in checked.stderr:
        sys.exit(
            f"lock: pip found no version at all of {found.group(1)}: the package index may be unreachable from "
            f"here, or serve no build of it for this platform. pip said:\n{checked.stderr}"
        )
    if found:
        sys.exit(
            f"lock: {LOCK.relative_to(ROOT)} pins {found.group(1)}=={found.group(2)}, which the package registry "
            "does not serve. The install stopped rather than take another version. Run `make lock` to move the lock "
            "to versions the registry serves, or pin a served version of that package by hand."
        )
    if checked.returncode:
        sys.exit(f"lock: checking the pins of {LOCK.relative_to(ROOT)} failed:\n{checked.stderr}")
    sys.exit(
        f"lock: every pin of {LOCK.relative_to(ROOT)} is served, so the locked install failed for another reason: "
        "see pip's error above."
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("refresh", help="move the lock to the newest releases and rewrite the table")
    commands.add_parser("table", help="rewrite the table from the committed lock")
    for name, text in (("newer", "releases in VENV newer than the lock"), ("explain", "why a locked install failed")):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("--venv", required=True, help="the environment to read (or whose pip to ask)")
    args = parser.parse_args(argv)
    if args.command == "table":
        print("lock: table rewritten" if write_table() else "lock: table already matches the lock")
    else:
        {"refresh": refresh, "newer": newer, "explain": explain}[args.command](args)


if __name__ == "__main__":
    main()
