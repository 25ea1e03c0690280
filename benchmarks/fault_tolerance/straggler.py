"""What one slow node costs the others in a fault-tolerant job, and where their seconds go.

Every node is one `accelerate launch --config_file accelerate_configs/cpu_ft_node.yaml
--num_processes P` of a training script's offline preset with ``fault_tolerance=torchft``; a real
``torchft_lighthouse`` joins them. Every node runs at full speed for ``--before`` committed steps
(the even rate), then the last node is slowed for ``--window`` seconds, then runs free again.

How the last node is slowed (``--slow``):

- ``pause``: its processes are stopped for 2 s of every 3 s (SIGSTOP, SIGCONT), like a machine
  that stalls (swapping, a preempted VM, a GC storm): it still heartbeats until it stops.
- ``compute``: it runs 15 ms of every 90 ms, so it computes steadily at a sixth of its core's
  speed, about a third of the others' (they share a core), like a slower machine.

The slow node runs on a core of its own, the others share the rest (``--no-isolate``: every node
on every core): what the slow node does with its core, pausing or sitting out, then frees nothing
for the others, as on separate machines. The others' even rate is taken before the window, with
the slow node at full speed on its core.

Measured on node 0 (and the other fast nodes): committed steps per second before, during and
after the window, and the share of steps before it whose quorum held every node. Each node's
per-step seconds in each quorum phase (``flexdemo/seconds_*``, logged per step) are drawn as a
timeline (``--plot``). The final models are compared byte for byte, and every ending warning the
nodes printed is kept.

    .venv/bin/python benchmarks/fault_tolerance/straggler.py --nodes 3 --processes 1 --script olmo2 \\
        --out benchmarks/results/fault_tolerance/straggler_3x1_pause.json \\
        --plot benchmarks/results/fault_tolerance/straggler_3x1_pause.png
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness

from harness import FT_CONFIG, ROOT, Launch, Lighthouse  # noqa: E402

SCRIPTS = {"t5": ROOT / "training_scripts" / "train_t5.py", "olmo2": ROOT / "training_scripts" / "train_olmo2.py"}
CYCLES = {"pause": 3.0, "compute": 0.09}  # seconds of one run-and-stop cycle
DUTIES = {"pause": 1 / 3, "compute": 1 / 6}  # share of the cycle the slow node runs
PHASES = ("quorum", "heal", "exchange", "commit", "catch_up", "serve", "sit_out")


def node_env(lighthouse: Lighthouse, node: int, nodes: int) -> dict[str, str]:
    return {"TORCHFT_LIGHTHOUSE": lighthouse.address, "REPLICA_GROUP_ID": str(node), "NUM_REPLICA_GROUPS": str(nodes)}


def processes_of(launch: Launch) -> list[psutil.Process]:
    launcher = psutil.Process(launch.proc.pid)
    return [launcher, *launcher.children(recursive=True)]


def send(processes: list, sig) -> None:
    for process in processes:
        try:
            process.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def slow_down(launch: Launch, duty: float, cycle: float, until: threading.Event) -> None:
    """Let the node run ``duty`` of every ``cycle`` seconds until ``until`` is set."""
    processes = processes_of(launch)
    try:
        while not until.is_set():
            send(processes, signal.SIGCONT)
            time.sleep(cycle * duty)
            send(processes, signal.SIGSTOP)
            time.sleep(cycle * (1 - duty))
    finally:
        send(processes, signal.SIGCONT)


def cores_of(node: int, nodes: int, isolate: bool) -> set[int] | None:
    """The last node on a core of its own, the others on the rest (None: every core)."""
    cores = sorted(os.sched_getaffinity(0))
    if not isolate or len(cores) < 2:
        return None
    return {cores[-1]} if node == nodes - 1 else set(cores[:-1])


def rate(launch: Launch, t0: float, t1: float) -> float:
    """Committed steps per second of ``launch`` between wall-clock times ``t0`` and ``t1``."""
    points = [(t, int(s["flexdemo/committed_steps"])) for t, s in launch.steps if t0 <= t <= t1]
    if len(points) < 2:
        return float("nan")
    (a, c0), (b, c1) = points[0], points[-1]
    return (c1 - c0) / (b - a)


def full_quorums(launch: Launch, nodes: int, *windows: tuple[float, float]) -> float:
    """Share of ``launch``'s logged steps inside the ``windows`` (wall-clock) whose quorum held all ``nodes``."""
    sizes = [int(s.get("flexdemo/live_replicas", 0)) for t, s in launch.steps if any(a <= t <= b for a, b in windows)]
    return sum(size == nodes for size in sizes) / max(len(sizes), 1)


def first_met(launch: Launch, nodes: int) -> float:
    """When ``launch`` first logged a step with every node (a node may start alone first)."""
    return next((t for t, s in launch.steps if int(s.get("flexdemo/live_replicas", 0)) == nodes), float("inf"))


def wait_for(nodes: list[Launch], condition) -> None:
    while not condition():
        for node in nodes:
            if node.proc.poll() is not None and node.proc.returncode:
                raise RuntimeError(f"a node failed:\n{''.join(node.tail)}")
        if all(node.proc.poll() is not None for node in nodes):
            return
        time.sleep(0.05)


def run(args, work: Path) -> dict:
    lighthouse = Lighthouse(args.heartbeat_ms, work / "lighthouse.log", join_timeout_ms=args.join_timeout_ms)
    optim_args = args.optim_args
    stop = threading.Event()
    nodes: list[Launch] = []
    slower = None
    try:
        nodes = [
            Launch(
                FT_CONFIG,
                work,
                args.steps,
                node_env(lighthouse, n, args.nodes),
                optim_args,
                ("--seed", str(args.seed), "--weight_decay", str(args.weight_decay)),
                SCRIPTS[args.script],
                args.processes,
                cores_of(n, args.nodes, args.isolate),
            )  # fmt: skip
            for n in range(args.nodes)
        ]
        # The even rate is taken once every node trains in the quorum (the slow node, alone on its core, may
        # start first and train alone).
        wait_for(nodes, lambda: first_met(nodes[0], args.nodes) < float("inf"))
        started, met_at = time.time(), nodes[0].committed()
        wait_for(nodes, lambda: nodes[0].committed() >= met_at + args.before)
        slow_from = time.time()
        if args.slow != "none":
            cycle = args.cycle or CYCLES[args.slow]
            duty = args.duty or DUTIES[args.slow]
            slower = threading.Thread(target=slow_down, args=(nodes[-1], duty, cycle, stop), daemon=True)
            slower.start()
        wait_for(nodes, lambda: time.time() >= slow_from + args.window)
        stop.set()
        if slower:
            slower.join()
        slower = None
        slow_to = time.time()
        for node in nodes:
            node.wait()
    finally:
        stop.set()
        if slower:
            slower.join()  # the slow node runs again
        for node in nodes:
            if node.proc.poll() is None:  # a failed run: no node is left behind, stopped or running
                node.kill()
        lighthouse.stop()
    ended = min(node.steps[-1][0] for node in nodes)
    fast = range(args.nodes - 1)
    before = [rate(nodes[n], started, slow_from) for n in fast]
    during = [rate(nodes[n], slow_from, slow_to) for n in fast]
    after = [rate(nodes[n], slow_to, ended) for n in fast]
    return {
        "steps_per_s_before": before,
        "steps_per_s_during": during,
        "steps_per_s_after": after,
        "during_vs_before": [d / b for d, b in zip(during, before)],
        "full_quorums_before": [full_quorums(nodes[n], args.nodes, (started, slow_from)) for n in range(args.nodes)],
        # Nobody slow: from the first step all met to the window, and from 10 s after it (the slow node back) on.
        "full_quorums_outside_window": [
            full_quorums(nodes[n], args.nodes, (first_met(nodes[n], args.nodes), slow_from), (slow_to + 10, ended))
            for n in range(args.nodes)
        ],
        "final_models_identical": len({model_digest(work / f"node{n}") for n in range(args.nodes)}) == 1,
        "ending_warnings": [line for node in nodes for line in node.said if "ended" in line or "stops waiting" in line],
        "catch_ups": [line.strip() for node in nodes for line in node.tail if "behind and caught up" in line],
        "sit_outs": [line.strip() for node in nodes for line in node.tail if "sat out:" in line],
        "window": [slow_from, slow_to],
        "timeline": [
            [(t, {k: v for k, v in s.items() if k.startswith("flexdemo/")}) for t, s in node.steps] for node in nodes
        ],
    }


def model_digest(node_dir: Path) -> str:
    """SHA-256 of the final model a node saved (each node of a fault-tolerant job saves its own)."""
    return hashlib.sha256((node_dir / "model.safetensors").read_bytes()).hexdigest()


def plot(result: dict, args, path: Path) -> None:
    """One row per node: the seconds of each step by quorum phase, the rest being the node's own compute."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timeline, (slow_from, slow_to) = result["timeline"], result["window"]
    t0 = min(steps[0][0] for steps in timeline if steps)
    fig, axes = plt.subplots(len(timeline), 1, figsize=(11, 2.2 * len(timeline)), sharex=True, squeeze=False)
    colors = dict(zip(("compute", *PHASES), plt.get_cmap("tab10").colors))
    for node, (ax, steps) in enumerate(zip(axes[:, 0], timeline)):
        for (prev, _), (t, figures) in zip(steps, steps[1:]):
            seconds = {phase: float(figures.get(f"flexdemo/seconds_{phase}", 0.0)) for phase in PHASES}
            seconds = {"compute": max(t - prev - sum(seconds.values()), 0.0), **seconds}
            bottom = 0.0
            for phase, value in seconds.items():
                ax.bar(prev - t0, value, width=t - prev, bottom=bottom, align="edge", color=colors[phase], lw=0)
                bottom += value
            if int(figures.get("flexdemo/live_replicas", len(timeline))) < len(timeline):
                ax.plot(t - t0, -0.15, marker="|", color="k", ms=4)
        ax.axvspan(slow_from - t0, slow_to - t0, color="0.9", zorder=-1)
        ax.set_ylabel(f"node{node}\ns per step")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    axes[0, 0].legend(handles, list(colors), ncol=len(colors), fontsize=7, loc="upper left")
    axes[-1, 0].set_xlabel("seconds (grey: the last node slowed; ticks: steps without every node)")
    fig.suptitle(
        f"{args.nodes} nodes x {args.processes} process(es), {args.script}, slow={args.slow}, "
        f"optim_args {args.optim_args}, Lighthouse heartbeat {args.heartbeat_ms} ms, join {args.join_timeout_ms} ms",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--processes", type=int, default=1, help="processes per node")
    parser.add_argument("--script", default="olmo2", choices=sorted(SCRIPTS))
    parser.add_argument("--slow", default="pause", choices=["pause", "compute", "none"])
    parser.add_argument("--duty", type=float, help="share of the time the slow node runs (default: by --slow)")
    parser.add_argument("--cycle", type=float, help="seconds of one run-and-stop cycle (default: by --slow)")
    parser.add_argument("--no-isolate", dest="isolate", action="store_false", help="every node on every core")
    parser.add_argument("--before", type=int, default=40, help="committed steps at the even rate first")
    parser.add_argument("--window", type=float, default=45.0, help="seconds the last node is slow")
    parser.add_argument("--steps", type=int, default=330)
    parser.add_argument(
        "--optim-args",
        default="fault_tolerance=torchft",
        help="every node's --optim_args (default: torchft's defaults; before issue 47 the runs below named "
        "join_quorum=when_ready,replay_steps=32, which are now the defaults)",
    )
    parser.add_argument("--heartbeat-ms", type=int, default=2000, help="the Lighthouse's --heartbeat_timeout_ms")
    parser.add_argument("--join-timeout-ms", type=int, default=500, help="the Lighthouse's --join_timeout_ms")
    parser.add_argument("--seed", type=int, default=42, help="the training script's seed (data order, init)")
    parser.add_argument("--weight-decay", type=float, default=0.0, help="the training script's --weight_decay")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "fault_tolerance" / "straggler.json"
    )
    parser.add_argument("--plot", type=Path, help="write the per-step timeline here (PNG)")
    parser.add_argument("--keep", type=Path, help="write the runs' logs here (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        result = run(args, work)
    settings = {key: str(value) for key, value in vars(args).items() if key not in ("out", "keep", "plot")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"settings": settings, "result": result}, indent=1))
    if args.plot:
        plot(result, args, args.plot)
    print(json.dumps({key: value for key, value in result.items() if key != "timeline"}, indent=1))


if __name__ == "__main__":
    main()
