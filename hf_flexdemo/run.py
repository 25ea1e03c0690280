"""Run an unmodified Trainer script with FlexDeMo available.

    accelerate launch --config_file accelerate_configs/cpu_2x2.yaml -m hf_flexdemo.run \\
        path/to/run_clm.py --optim flexdemo --optim_args "topk=32,chunk=64" ...

Imports ``hf_flexdemo`` (which registers ``--optim flexdemo`` and the Accelerate plugin),
then runs the script as ``__main__`` with the remaining arguments.
"""

from __future__ import annotations

import runpy
import sys

import hf_flexdemo  # noqa: F401  (installs the integrations)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    script = argv[0]
    sys.argv = [script, *argv[1:]]
    if script.endswith(".py"):
        runpy.run_path(script, run_name="__main__")
    else:
        runpy.run_module(script, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
