"""FlexDeMo against AdamW with HSDP across a rate-limited link between two simulated machines.

    .venv/bin/python benchmarks/link/link_benchmark.py                 # the full matrix (about an hour here)
    .venv/bin/python benchmarks/link/link_benchmark.py --rates 1gbit --configs adamw demo --steps 6

Two network namespaces joined by a veth pair (``tc tbf`` on both ends) are the two
machines; each runs ``accelerate launch --num_machines 2 --machine_rank i`` with 2
processes, so the rendezvous and every inter-node byte cross the limited link. Every run
trains ``training_scripts/train_t5.py``'s offline preset at T5-small size (60.5M
parameters) for ``--steps`` steps through ``benchmarks/link/link_worker.py``, and reports the
median step time, the bytes node 0 sent (FlexDeMo's counters and the link's own count from
``ip -s link``), and the validation loss. Results go to ``--out`` as JSON;
``benchmarks/link/link_report.py`` turns them into the table and plots of ``BENCHMARKS.md``.
Needs root and iproute2. Traffic only goes to the namespaces this script creates, which are
removed afterwards, also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from netns import NamespacePair, unavailable_reason

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "benchmarks" / "link" / "configs" / "cpu_2machines.yaml"

CONFIGS: dict[str, list[str]] = {
    "adamw": ["--optim", "adamw_torch"],
    "default": ["--optim", "flexdemo"],  # the package default: wire top128_4bit, the orthogonal rule
    "demo": ["--optim", "flexdemo", "--optim_args", "wire=demo,update=sign"],
    "demo-bf16": ["--optim", "flexdemo", "--optim_args", "value_dtype=bf16,update=sign"],
    "demo-overlap": ["--optim", "flexdemo", "--optim_args", "wire=demo,overlap=true,update=sign"],
    "demo-ortho-adam": ["--optim", "flexdemo", "--optim_args", "wire=demo"],  # the default rule on DeMo's wire
    "random": ["--optim", "flexdemo", "--optim_args", "scheme=random"],
    "diloco": ["--optim", "flexdemo", "--optim_args", "scheme=diloco,inner_steps=5"],
    "none": ["--optim", "flexdemo", "--optim_args", "scheme=none,update=sign"],
}
"""What each run trains with; "none" (no inter-node communication at all) is the floor. The DeMo runs
recorded in BENCHMARKS.md took sign steps on DeMo's wire (the defaults then), so they name both."""

DEFAULT_MATRIX = {
    "unlimited": ["adamw", "demo", "random", "diloco", "none"],
    "1gbit": ["adamw", "demo", "random", "diloco"],
    "100mbit": ["adamw", "demo", "demo-bf16", "random", "diloco"],
}
"""BENCHMARKS.md's main table; demo-overlap has its own run (--configs demo demo-overlap)."""


def training_args(steps: int, batch: int, output_dir: Path, model_size: str = "t5-small") -> list[str]:
    return [
        "--preset", "offline", "--model_size", model_size, "--output_dir", str(output_dir),
        "--max_steps", str(steps), "--per_device_train_batch_size", str(batch),
        "--learning_rate", "1e-3", "--warmup_steps", "2", "--logging_steps", "1",
        "--eval_strategy", "steps", "--eval_steps", str(max(steps // 4, 1)), "--max_eval_samples", "64",
        "--predict_with_generate", "false", "--report_to", "none", "--seed", "0",
    ]  # fmt: skip


def run_one(
    pair: NamespacePair,
    name: str,
    steps: int,
    batch: int,
    work: Path,
    port: int,
    model_size: str = "t5-small",
    timeout_s: float = 3600,
) -> dict:
    """Train config ``name`` across the two namespaces; returns node 0's result and link counts."""
    result_path = work / f"{name}.json"
    result_path.unlink(missing_ok=True)
    before = [pair.tx_bytes(node) for node in (0, 1)]
    processes = []
    for node in (0, 1):
        env = dict(
            os.environ,
            GLOO_SOCKET_IFNAME=pair.interfaces[node],  # otherwise gloo binds to 127.0.0.1
            OMP_NUM_THREADS="1",
            TOKENIZERS_PARALLELISM="false",
            HF_HUB_OFFLINE="1",
            PYTHONWARNINGS="ignore",
        )
        cmd = [
            *pair.exec_prefix(node), sys.executable, "-m", "accelerate.commands.launch",
            "--config_file", str(CONFIG), "--machine_rank", str(node),
            "--main_process_ip", pair.addresses[0], "--main_process_port", str(port),
            str(ROOT / "benchmarks" / "link" / "link_worker.py"), "--result", str(result_path),
            *training_args(steps, batch, work / name, model_size), *CONFIGS[name],
        ]  # fmt: skip
        log = open(work / f"{name}.node{node}.log", "w")
        # Own session: the launcher and its training processes can be killed as one group.
        popen = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        processes.append((popen, log))
    start = time.perf_counter()
    try:
        # One node failing leaves the other waiting in gloo: bound the wait.
        codes = [p.wait(timeout=max(timeout_s - (time.perf_counter() - start), 1)) for p, _ in processes]
    except subprocess.TimeoutExpired as err:
        raise RuntimeError(f"{name}: no result after {timeout_s} s; see {work}/{name}.node*.log") from err
    finally:
        for p, log in processes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            log.close()
    if any(codes):
        raise RuntimeError(f"{name}: launches exited with {codes}; see {work}/{name}.node*.log")
    result = json.loads(result_path.read_text())
    result["wall_s"] = time.perf_counter() - start
    result["link_tx_bytes"] = [pair.tx_bytes(node) - before[node] for node in (0, 1)]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", nargs="*", default=list(DEFAULT_MATRIX), help="unlimited, 1gbit, 100mbit")
    parser.add_argument("--configs", nargs="*", help=f"subset of {list(CONFIGS)} (default: the matrix)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="per process")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "link" / "link.json"))
    parser.add_argument("--work", default="/tmp/flexdemo-link-benchmark")
    args = parser.parse_args()

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"link benchmark: cannot create network namespaces here: {reason}.")
    out, work = Path(args.out), Path(args.work)
    out.parent.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    results = json.loads(out.read_text()) if out.exists() else {}
    mixed = {key for key, r in results.items() if (r["batch"], r["steps"]) != (args.batch, args.steps)}
    if mixed:
        raise SystemExit(
            f"link benchmark: {out} holds runs with another --batch/--steps ({sorted(mixed)}); "
            "ratios are only meaningful within one setting. Pass a different --out."
        )
    port = 29600
    for rate in args.rates:
        names = args.configs or DEFAULT_MATRIX[rate]
        with NamespacePair(None if rate == "unlimited" else rate) as pair:
            for name in names:
                port += 1  # a fresh rendezvous port per run: no TIME_WAIT collisions
                print(f"[{rate}] {name} ...", flush=True)
                result = run_one(pair, name, args.steps, args.batch, work, port)
                result.update(rate=rate, config=name, batch=args.batch)
                results[f"{rate}/{name}"] = result
                out.write_text(json.dumps(results, indent=1))  # keep what finished if a later run fails
                print(
                    f"[{rate}] {name}: median step {result['median_step_s']:.2f} s, "
                    f"eval loss {result['eval_loss']:.3f}, node 0 sent {result['link_tx_bytes'][0] / 1e6:.1f} MB "
                    f"on the link ({result['figures'].get('flexdemo/bytes_sent', 0) / 1e6:.1f} MB counted)",
                    flush=True,
                )


if __name__ == "__main__":
    main()
