"""How much one slow node slows a fault-tolerant job today: the baseline for issue 26's stragglers.

Three nodes of 2 processes (`accelerate launch --config_file accelerate_configs/cpu_ft_node.yaml
training_scripts/train_t5.py --preset offline`, ``fault_tolerance=torchft``, a real
``torchft_lighthouse``). In the **straggler** run, node 2's processes are really slowed: from
``--slow-from`` committed steps, for ``--slow-steps`` steps, they are cycled through SIGSTOP and
SIGCONT so that they run a third of the time (``--duty``). The **even** run is the same job,
nobody slowed. Measured: node 0's steps per second over the same committed steps in both runs.

    .venv/bin/python benchmarks/straggler.py --out benchmarks/results/straggler.json
    # nodes that join the quorum when their payload is ready: the slow node is left out and catches up
    .venv/bin/python benchmarks/straggler.py --join-quorum when_ready --out benchmarks/results/straggler_when_ready.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import signal
import tempfile
import threading
import time
from pathlib import Path

import psutil
from fault_tolerance import FT_CONFIG, Launch, Lighthouse

OPTIM_ARGS = "fault_tolerance=torchft,ft_timeout=60,quorum_timeout=120"
CYCLE_S = 0.3  # one SIGCONT/SIGSTOP period


def node_env(lighthouse: Lighthouse, node: int) -> dict[str, str]:
    return {"TORCHFT_LIGHTHOUSE": lighthouse.address, "REPLICA_GROUP_ID": str(node), "NUM_REPLICA_GROUPS": "3"}


def slow_down(launch: Launch, duty: float, until: threading.Event) -> None:
    """Let the node's processes (launcher and workers) run ``duty`` of the time until ``until`` is set."""
    launcher = psutil.Process(launch.proc.pid)
    processes = [launcher, *launcher.children(recursive=True)]

    def send(sig) -> None:
        for process in processes:
            try:
                process.send_signal(sig)
            except psutil.NoSuchProcess:
                pass

    try:
        while not until.is_set():
            send(signal.SIGCONT)
            time.sleep(CYCLE_S * duty)
            send(signal.SIGSTOP)
            time.sleep(CYCLE_S * (1 - duty))
    finally:
        send(signal.SIGCONT)


def rate(launch: Launch, first: int, last: int) -> float:
    """Steps per second of ``launch`` between committed steps ``first`` and ``last``."""
    committed = [(t, s["flexdemo/committed_steps"]) for t, s in launch.steps]
    points = [(t, step) for t, step in committed if first <= step <= last]
    (t0, c0), (t1, c1) = points[0], points[-1]
    return (c1 - c0) / (t1 - t0)


def run(
    work: Path, steps: int, slow_from: int, slow_steps: int, duty: float | None, join_quorum: str, seed: int
) -> dict:
    # Joining when ready, a late member is waited for 0.5 s (the Lighthouse's join timeout), not a whole step.
    lighthouse = Lighthouse(2000, work / "lighthouse.log", join_timeout_ms=500 if join_quorum == "when_ready" else 2000)
    out = work / ("straggler" if duty else "even")
    stop = threading.Event()
    optim_args = f"{OPTIM_ARGS},join_quorum={join_quorum},replay_steps=32"
    try:
        extra = ("--seed", str(seed))
        nodes = [Launch(FT_CONFIG, out, steps, node_env(lighthouse, n), optim_args, extra) for n in range(3)]
        while nodes[0].committed() < slow_from:
            if nodes[0].proc.poll() is not None:
                raise RuntimeError("node 0 ended early:\n" + "".join(nodes[0].tail))
            time.sleep(0.05)
        slower = threading.Thread(target=slow_down, args=(nodes[2], duty, stop), daemon=True) if duty else None
        if slower:
            slower.start()
        while nodes[0].committed() < slow_from + slow_steps and nodes[0].proc.poll() is None:
            time.sleep(0.05)
        stop.set()
        if slower:
            slower.join()
        for node in nodes:
            node.wait()
    finally:
        stop.set()
        lighthouse.stop()
    window = (slow_from, slow_from + slow_steps)
    return {
        "node0_steps_per_s": rate(nodes[0], *window),
        "node1_steps_per_s": rate(nodes[1], *window),
        "live_replicas": sorted({s["flexdemo/live_replicas"] for _, s in nodes[0].steps}),
        "eval_loss": [node.eval_loss for node in nodes],
        "node2_lines": [line for line in nodes[2].said if "catch" in line or "took the parameters" in line],
        "node2_summary": [line.strip() for line in nodes[2].tail if "behind and caught up" in line],
        "final_models_identical": len({model_digest(out / f"node{n}") for n in range(3)}) == 1,
        "stayed_for_a_late_node": [line for node in nodes for line in node.said if "stays for" in line],
    }


def model_digest(node_dir: Path) -> str:
    """SHA-256 of the final model a node saved (each node of a fault-tolerant job saves its own)."""
    return hashlib.sha256((node_dir / "model.safetensors").read_bytes()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=70)
    parser.add_argument("--slow-from", type=int, default=20)
    parser.add_argument("--slow-steps", type=int, default=30)
    parser.add_argument("--duty", type=float, default=1 / 3, help="share of the time the slow node runs")
    parser.add_argument("--join-quorum", default="before_forward", choices=["before_forward", "when_ready"])
    parser.add_argument("--seed", type=int, default=42, help="the training script's seed (data order, init)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "straggler.json")
    parser.add_argument("--keep", type=Path, help="write the runs' logs here (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = args.keep or tmp
        Path(tmp).mkdir(parents=True, exist_ok=True)
        window = (args.steps, args.slow_from, args.slow_steps)
        even = run(Path(tmp), *window, None, args.join_quorum, args.seed)
        straggler = run(Path(tmp), *window, args.duty, args.join_quorum, args.seed)
    summary = {
        "even": even,
        "straggler": straggler,
        "node0_rate_with_straggler_vs_even": straggler["node0_steps_per_s"] / even["node0_steps_per_s"],
    }
    settings = {key: value for key, value in vars(args).items() if key not in ("out", "keep")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"settings": settings, "summary": summary}, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
