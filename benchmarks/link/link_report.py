"""Table and plots from the link benchmark's results (``benchmarks/results/link/link.json``).

    .venv/bin/python benchmarks/link/link_report.py            # prints the Markdown table, writes the PNGs
    .venv/bin/python benchmarks/link/link_report.py --results benchmarks/results/link/link_batch2.json

Per run: median and mean step time (after two warm-up steps), speedup against AdamW-HSDP
at the same rate, node 0's bytes per step sent and received (FlexDeMo's counters, and the
link's own count), the time those bytes need at the link's rate, the model
``compute + bytes / rate``, and the validation loss against AdamW's. Plots: step time against bandwidth, and
validation loss against steps and against training time.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RATES = {"100mbit": 100e6, "1gbit": 1e9, "unlimited": None}
LABELS = {"100mbit": "100 Mbit/s", "1gbit": "1 Gbit/s", "unlimited": "unlimited"}


def per_step_mb(run: dict, direction: str) -> tuple[float | None, float]:
    """Node 0's inter-node MB per step, ``direction`` "sent" or "received": (FlexDeMo's counters, the link's count).

    The veth pair has two ends, so node 0 receives what node 1's end transmits.
    """
    counted = run["figures"].get(f"flexdemo/bytes_{direction}")
    on_link = run["link_tx_bytes"][0 if direction == "sent" else 1]
    return (None if counted is None else counted / run["steps"] / 1e6), on_link / run["steps"] / 1e6


def sent_per_step(run: dict) -> float:
    """Node 0's inter-node bytes per step: FlexDeMo's counters, else the link's count (AdamW)."""
    counted, on_link = per_step_mb(run, "sent")
    return 1e6 * (counted if counted is not None else on_link)


def link_seconds(run: dict) -> float | None:
    """The time node 0's bytes per step need at the link's rate (both directions run at once)."""
    rate = RATES[run["rate"]]
    return None if rate is None else 8 * sent_per_step(run) / rate


def compute_seconds(results: dict, config: str) -> float | None:
    """Step time without the exchange: the unlimited run's median minus the time spent waiting on it."""
    run = results.get(f"unlimited/{config}")
    if run is None:
        return None
    link_time = run["link_tx_bytes"][0] / run["steps"] / 1e9  # veth moves GB/s; a small correction
    return run["median_step_s"] - (run.get("median_comm_s") or link_time)


def predicted(results: dict, run: dict) -> float | None:
    rate = RATES[run["rate"]]
    # Variants (demo-bf16, demo-overlap) do the maths of their base scheme.
    compute = compute_seconds(results, run["config"]) or compute_seconds(results, run["config"].split("-")[0])
    if compute is None or rate is None:
        return compute
    return compute + link_seconds(run)


def speedup(baseline_s: float, run_s: float) -> str:
    ratio = baseline_s / run_s
    return f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower"


def table(results: dict) -> str:
    rows = [
        "| link | optimizer | median step (s) | mean step (s) | vs AdamW-HSDP | sent/step: counted, link (MB) | "
        "received/step: counted, link (MB) | bytes / rate (s) | compute + bytes/rate (s) | val. loss | loss vs AdamW |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for rate in RATES:
        adamw = results.get(f"{rate}/adamw")
        for run in (r for r in results.values() if r["rate"] == rate):
            is_baseline = run["config"] == "adamw" or adamw is None
            model, on_wire = predicted(results, run), link_seconds(run)
            traffic = []
            for direction in ("sent", "received"):
                counted, on_link = per_step_mb(run, direction)
                traffic.append(f"{'-' if counted is None else f'{counted:.2f}'}, {on_link:.2f}")
            cells = [
                LABELS[rate],
                run["config"],
                f"{run['median_step_s']:.2f}",
                f"{statistics.mean(run['step_times'][2:]):.2f}",  # DiLoCo's outer steps show here
                "-" if is_baseline else speedup(adamw["median_step_s"], run["median_step_s"]),
                *traffic,
                "-" if on_wire is None else f"{on_wire:.2f}",
                "-" if model is None else f"{model:.2f}",
                f"{run['eval_loss']:.3f}",
                "-" if is_baseline else f"{100 * (run['eval_loss'] / adamw['eval_loss'] - 1):+.1f}%",
            ]
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot_step_times(results: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    configs = sorted({r["config"] for r in results.values()})
    positions = {rate: i for i, rate in enumerate(RATES)}
    for config in configs:
        runs = [results[f"{rate}/{config}"] for rate in RATES if f"{rate}/{config}" in results]
        if not runs:
            continue
        xs = [positions[r["rate"]] for r in runs]
        line = ax.plot(xs, [r["median_step_s"] for r in runs], marker="o", label=config)[0]
        model = [predicted(results, r) for r in runs]
        if all(m is not None for m in model) and len(runs) > 1:
            ax.plot(xs, model, linestyle=":", color=line.get_color(), alpha=0.7)
    ax.set_xticks(range(len(RATES)), [LABELS[r] for r in RATES])
    ax.set_yscale("log")
    ax.set_ylabel("median step time (s), log scale")
    batch = next(iter(results.values()))["batch"]
    ax.set_title(f"T5-small, 2 machines x 2 processes (CPU), batch {batch}/process\ndotted: compute + bytes/bandwidth")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_losses(results: dict, rate: str, path: Path) -> None:
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(10, 4))
    for run in results.values():
        if run["rate"] != rate or not run.get("eval_history"):
            continue
        steps, losses = zip(*run["eval_history"])
        by_step.plot(steps, losses, marker="o", label=run["config"])
        by_time.plot([run["cumulative_s"][s - 1] for s in steps], losses, marker="o", label=run["config"])
    by_step.set_xlabel("optimizer step")
    by_time.set_xlabel(f"training time (s) at {LABELS[rate]}")
    for ax in (by_step, by_time):
        ax.set_ylabel("validation loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Validation loss, T5-small on the offline preset")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--results", default=str(Path(__file__).resolve().parents[1] / "results" / "link" / "link.json")
    )
    args = parser.parse_args()
    path = Path(args.results)
    results = json.loads(path.read_text())
    print(table(results))
    plot_step_times(results, path.with_name(f"{path.stem}_step_time.png"))
    for rate in ("100mbit", "1gbit"):
        if any(r["rate"] == rate for r in results.values()):
            plot_losses(results, rate, path.with_name(f"{path.stem}_loss_{rate}.png"))


if __name__ == "__main__":
    main()
