"""``--stage long``: the long-run study's command, its plan, its runs or its report (``long_run.py`` holds the study,
``long_report.py`` its report). ``quality_study.py --stage long`` runs it; run by path it takes the same flags and
its dry run imports neither torch nor transformers::

    .venv/bin/python benchmarks/quality/long_study.py --dry_run
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import long_report
import long_run
from long_run import DEFAULT_PRESET, LONG_CONFIGS, LONG_PRESETS, RESULTS, dry_run, study

WIRE_BYTES = RESULTS / "wire_presets.json"
"""Each wire preset's bytes at OLMo2-1B's scale (``wire_presets.py``): the report's time to AdamW-HSDP's loss."""


def main(args) -> None:
    """``--stage long``: ``args.out`` (None: the study directory), ``steps`` (None: the preset's), ``long_configs``,
    ``dry_run``, ``report`` (a study directory), ``time_budget``."""
    long_run.CURRENT_PRESET = args.long_preset or DEFAULT_PRESET
    chosen = LONG_PRESETS[long_run.CURRENT_PRESET]
    preset = dataclasses.replace(chosen, steps=args.steps or chosen.steps)
    args.out = args.out or RESULTS / preset.name
    args.configs = tuple(c for c in LONG_CONFIGS if c in (args.long_configs or LONG_CONFIGS))
    if args.dry_run:
        dry_run(args, preset)
    elif args.report:
        print(long_report.report(args.report, WIRE_BYTES))
    elif study(args, preset):
        print(long_report.report(args.out, WIRE_BYTES))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--long_configs", nargs="+", choices=list(LONG_CONFIGS), help="--stage long: a subset")
    parser.add_argument(
        "--long_preset",
        choices=list(LONG_PRESETS),
        help=f"--stage long: the model and schedule (default {DEFAULT_PRESET})",
    )


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description=long_run.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(cli)
    cli.add_argument("--out", type=Path, help="the study directory (default benchmarks/results/quality/<preset>)")
    cli.add_argument("--steps", type=int, help="the long preset's steps (default: the preset's)")
    cli.add_argument("--dry_run", action="store_true", help="the plan and its estimate, nothing run")
    cli.add_argument("--report", type=Path, help="only write README.md and the PNGs of this study directory")
    cli.add_argument("--time_budget", type=float, default=0, help="seconds: start no run that would end after it")
    main(cli.parse_args())
