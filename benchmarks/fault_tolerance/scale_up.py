"""A node that joins a running fault-tolerant job: 2 nodes, then 3, against 2 nodes throughout.

Each node is `accelerate launch --config_file accelerate_configs/cpu_ft_node.yaml
training_scripts/train_t5.py --preset offline` (2 processes) with ``fault_tolerance=torchft``
and a real ``torchft_lighthouse``, as docs/fault-tolerance.md launches them:

- **two**: nodes 0 and 1 (``NUM_REPLICA_GROUPS=2``) train ``--steps`` steps;
- **join**: the job declares 3 nodes (``NUM_REPLICA_GROUPS=3``); nodes 0 and 1 start, node 2
  starts once ``--join-at`` steps are committed, heals from a peer and trains its own third
  of the data.

Measured: samples committed per step before and after the join (the logged
``flexdemo/samples_per_step``), how long node 2 took from its start to its first step in the
quorum, the final evaluation loss of each run, and whether the nodes saved identical models.

    .venv/bin/python benchmarks/fault_tolerance/scale_up.py --seeds 1 2 3 \\
        --out benchmarks/results/fault_tolerance/scale_up.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness

from harness import FT_CONFIG, ROOT, Launch, Lighthouse  # noqa: E402

OPTIM_ARGS = "fault_tolerance=torchft,ft_timeout=30,quorum_timeout=120"


def node_env(lighthouse: Lighthouse, node: int, nodes: int) -> dict[str, str]:
    return {"TORCHFT_LIGHTHOUSE": lighthouse.address, "REPLICA_GROUP_ID": str(node), "NUM_REPLICA_GROUPS": str(nodes)}


def final_eval_loss(output_dir: Path, node: int) -> float:
    history = json.loads((output_dir / f"node{node}" / "trainer_state.json").read_text())["log_history"]
    return [h["eval_loss"] for h in history if "eval_loss" in h][-1]


def same_models(output_dir: Path, nodes: int) -> bool:
    models = [(output_dir / f"node{n}" / "model.safetensors").read_bytes() for n in range(nodes)]
    return all(model == models[0] for model in models)


def samples_per_step(launch: Launch) -> list[tuple[int, int]]:
    return [(int(s["flexdemo/committed_steps"]), int(s["flexdemo/samples_per_step"])) for _, s in launch.steps]


def two_nodes(work: Path, steps: int, extra: list[str]) -> dict:
    lighthouse = Lighthouse(2000, work / "lighthouse_two.log")
    out = work / "two"
    try:
        nodes = [Launch(FT_CONFIG, out, steps, node_env(lighthouse, n, 2), OPTIM_ARGS, extra) for n in (0, 1)]
        for node in nodes:
            node.wait()
    finally:
        lighthouse.stop()
    return {
        "eval_loss": final_eval_loss(out, 0),
        "identical": same_models(out, 2),
        "samples_per_step": samples_per_step(nodes[0]),
    }


def join(work: Path, steps: int, join_at: int, extra: list[str]) -> dict:
    lighthouse = Lighthouse(2000, work / "lighthouse_join.log")
    out = work / "join"
    try:
        nodes = [Launch(FT_CONFIG, out, steps, node_env(lighthouse, n, 3), OPTIM_ARGS, extra) for n in (0, 1)]
        while nodes[0].committed() < join_at:
            if nodes[0].proc.poll() is not None:
                raise RuntimeError("node 0 ended before the join:\n" + "".join(nodes[0].tail))
            time.sleep(0.05)
        nodes.append(Launch(FT_CONFIG, out, steps, node_env(lighthouse, 2, 3), OPTIM_ARGS, extra))
        for node in nodes:
            node.wait()
    finally:
        lighthouse.stop()
    first_in = next((t for t, s in nodes[2].steps if s.get("flexdemo/live_replicas") == 3), None)
    if first_in is None:
        raise RuntimeError("node 2 never trained in a quorum of 3:\n" + "".join(nodes[2].tail))
    return {
        "eval_loss": final_eval_loss(out, 0),
        "identical": same_models(out, 3),
        "samples_per_step": samples_per_step(nodes[0]),
        "join_s": first_in - nodes[2].started,
    }


def rates(points: list[tuple[int, int]]) -> tuple[float, float]:
    """Samples per step before node 2's first step in the quorum (the rise), and from it on."""
    values = [value for _, value in points]
    joined = values.index(max(values))
    if not 0 < joined < len(values):
        raise ValueError(f"samples per step never rose: {values}")
    return statistics.median(values[:joined]), statistics.median(values[joined:])


def summarize(runs: dict[str, dict]) -> dict:
    """Per seed and over the seeds: samples per step around the join, the final loss of each run."""
    per_seed = {}
    for seed, run in runs.items():
        before, after = rates(run["join"]["samples_per_step"])
        per_seed[seed] = {
            "samples_ratio": after / before,
            "samples_per_step": [before, after],
            "node2_start_to_first_quorum_s": run["join"]["join_s"],
            "eval_loss_two_nodes": run["two"]["eval_loss"],
            "eval_loss_with_join": run["join"]["eval_loss"],
            "identical_models": run["two"]["identical"] and run["join"]["identical"],
        }
    mean = lambda key: statistics.mean(seed[key] for seed in per_seed.values())  # noqa: E731
    return {
        "seeds": per_seed,
        "mean_eval_loss_two_nodes": mean("eval_loss_two_nodes"),
        "mean_eval_loss_with_join": mean("eval_loss_with_join"),
        "joined_at_or_below_two_nodes": sum(
            s["eval_loss_with_join"] <= s["eval_loss_two_nodes"] for s in per_seed.values()
        ),
    }


def plot(runs: dict[str, dict], join_at: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = runs[min(runs)]
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, label in (("two", "2 nodes throughout"), ("join", "node 2 started during the run")):
        points = run[name]["samples_per_step"]
        ax.step([step for step, _ in points], [value for _, value in points], where="post", label=label)
    ax.axvline(join_at, color="green", linestyle=":", label=f"node 2 started (step {join_at})")
    ax.set_xlabel("steps committed by the quorum")
    ax.set_ylabel("samples per step, all nodes")
    ax.set_ylim(bottom=0)
    ax.set_title("A node joins a running job (T5 offline, nodes of 2 processes, CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--join-at", type=int, default=50, help="node 2 starts once this many steps are committed")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--eval-samples", type=int, default=64)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "fault_tolerance" / "scale_up.json"
    )
    parser.add_argument("--summarize", action="store_true", help="recompute the summary and plot of --out only")
    args = parser.parse_args()
    settings = {"steps": args.steps, "join_at": args.join_at, "optim_args": OPTIM_ARGS, "eval": args.eval_samples}
    recorded = json.loads(args.out.read_text()) if args.out.exists() else {}
    if args.summarize:
        settings, args.seeds, args.join_at = recorded["settings"], [], recorded["settings"]["join_at"]
    runs = recorded.get("runs", {}) if recorded.get("settings") == settings else {}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        if str(seed) in runs:  # resumable: a finished seed is kept
            continue
        extra = ["--seed", str(seed), "--max_eval_samples", str(args.eval_samples)]
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            runs[str(seed)] = {
                "two": two_nodes(work, args.steps, extra),
                "join": join(work, args.steps, args.join_at, extra),
            }
        summary = summarize(runs)
        args.out.write_text(json.dumps({"settings": settings, "summary": summary, "runs": runs}, indent=1))
        print(json.dumps(summary["seeds"][str(seed)]), flush=True)
    plot(runs, args.join_at, args.out.with_suffix(".png"))
    summary = summarize(runs)
    args.out.write_text(json.dumps({"settings": settings, "summary": summary, "runs": runs}, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
