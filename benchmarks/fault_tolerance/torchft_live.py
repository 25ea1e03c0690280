"""What live fault tolerance (torchft) costs and how fast it recovers: 2 nodes x 2 processes.

Each node is `accelerate launch --config_file accelerate_configs/cpu_ft_node.yaml
training_scripts/train_t5.py --preset offline` with ``fault_tolerance=torchft``, and a real
``torchft_lighthouse`` joins them. Every logged step (``--logging_steps 1``) is timestamped as
its line arrives. Two experiments, repeated:

- **idle**: nothing fails. The median step time with fault tolerance against the same job
  without it (one launch of ``cpu_2x2.yaml``: the same 2 x 2 layout), run back to back.
- **outage**: node 1 (its launcher and workers) is SIGKILLed at a step, relaunched
  ``--down`` seconds later. Measured: from the kill to the survivor's first step committed
  without node 1;
  from the relaunch (process start) to node 1's first step back in the quorum; the
  survivor's step time while alone against before. A plot of committed steps against
  wall-clock time shows the outage.

    .venv/bin/python benchmarks/fault_tolerance/torchft_live.py --repeats 3 \\
        --out benchmarks/results/fault_tolerance/fault_tolerance.json
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

from harness import FT_CONFIG, PLAIN_CONFIG, ROOT, Launch, Lighthouse, ft_env, step_times  # noqa: E402

# The figures in BENCHMARKS.md: the sign rule at the preset's rate then (both defaults at the time).
FT_ARGS = "fault_tolerance=torchft,ft_timeout=10,quorum_timeout=60,update=sign"


def idle(work: Path, steps: int, heartbeat_ms: int) -> dict:
    """Median step time of node 0 with fault tolerance, then the same job without."""
    ft = idle_ft_step(work / "idle", steps, heartbeat_ms, FT_ARGS)
    plain = Launch(PLAIN_CONFIG, work / "idle_plain", steps, {}, "")
    plain.wait()
    base = statistics.median(step_times(plain.steps))
    return {"ft_step_s": ft, "plain_step_s": base, "overhead": ft / base - 1}


def idle_ft_step(work: Path, steps: int, heartbeat_ms: int, optim_args: str) -> float:
    """Node 0's median step time over the steps both nodes trained together, nothing failing."""
    lighthouse = Lighthouse(heartbeat_ms, work.with_name(work.name + "_lighthouse.log"))
    try:
        nodes = [
            Launch(FT_CONFIG, work.with_name(f"{work.name}{n}"), steps, ft_env(lighthouse, n), optim_args)
            for n in (0, 1)
        ]
        for node in nodes:
            node.wait()
    finally:
        lighthouse.stop()
    # Both nodes start on their own: count only steps where the two trained together.
    together = [s for s in nodes[0].steps if s[1].get("flexdemo/live_replicas") == 2]
    return statistics.median(step_times(together))


def replay_cost(work: Path, steps: int, heartbeat_ms: int, none_first: bool) -> dict:
    """What keeping steps to replay costs when nothing fails: the default replay_steps against none (0),
    run back to back (the kept payloads, and the in-node all-reduce at each commit), in turn first."""
    work.mkdir(parents=True, exist_ok=True)
    order = [("replay_none", ",replay_steps=0"), ("replay_default", "")]
    times = {
        name: idle_ft_step(work / name, steps, heartbeat_ms, FT_ARGS + extra)
        for name, extra in (order if none_first else order[::-1])
    }
    kept, none = times["replay_default"], times["replay_none"]
    return {"replay_default_step_s": kept, "replay_none_step_s": none, "replay_cost": kept / none - 1}


def outage(work: Path, steps: int, heartbeat_ms: int, kill_at: int, down_s: float) -> dict:
    lighthouse = Lighthouse(heartbeat_ms, work / "lighthouse_outage.log")
    try:
        nodes = [Launch(FT_CONFIG, work / f"outage{n}", steps, ft_env(lighthouse, n), FT_ARGS) for n in (0, 1)]
        while nodes[1].committed() < kill_at:
            if nodes[1].proc.poll() is not None:
                raise RuntimeError("node 1 ended before the kill:\n" + "".join(nodes[1].tail))
            time.sleep(0.05)
        killed = nodes[1].kill()
        time.sleep(down_s)
        relaunch = Launch(FT_CONFIG, work / "outage1", steps, ft_env(lighthouse, 1), FT_ARGS)
        nodes[0].wait()
        relaunch.wait()
    finally:
        lighthouse.stop()
    point = lambda steps: [(t, s["flexdemo/committed_steps"], s["flexdemo/live_replicas"]) for t, s in steps]  # noqa: E731
    timeline = {
        "killed": killed,
        "relaunched": relaunch.started,
        "node0": point(nodes[0].steps),
        "node1": point(nodes[1].steps),
        "node1_again": point(relaunch.steps),
    }
    return {**outage_metrics(timeline), "timeline": timeline}


def outage_metrics(timeline: dict) -> dict:
    """The outage's figures from the recorded timeline: (time, committed steps, live replicas) per logged step."""
    killed, relaunched, survivor = timeline["killed"], timeline["relaunched"], timeline["node0"]
    committed_at_kill = max(c for t, c, _ in survivor if t <= killed)
    # The first step the survivor commits without the dead node (a step in flight at the kill may still commit).
    next_commit = next(t for t, c, live in survivor if t > killed and c > committed_at_kill and live == 1)
    alone = [(t, None) for t, _, _ in survivor if next_commit <= t < relaunched]
    before = [(t, None) for t, _, live in survivor if t < killed and live == 2]
    back = next(t for t, _, live in timeline["node1_again"] if live == 2)
    return {
        "survivor_next_commit_s": next_commit - killed,
        "rejoin_s": back - relaunched,
        "alone_step_s": statistics.median(step_times(alone, skip=1)),
        "together_step_s": statistics.median(step_times(before)),
    }


def plot(timeline: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = timeline["node0"][0][0]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for key, label, style in (
        ("node0", "node 0 (survivor)", dict(linewidth=3, alpha=0.5)),
        ("node1", "node 1", dict(linewidth=1.5)),
        ("node1_again", "node 1, relaunched (from its first step)", dict(marker="x", markevery=10, linewidth=1)),
    ):
        points = timeline[key]
        ax.plot([t - t0 for t, _, _ in points], [c for _, c, _ in points], label=label, **style)
    ax.axvline(timeline["killed"] - t0, color="red", linestyle=":", label="node 1 SIGKILLed")
    ax.axvline(timeline["relaunched"] - t0, color="green", linestyle=":", label="node 1 relaunched")
    ax.set_xlabel("wall-clock time (s)")
    ax.set_ylabel("steps committed by the quorum")
    ax.set_title("FlexDeMo + torchft, 2 nodes x 2 processes (T5 offline preset, CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def summarize(runs: dict) -> dict:
    """Medians over the repeats (outage figures recomputed from the recorded timelines)."""
    outages = [outage_metrics(r["timeline"]) for r in runs["outage"]]
    summary = {
        key: statistics.median(r[key] for r in runs["idle"]) for key in ("ft_step_s", "plain_step_s", "overhead")
    }
    summary |= {key: statistics.median(o[key] for o in outages) for key in outages[0]}
    summary["overheads"] = [r["overhead"] for r in runs["idle"]]
    summary["survivor_next_commit_each_s"] = [o["survivor_next_commit_s"] for o in outages]
    summary["rejoin_each_s"] = [o["rejoin_s"] for o in outages]
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=120, help="steps of each idle run")
    parser.add_argument("--outage-steps", type=int, default=200)
    parser.add_argument("--kill-at", type=int, default=30, help="node 1 dies after this many committed steps")
    parser.add_argument("--down", type=float, default=5.0, help="seconds node 1 stays down")
    parser.add_argument("--heartbeat-ms", type=int, default=2000, help="the Lighthouse's --heartbeat_timeout_ms")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "fault_tolerance" / "fault_tolerance.json"
    )
    parser.add_argument("--summarize", action="store_true", help="recompute the summary and plot of --out only")
    parser.add_argument("--replay-cost", action="store_true", help="only the cost of replay_steps when nothing fails")
    args = parser.parse_args()
    if args.summarize:
        recorded = json.loads(args.out.read_text())
        recorded["summary"] = summarize(recorded["runs"])
        args.out.write_text(json.dumps(recorded))
        plot(recorded["runs"]["outage"][0]["timeline"], args.out.with_suffix(".png"))
        print(json.dumps(recorded["summary"], indent=1))
        return
    if args.replay_cost:
        with tempfile.TemporaryDirectory() as tmp:
            runs = []
            for repeat in range(args.repeats):
                runs.append(replay_cost(Path(tmp) / str(repeat), args.steps, args.heartbeat_ms, repeat % 2 == 0))
                print(json.dumps(runs[-1]), flush=True)
        summary = {key: statistics.median(r[key] for r in runs) for key in runs[0]} | {"runs": runs}
        args.out.write_text(json.dumps({"settings": vars(args) | {"out": str(args.out)}, "summary": summary}))
        print(json.dumps(summary, indent=1))
        return
    runs = {"idle": [], "outage": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            work = Path(tmp) / str(repeat)
            work.mkdir()
            runs["idle"].append(idle(work, args.steps, args.heartbeat_ms))
            runs["outage"].append(outage(work, args.outage_steps, args.heartbeat_ms, args.kill_at, args.down))
            print(json.dumps({k: v[-1] for k, v in runs.items()}, default=str)[:600], flush=True)
    summary = summarize(runs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"settings": vars(args) | {"out": str(args.out)}, "summary": summary, "runs": runs}))
    plot(runs["outage"][0]["timeline"], args.out.with_suffix(".png"))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
