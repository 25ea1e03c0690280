"""What a lagging node's catch-up moves: replayed payloads against a copy of the whole state (issue 26).

Two nodes of 2 processes (`accelerate launch --config_file accelerate_configs/cpu_ft_node.yaml
training_scripts/train_t5.py --preset offline`, ``fault_tolerance=torchft``, a real
``torchft_lighthouse``). Node 1 is frozen (SIGSTOP of its launcher and workers) twice while node 0
trains on alone: first for ``--short-steps`` of node 0's commits (it then replays them), then for
more than ``replay_steps`` (it then copies the whole state). Read from node 1's own lines: the
steps it missed and the bytes each catch-up moved to one process, against a copy's.

    .venv/bin/python benchmarks/fault_tolerance/catch_up.py --out benchmarks/results/fault_tolerance/catch_up.json
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness

from harness import FT_CONFIG, ROOT, Launch, Lighthouse  # noqa: E402

REPLAY = re.compile(
    r"missed (\d+) committed step\(s\) and catches up .*\(([\d.]+) MB on this process; .* ([\d.]+) MB\)"
)
COPY = re.compile(r"took the parameters .*\((\d+) steps committed by the quorum; ([\d.]+) MB to this process\)")


def signal_node(launch: Launch, sig) -> None:
    launcher = psutil.Process(launch.proc.pid)
    for process in [launcher, *launcher.children(recursive=True)]:
        try:
            process.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def wait_for(condition, what: str, nodes: list[Launch], timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while not condition():
        ended = [n for n in nodes if n.proc.poll() is not None]
        if ended or time.time() > deadline:
            raise RuntimeError(f"waiting for {what}:\n" + "".join(ended[0].tail if ended else nodes[0].tail))
        time.sleep(0.1)


def freeze(nodes: list[Launch], alone_steps: int) -> None:
    """Freeze node 1 until node 0 has committed ``alone_steps`` steps without it, then let it run and rejoin."""
    start = nodes[0].committed()
    signal_node(nodes[1], signal.SIGSTOP)

    # Node 0's step with node 1 in its quorum fails after ft_timeout; then it trains alone.
    def alone() -> int:
        logged = [s for _, s in nodes[0].steps]
        return sum(s["flexdemo/live_replicas"] == 1 and s["flexdemo/committed_steps"] > start for s in logged)

    wait_for(lambda: alone() >= alone_steps, f"node 0 to commit {alone_steps} steps alone", nodes[:1])
    ahead = nodes[0].committed()
    signal_node(nodes[1], signal.SIGCONT)
    wait_for(lambda: nodes[1].committed() > ahead, "node 1 to commit with node 0 again", nodes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--replay-steps", type=int, default=8)
    parser.add_argument("--short-steps", type=int, default=3, help="node 0's commits alone in the first freeze")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "fault_tolerance" / "catch_up.json"
    )
    args = parser.parse_args()
    optim_args = f"fault_tolerance=torchft,ft_timeout=5,quorum_timeout=120,replay_steps={args.replay_steps}"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        lighthouse = Lighthouse(2000, work / "lighthouse.log")
        try:
            env = {"TORCHFT_LIGHTHOUSE": lighthouse.address, "NUM_REPLICA_GROUPS": "2"}
            nodes = [
                Launch(FT_CONFIG, work, args.steps, env | {"REPLICA_GROUP_ID": str(n)}, optim_args) for n in (0, 1)
            ]
            together = lambda: min(n.committed() for n in nodes) >= 10  # noqa: E731
            wait_for(together, "both nodes to commit 10 steps", nodes)
            freeze(nodes, args.short_steps)
            freeze(nodes, args.replay_steps + 4)
            for node in nodes:
                node.wait()
        finally:
            lighthouse.stop()
    said = nodes[1].said
    replays = [
        dict(zip(("steps", "moved_mb", "copy_mb"), map(float, m.groups()))) for m in map(REPLAY.search, said) if m
    ]
    copies = [dict(zip(("at_step", "moved_mb"), map(float, m.groups()))) for m in map(COPY.search, said) if m]
    summary = {
        "replays": replays,
        "copies": copies,
        "replay_vs_copy": [r["moved_mb"] / r["copy_mb"] for r in replays],
        "node1_lines": said,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"settings": {k: v for k, v in vars(args).items() if k != "out"}, **summary}, indent=1)
    )
    print(json.dumps({k: v for k, v in summary.items() if k != "node1_lines"}, indent=1))


if __name__ == "__main__":
    main()
