"""A node that joins a running fault-tolerant job: 2 nodes, then 3, against 2 nodes throughout.

Each node is `accelerate launch --config_file accelerate_configs/cpu_ft_node.yaml
training_scripts/train_t5.py --preset offline` (2 processes) with ``fault_tolerance=torchft``
and a real ``torchft_lighthouse``, as the README launches them:

- **two**: nodes 0 and 1 (``NUM_REPLICA_GROUPS=2``) train ``--steps`` steps;
- **join**: the job declares 3 nodes (``NUM_REPLICA_GROUPS=3``); nodes 0 and 1 start, node 2
  starts once ``--join-at`` steps are committed, heals from a peer and trains its own third
  of the data.

Measured: samples committed per step before and after the join (the logged
``flexdemo/samples_per_step``), how long node 2 took from its start to its first step in the
quorum, the final evaluation loss of each run, and whether the nodes saved identical models.

    .venv/bin/python benchmarks/scale_up.py --out benchmarks/results/scale_up.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from fault_tolerance import FT_CONFIG, Launch, Lighthouse

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


def two_nodes(work: Path, steps: int) -> dict:
    lighthouse = Lighthouse(2000, work / "lighthouse_two.log")
    out = work / "two"
    try:
        nodes = [Launch(FT_CONFIG, out, steps, node_env(lighthouse, n, 2), OPTIM_ARGS) for n in (0, 1)]
        for node in nodes:
            node.wait()
    finally:
        lighthouse.stop()
    return {
        "eval_loss": final_eval_loss(out, 0),
        "identical": same_models(out, 2),
        "samples_per_step": samples_per_step(nodes[0]),
    }


def join(work: Path, steps: int, join_at: int) -> dict:
    lighthouse = Lighthouse(2000, work / "lighthouse_join.log")
    out = work / "join"
    try:
        nodes = [Launch(FT_CONFIG, out, steps, node_env(lighthouse, n, 3), OPTIM_ARGS) for n in (0, 1)]
        while nodes[0].committed() < join_at:
            if nodes[0].proc.poll() is not None:
                raise RuntimeError("node 0 ended before the join:\n" + "".join(nodes[0].tail))
            time.sleep(0.05)
        nodes.append(Launch(FT_CONFIG, out, steps, node_env(lighthouse, 2, 3), OPTIM_ARGS))
        for node in nodes:
            node.wait()
    finally:
        lighthouse.stop()
    first_in = next(t for t, s in nodes[2].steps if s.get("flexdemo/live_replicas") == 3)
    return {
        "eval_loss": final_eval_loss(out, 0),
        "identical": same_models(out, 3),
        "samples_per_step": samples_per_step(nodes[0]),
        "join_s": first_in - nodes[2].started,
    }


def rates(points: list[tuple[int, int]], join_at: int) -> tuple[float, float]:
    before = [value for step, value in points if 5 <= step < join_at]
    after = [value for step, value in points if step > join_at + 10]
    return statistics.median(before), statistics.median(after)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--join-at", type=int, default=50, help="node 2 starts once this many steps are committed")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "scale_up.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        runs = {"two": two_nodes(work, args.steps), "join": join(work, args.steps, args.join_at)}
    before, after = rates(runs["join"]["samples_per_step"], args.join_at)
    summary = {
        "samples_per_step_before_join": before,
        "samples_per_step_after_join": after,
        "samples_ratio": after / before,
        "node2_start_to_first_quorum_s": runs["join"]["join_s"],
        "eval_loss_two_nodes": runs["two"]["eval_loss"],
        "eval_loss_with_join": runs["join"]["eval_loss"],
        "identical_models": {name: run["identical"] for name, run in runs.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {"steps": args.steps, "join_at": args.join_at, "optim_args": OPTIM_ARGS}
    args.out.write_text(json.dumps({"settings": settings, "summary": summary, "runs": runs}, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
