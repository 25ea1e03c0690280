"""Why a wire's gap grows along a run: the share of the momentum's energy each step sends, and what stays behind.

Issue 70 asks what a long run adds that a short one hides. This runs one configuration of the long study's
``olmo2_long_263k`` preset (:mod:`long_run`: the same stock script, flags, seed and simulated replicas) in this
process, with DeMo's ``local_step`` watched: before each replica's step it takes the squared norm of the momentum
that step is about to pick from (``decay * Q + lr * DCT(grad)``, every tile of every matrix), after it the squared
norm of what stayed (the error-feedback residual, the rounding error of the sent values included). Per step and
summed over the parameters and the replicas:

- ``sent_share``: ``1 - after / before``, the share of the momentum's energy the step took out and sent;
- ``residual_norm``: the square root of ``after``, the error feedback a replica carries into the next step.

The loss curve is the run's own (``trainer_state.json``), so the gap to another run of the study is read off the
study's ``runs.json`` on the same seed::

    .venv/bin/python benchmarks/probes/residual_over_run.py --config wire_top128_4bit --lr 8e-3 \\
        --json benchmarks/results/probes/residual_wire_top128_4bit.json
    .venv/bin/python benchmarks/probes/residual_over_run.py --plot benchmarks/results/probes/residual_*.json \\
        --png benchmarks/results/probes/residual_over_run.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1] / "quality"))  # the long study's presets and flags
sys.path.insert(0, str(HERE.parents[2] / "training_scripts"))


def watch_local_steps(energy: dict[int, list[float]]) -> None:
    """Wrap DeMo's local step: ``energy[step]`` gathers ``[before, after]`` squared norms over buckets and
    replicas."""
    from hf_flexdemo.compression import to_coefficients
    from hf_flexdemo.schemes.demo import DeMoScheme

    original = DeMoScheme.local_step

    def local_step(self, bucket, ctx):
        plan = self.plan(bucket)
        if plan.n_tiles and bucket.grad is not None and ctx.replicate:
            q = self.momentum(bucket).view(plan.rows, plan.cols).float()
            grad = to_coefficients(bucket.grad, plan).float()
            before = float((q * bucket.group["decay"] + grad * bucket.group["lr"]).square().sum())
            payload = original(self, bucket, ctx)
            after = float(self.momentum(bucket).float().square().sum())
            totals = energy[ctx.step]
            totals[0] += before
            totals[1] += after
            return payload
        return original(self, bucket, ctx)

    DeMoScheme.local_step = local_step


def run(config: str, lr: float, seed: int, steps: int | None) -> dict:
    """One run of ``config`` on the long study's 263K preset; its per-step energies and its loss curve."""
    import long_run
    import train_olmo2

    preset = long_run.LONG_PRESETS[long_run.DEFAULT_PRESET]
    args, one_process = long_run.run_args(preset, config, lr, seed)
    if not one_process:
        raise SystemExit(f"--config {config} runs on real nodes; this probe watches simulated replicas (one process)")
    if steps is not None:
        args += ["--max_steps", str(steps)]
    energy: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
    watch_local_steps(energy)
    with tempfile.TemporaryDirectory() as out:
        os.environ["HF_HUB_OFFLINE"] = "1"  # as the study launches it
        sys.argv = ["train_olmo2.py", "--preset", "offline", "--output_dir", out, *args]
        train_olmo2.main()
        history = json.loads((Path(out) / "trainer_state.json").read_text())["log_history"]
    per_step = [
        {"step": step, "sent_share": 1 - after / before, "residual_norm": after**0.5}
        for step, (before, after) in sorted(energy.items())
        if before > 0
    ]
    evals = [{"step": h["step"], "eval_loss": h["eval_loss"]} for h in history if "eval_loss" in h]
    return {"preset": preset.name, "config": config, "lr": lr, "seed": seed, "steps": per_step, "evals": evals}


def plot(paths: list[Path], png: Path) -> None:
    """Sent share and residual norm along the run, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (share, norm) = plt.subplots(1, 2, figsize=(11, 4))
    for path in paths:
        record = json.loads(path.read_text())
        steps = [s["step"] for s in record["steps"]]
        label = f"{record['config']} (lr {record['lr']:g})"
        share.plot(steps, [s["sent_share"] for s in record["steps"]], label=label, linewidth=0.8)
        norm.plot(steps, [s["residual_norm"] for s in record["steps"]], label=label, linewidth=0.8)
    share.set(xlabel="step", ylabel="share of the momentum's energy sent", title="What each step sends")
    norm.set(xlabel="step", ylabel="error-feedback residual norm", title="What stays behind", yscale="log")
    share.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="a configuration of benchmarks/quality/long_run.py's LONG_CONFIGS")
    parser.add_argument("--lr", type=float)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, help="fewer steps than the preset's (a check)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path, nargs="+", help="records to draw instead of a run")
    parser.add_argument("--png", type=Path)
    args = parser.parse_args()
    if args.plot:
        plot(args.plot, args.png)
        return
    if args.config is None or args.lr is None:
        parser.error("--config and --lr name the run (or --plot the records to draw)")
    record = run(args.config, args.lr, args.seed, args.steps)
    tail = record["steps"][-1] if record["steps"] else {}
    print(f"{args.config}: {len(record['steps'])} steps; last: sent {tail.get('sent_share', 0):.3f} of the energy, "
          f"residual {tail.get('residual_norm', 0):.4g}")  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
