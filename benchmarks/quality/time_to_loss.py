"""The wire presets at a 1B model's scale: the modelled time to AdamW-HSDP's final loss, and the frontier plots.

For each preset of the quality study (``--study`` directories of ``benchmarks/quality/quality_study.py``) and each
``wire=`` preset, from the study's runs (the default rule, 3 seeds, each configuration at its chosen rate):

- **the loss**: the final validation loss against AdamW-HSDP's, and the first evaluation at which the mean
  curve over the seeds is at or below AdamW-HSDP's final mean loss (the study's resolution: ``steps / 10``);
- **the time, scaled to OLMo2-1B on 2 nodes**: a step costs its compute plus its inter-node bytes at the link's
  rate, ``t = compute + 8 * bytes / rate``, with no overlap of the two. The bytes are one node's for OLMo2-1B
  (``--wire_bytes``, written by ``benchmarks/quality/wire_presets.py``: each preset through the real wire; AdamW-HSDP's
  ring all-reduce of bf16 gradients sends the gradient once per node with 2 nodes). The compute is one rank of
  a node of 8 H100s (``benchmarks/step/gpu_step.py --node_of 8``, BENCHMARKS.md; the model is ``olmo2_1b_step.py``):
  its forward and backward of 4 x 2048 tokens plus AdamW's step on its shards, or plus the default rule's step (the
  same for every wire preset; FSDP2's in-node collectives, which both pay alike, are left out). The steps are the
  small preset's: the model is scaled, the number of steps to the loss is assumed to carry over. The result is
  ``steps to AdamW-HSDP's loss x t(preset) / (AdamW-HSDP's steps x t(AdamW-HSDP))``: below 1, the preset gets
  there first.

It also draws the frontier, one PNG per study preset: each configuration's loss against AdamW-HSDP's, over the
bytes it sends per step (as "x fewer than dense", the study's own models), the default rule and the sign rule.

    .venv/bin/python benchmarks/quality/time_to_loss.py --study benchmarks/results/quality/quality_olmo2 \\
        benchmarks/results/quality/quality_olmo2_ft benchmarks/results/quality/quality_t5 \\
        --out benchmarks/results/quality/time_to_loss
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from olmo2_1b_step import RATES, STEP_MS, step_seconds
from quality_study import CONFIGS, mean_curve, summarize

ROOT = Path(__file__).resolve().parents[2]
PRESET_CONFIGS = {  # wire= preset: the study's configuration with the default rule (the same coefficients)
    "demo": "demo_ortho_adam",
    "top96_2bit": "demo_top96_2bit_ortho_adam",
    "2bit": "demo_2bit_ortho_adam",
    "top24_2bit": "demo_top24_2bit_ortho_adam",
    "top4_1bit": "demo_aggressive_ortho_adam",
}
OUTER_STEP_POINTS = {  # a study configuration that sends a wire= preset's coefficients every H steps: (preset, H)
    "sparseloco_h4_2bit_ortho_adam": ("2bit", 4),  # SparseLoCo with Muon's step inside (issue 45)
}


def preset_config(table: dict, model: str, preset: str) -> str:
    """The study's configuration for a preset: the preset as a user names it (``wire_<preset>_ortho_adam``, its
    rate swept on this code) where it ran 3 seeds, else its twin (the same coefficients; older runs)."""
    named = f"wire_{preset}_ortho_adam"
    row = table.get((model, named))
    return named if row and row["seeds"] >= 3 else PRESET_CONFIGS[preset]


def steps_to(row: dict, target: float) -> int | None:
    """The first evaluation's step at which ``row``'s mean curve is at or below ``target``; None if never."""
    return next((step for step, loss in mean_curve(row) if loss <= target), None)


def study_runs(study: Path, also: list[Path] = ()) -> list[dict]:
    """The runs of ``study``, and those of the same model in the ``also`` directories (probes kept apart)."""
    runs = json.loads((study / "runs.json").read_text())
    models = {run["model"] for run in runs}
    for extra in also:
        runs += [run for run in json.loads((extra / "runs.json").read_text()) if run["model"] in models]
    return runs


def modelled(study: Path, wire_bytes: dict, also: list[Path] = ()) -> list[dict]:
    """One record per wire preset run in ``study``, and per outer-step point (:data:`OUTER_STEP_POINTS`): its loss
    against AdamW-HSDP and its time ratio per link."""
    table = summarize(study_runs(study, also))
    model = next(m for m, _ in table)
    adamw = table[(model, "adamw_hsdp")]
    total_steps, target = mean_curve(adamw)[-1]
    points = [(preset, preset_config(table, model, preset), wire_bytes[preset]) for preset in PRESET_CONFIGS]
    points += [
        (f"{preset} every {h}", config, wire_bytes[preset] / h) for config, (preset, h) in OUTER_STEP_POINTS.items()
    ]
    records = []
    for label, config, sent in points:
        row = table.get((model, config))
        if row is None:
            continue
        reached = steps_to(row, target)
        record = {
            "study": model,
            "wire": label,
            "config": config,
            "seeds": row["seeds"],
            "vs_adamw": row["vs_adamw"],
            "steps_to_adamw_loss": reached,
            "adamw_steps": total_steps,
        }
        for rate_name, rate in RATES.items():
            adamw_s = step_seconds("adamw", wire_bytes["dense_bytes"], rate)
            # (an outer-step point's inner step is the default rule's Newton-Schulz, most of that step's time)
            step_s = step_seconds("flexdemo", sent, rate)
            ratio = None if reached is None else reached * step_s / (total_steps * adamw_s)
            record[f"x_adamw_time {rate_name}"] = ratio
            record[f"x_adamw_run {rate_name}"] = step_s / adamw_s  # the same steps: the whole run's time
            record[f"step_s {rate_name}"] = step_s
            record[f"adamw_step_s {rate_name}"] = adamw_s
        # The link at which a step of each takes as long: above it AdamW-HSDP's smaller compute wins.
        extra_compute = (STEP_MS["flexdemo"] - STEP_MS["adamw"]) / 1e3
        record["break_even_gbit"] = 8 * (wire_bytes["dense_bytes"] - sent) / extra_compute / 1e9
        records.append(record)
    return records


def borrow_baseline(table: dict, group: set[str]) -> None:
    """Rows of a layout without its own AdamW-HSDP run are measured against the other layout's (simulated and
    real-node AdamW-HSDP agree within 0.1% at 10x: BENCHMARKS.md)."""
    baselines = [table[(m, "adamw_hsdp")] for m in sorted(group) if (m, "adamw_hsdp") in table]
    for (m, _), row in table.items():
        if m in group and "vs_adamw" not in row and baselines:
            row["vs_adamw"] = row["loss_mean"] / baselines[0]["loss_mean"] - 1


def frontier_plot(study: Path, out: Path, min_seeds: int = 3, also: list[Path] = ()) -> Path:
    """Loss against AdamW-HSDP's over "x fewer bytes than dense", the default rule's wires and the sign rule's, and
    what sending nothing reaches (``scheme=none``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = summarize(study_runs(study, also))
    model = next(m for m, _ in table)
    # The same model run another way in the same study (olmo2_10x_nodes: olmo2_10x on real nodes, for what one
    # process cannot simulate), each point against its own AdamW-HSDP
    group = {m for m, _ in table if m in (model, f"{model}_nodes")}
    borrow_baseline(table, group)
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, pick, marker in [
        (
            "default rule (orthogonal + adam)",
            lambda n: n.endswith("_ortho_adam") and n.startswith(("demo", "wire")),
            "o",
        ),
        ("default rule, another decay", lambda n: "_ortho_adam_decay" in n, "x"),
        ("update=sign", lambda n: n.startswith("demo") and "_ortho" not in n and not n.endswith("_adam"), "s"),
        (
            "SparseLoCo / DiLoCo, AdamW inside",
            lambda n: n.startswith(("sparseloco", "diloco")) and "_ortho" not in n,
            "^",
        ),
        ("SparseLoCo, the default rule's step inside", lambda n: n.startswith("sparseloco") and "_ortho" in n, "v"),
    ]:
        points = [
            (row["ratio_to_dense"], 100 * row["vs_adamw"], name.removesuffix("_ortho_adam") + m.removeprefix(model))
            for (m, name), row in table.items()
            if m in group
            and pick(name)
            and "ratio_to_dense" in row
            and "vs_adamw" in row
            and row["seeds"] >= min_seeds  # a seed-0 probe is left out
        ]
        if not points:
            continue
        points.sort()
        xs, ys, names = zip(*points)
        ax.plot(xs, ys, marker=marker, linestyle="-" if marker == "o" else "none", label=label)
        for x, y, name in points:
            ax.annotate(name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    presets = preset_points(study, table, model)
    if presets:
        xs, ys, names = zip(*presets)
        ax.plot(xs, ys, marker="D", linestyle="--", label="wire= presets (Elias-Fano indices: same loss, fewer bytes)")
        for x, y, name in presets:
            ax.annotate(name, (x, y), fontsize=7, xytext=(3, -9), textcoords="offset points")
    ax.axhline(0, color="black", linewidth=1)
    ax.axhline(3, color="grey", linewidth=0.8, linestyle=":")
    for config, colour, label in [
        ("none_ortho_adam", "red", "nothing sent (scheme=none, default rule): a wire must end below it"),
        ("full_ortho_adam", "green", "everything sent (scheme=full, default rule): what a wire can reach"),
    ]:
        row = next((table[(m, config)] for m in sorted(group) if (m, config) in table), None)
        if row and row["seeds"] >= min_seeds and "vs_adamw" in row:
            ax.axhline(100 * row["vs_adamw"], color=colour, linewidth=1, linestyle="--", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("x fewer bytes per step than AdamW-HSDP's dense all-reduce (log)")
    ax.set_ylabel("final validation loss against AdamW-HSDP (%; below 0 is better)")
    seeds = f"{min_seeds} seeds" if min_seeds > 1 else "1 to 3 seeds, means"
    title = f"{' and '.join(sorted(group))}: loss against bytes, {seeds}, rates swept (dotted: +3%)"
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / f"{model}_frontier.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def preset_points(study: Path, table: dict, model: str) -> list[tuple[float, float, str]]:
    """Each ``wire=`` preset at its own bytes (``quality_study.py --wire_bytes``) and its loss (:func:`preset_config`:
    its own runs, or its twin's, which send the same coefficients; bitwise: tests/test_optimizer_single.py)."""
    path = study / "wire_bytes.json"
    measured = json.loads(path.read_text()) if path.exists() else {}
    points = []
    for preset in PRESET_CONFIGS:
        config = preset_config(table, model, preset)
        sent, row = measured.get(f"wire_{preset}_ortho_adam"), table.get((model, config))
        if not row or "vs_adamw" not in row:
            continue
        if sent:
            points.append((sent["dense_bytes_per_step"] / sent["bytes_per_step"], 100 * row["vs_adamw"], preset))
        elif "ratio_to_dense" in row and (config.startswith("wire_") or "elias_fano" in CONFIGS[config][1]):
            # runs at the preset's own bytes
            points.append((row["ratio_to_dense"], 100 * row["vs_adamw"], preset))
    return sorted(points)


def print_table(records: list[dict]) -> None:
    print(
        "| preset | `wire=` | loss vs AdamW-HSDP | steps to its final loss | time to it, x AdamW-HSDP's run: "
        "100 Mbit/s, 1 Gbit/s | the same steps, x AdamW-HSDP's time: 100 Mbit/s, 1 Gbit/s | faster below |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in records:
        steps = r["steps_to_adamw_loss"]
        reached = "not reached" if steps is None else f"{steps} of {r['adamw_steps']}"
        to_loss = ", ".join(
            "-" if r[f"x_adamw_time {rate}"] is None else f"{r[f'x_adamw_time {rate}']:.3f}" for rate in RATES
        )
        run = ", ".join(f"{r[f'x_adamw_run {rate}']:.3f}" for rate in RATES)
        print(
            f"| {r['study']} | `{r['wire']}` | {r['vs_adamw']:+.1%} | {reached} | {to_loss} | {run} "
            f"| {r['break_even_gbit']:.0f} Gbit/s |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study", type=Path, nargs="+", required=True, help="quality_study.py output directories")
    parser.add_argument(
        "--wire_bytes", type=Path, default=ROOT / "benchmarks" / "results" / "quality" / "wire_presets.json"
    )
    parser.add_argument("--out", type=Path, required=True, help="where the JSON and the frontier PNGs go")
    parser.add_argument(
        "--also", type=Path, nargs="*", default=[], help="study directories of probes, merged into their model's study"
    )
    parser.add_argument("--min_seeds", type=int, default=3, help="a configuration with fewer seeds is left out")
    args = parser.parse_args()
    presets = json.loads(args.wire_bytes.read_text())
    wire_bytes = {p["wire"]: p["bytes_per_step"] for p in presets["presets"]} | {"dense_bytes": presets["dense_bytes"]}
    args.out.mkdir(parents=True, exist_ok=True)
    records = [r for study in args.study for r in modelled(study, wire_bytes, args.also)]
    for study in args.study:
        print(f"frontier: {frontier_plot(study, args.out, args.min_seeds, args.also)}")
    print_table(records)
    clean = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in records]
    (args.out / "time_to_loss.json").write_text(json.dumps(clean, indent=1))


if __name__ == "__main__":
    main()
