"""The long-run study's report (issue 64; ``benchmarks/quality/long_study.py`` runs it): README.md and a PNG per
configuration in the study directory, from its ``runs.json``."""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import long_run
from long_run import (
    BASELINES,
    DEFAULT_CONFIG,
    FRACTIONS,
    LONG_CONFIGS,
    LONG_PRESETS,
    NODES,
    LongPreset,
    StudyDir,
    bracket,
    done,
    winner,
)
from olmo2_1b_step import RATES, step_seconds


def label(config: str) -> str:
    return f"default ({config})" if config == DEFAULT_CONFIG else config


def mean_curve(runs: list[dict]) -> list[tuple[int, float]]:
    """(tokens, eval loss averaged over the runs) at every evaluation all of them reached."""
    curves = [{e["tokens"]: e["eval_loss"] for e in r["evals"]} for r in runs]
    common = sorted(set.intersection(*(set(c) for c in curves)))
    return [(t, statistics.mean(c[t] for c in curves)) for t in common]


def loss_at(curve: list[tuple[int, float]], tokens: float) -> float:
    """The curve's loss at ``tokens``, linear between evaluations."""
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if t0 <= tokens <= t1:
            return l0 + (l1 - l0) * (tokens - t0) / (t1 - t0)
    if curve and tokens == curve[0][0]:
        return curve[0][1]
    raise ValueError(f"long run: {tokens:g} tokens lie outside the curve's {curve[0][0]}..{curve[-1][0]}")


def gaps(curve, baseline, total_tokens: int, fractions=FRACTIONS) -> dict[float, float | None]:
    """``curve``'s loss against ``baseline``'s (relative; below 0 is better) at each fraction of the run; None
    before the first evaluation."""
    first = max(curve[0][0], baseline[0][0])
    return {
        f: loss_at(curve, f * total_tokens) / loss_at(baseline, f * total_tokens) - 1
        for f in fractions
        if f * total_tokens >= first
    } | {f: None for f in fractions if f * total_tokens < first}


def summary(rows: list[dict]) -> dict[str, dict]:
    """Per configuration: its bracket on seed 0, the winner, and the seeds' runs at the winner."""
    table = {}
    for config in LONG_CONFIGS:
        mine = [r for r in rows if r["config"] == config]
        best = winner(rows, config)
        if best is None:
            if mine:
                table[config] = {"bracket": mine, "lr": None, "runs": []}
            continue
        runs = [r for r in mine if r["lr"] == best["lr"] and not r["diverged"]]
        finals = [r["final_eval_loss"] for r in runs]
        swept = sorted({r["lr"] for r in mine if r["seed"] == 0})
        table[config] = {
            "bracket": [r for r in mine if r["seed"] == 0], "lr": best["lr"], "runs": runs,
            "curve": mean_curve(runs), "loss_mean": statistics.mean(finals),
            "spread": (max(finals) - min(finals)) / 2, "std": statistics.stdev(finals) if len(finals) > 1 else None,
            "at_edge": best["lr"] in (swept[0], swept[-1]) and len(swept) > 1,
            "step_s": min(r["step_s"] for r in runs),
        }  # fmt: skip
    return table


def paired(table: dict[str, dict], base: str) -> dict[str, dict]:
    """Per configuration: its final loss against ``base``'s on the same seed (each at its chosen rate), over the seeds
    both ran: ``{"seeds", "mean", "worst"}``. A seed fixes the held-out split, so only a paired difference ranks."""
    if base not in table or not table[base]["runs"]:
        return {}
    theirs = {r["seed"]: r["final_eval_loss"] for r in table[base]["runs"]}
    out = {}
    for config, row in table.items():
        diffs = {r["seed"]: r["final_eval_loss"] / theirs[r["seed"]] - 1 for r in row["runs"] if r["seed"] in theirs}
        if config != base and diffs:
            out[config] = {"seeds": sorted(diffs), "mean": statistics.mean(diffs.values()),
                           "worst": max(diffs.values()), "each": diffs}  # fmt: skip
    return out


def one_b_bytes(config: str, row: dict, wire_bytes: dict) -> float:
    """A node's bytes per step at OLMo2-1B's scale: the preset's, measured through the real wire on its shapes
    (``wire_presets.json``), else this model's measured share of the dense bytes applied to the 1B's."""
    name, every = LONG_CONFIGS[config].wire
    if name == "dense":
        return wire_bytes["dense_bytes"]
    if name in wire_bytes:
        return wire_bytes[name] / every
    measured = statistics.median(r["bytes_per_step"] / r["dense_bytes_per_step"] for r in row["runs"])
    return wire_bytes["dense_bytes"] * measured


def time_to_adamw(table: dict, wire_bytes: dict) -> dict[str, dict[str, float | None]]:
    """Per configuration and link: the modelled time to AdamW-HSDP's final mean loss, as a share of AdamW-HSDP's
    whole run (olmo2_1b_step.py's model of OLMo2-1B on 2 nodes of 8 H100s; the steps are these curves')."""
    adamw = table["adamw_hsdp"]
    total, target = adamw["curve"][-1]
    result = {}
    for config, row in table.items():
        if not row["runs"]:
            continue
        reached = next((t for t, loss in row["curve"] if loss <= target), None)
        rule = "adamw" if LONG_CONFIGS[config].optim == "adamw_torch" else "flexdemo"
        sent = one_b_bytes(config, row, wire_bytes)
        result[config] = {}
        for rate, bits in RATES.items():
            whole = total * step_seconds("adamw", wire_bytes["dense_bytes"], bits)
            result[config][rate] = None if reached is None else reached * step_seconds(rule, sent, bits) / whole
    return result


def plot(out: Path, config: str, table: dict, preset: LongPreset) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    row = table[config]
    for r in row["bracket"]:
        if r["lr"] != row["lr"] and not r["diverged"]:
            xs, ys = zip(*[(e["tokens"] / 1e6, e["eval_loss"]) for e in r["evals"]])
            ax.plot(xs, ys, ":", color="grey", linewidth=1, label=f"{config} lr={r['lr']:g} (seed 0)")
    for r in row["runs"]:
        xs, ys = zip(*[(e["tokens"] / 1e6, e["eval_loss"]) for e in r["evals"]])
        ax.plot(xs, ys, "-", color="tab:blue", linewidth=1, alpha=0.6, label=f"{config} seed {r['seed']}")
    for base, colour in (("adamw_hsdp", "black"), ("full", "tab:green")):
        if base in table and table[base]["runs"] and base != config:
            xs, ys = zip(*table[base]["curve"])
            ax.plot([x / 1e6 for x in xs], ys, "--", color=colour, linewidth=2,
                    label=f"{base} lr={table[base]['lr']:g}, mean of {len(table[base]['runs'])} seeds")  # fmt: skip
    ax.set_xlabel("tokens trained (M)")
    ax.set_ylabel("eval loss")
    ax.set_title(f"{preset.name}: {config} at lr={row['lr']:g}, {preset.parameters / 1e6:.2f}M parameters", fontsize=10)
    low = min(loss for r in table.values() for _, loss in r.get("curve", []))
    ax.set_ylim(low - 0.1, low + 2.5)  # the first evaluations' losses would flatten the rest
    ax.legend(fontsize=7)
    fig.tight_layout()
    name = f"{config}_loss_vs_tokens.png"
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


def report(out: Path, wire_bytes_path: Path) -> str:
    """README.md and the PNGs of the study in ``out``; returns the markdown."""
    held = json.loads((out / "study.json").read_text())
    preset = dataclasses.replace(LONG_PRESETS[held["preset"]], steps=held["steps"])
    long_run.CURRENT_PRESET = preset.name  # the bracket centres of this study's preset
    rows = StudyDir(out).rows
    table = summary(rows)
    presets = json.loads(wire_bytes_path.read_text())
    wire_bytes = {p["wire"]: p["bytes_per_step"] for p in presets["presets"]} | {"dense_bytes": presets["dense_bytes"]}
    tokens = preset.steps * preset.tokens_per_step
    ready = {c: r for c, r in table.items() if r["runs"]}
    epochs = [r["epochs"] for r in rows if r.get("epochs")]
    if preset.offline_text == "digits":
        data = (
            f"ViT of {rows[0]['parameters']:,} parameters trained {preset.steps:,} steps of {preset.tokens_per_step} "
            f"images ({max(epochs):.0f} epochs of {held['corpus']['documents']:,} digits' training four fifths), "
            f"cosine decay after a {preset.warmup:.0%} warmup, {preset.evals} evaluations on the held-out fifth "
            "(the split is seeded: each seed holds out its own). "
        )
    else:
        data = (
            f"OLMo2 of {rows[0]['parameters']:,} parameters trained {preset.steps:,} steps of "
            f"{preset.tokens_per_step:,} tokens ({tokens:,} tokens, {tokens / rows[0]['parameters']:.1f} per "
            f"parameter), cosine decay after a {preset.warmup:.0%} warmup, on `--offline_text {preset.offline_text}` "
            f"({held['corpus']['documents']:,} files, {held['corpus']['chars'] / 1e6:.1f} MB; the text seen "
            f"{max(epochs):.2f} times at most), {preset.evals} evaluations on the first {preset.eval_files} held-out "
            "files (the split is seeded: each seed holds out its own). "
        )
    flag = "" if preset.name == long_run.DEFAULT_PRESET else f" --long_preset {preset.name}"
    lines = [
        f"# The loss over a long run: {preset.name}",
        "",
        data + f"Device: {rows[0]['device']}. Replicas: 2, simulated in one process except "
        f"{', '.join(c for c, s in LONG_CONFIGS.items() if s.layout == NODES)} (2 nodes x 2 processes).",
        "",
        f"    .venv/bin/python benchmarks/quality/quality_study.py --stage long{flag} --dry_run",
        f"    nice -n 10 .venv/bin/python benchmarks/quality/quality_study.py --stage long{flag} --time_budget SECONDS",
        f"    .venv/bin/python benchmarks/quality/quality_study.py --stage long{flag} \\",
        f"        --report benchmarks/results/quality/{preset.name}",
        "",
        "Each rate is chosen at full length on seed 0 (the bracket); the seeds then run at it. "
        f"{len(rows)} runs in `runs.json`.",
        "",
        "| config | rates on seed 0 (final loss) | chosen | bracket centre | seeds "
        "| final eval loss (mean +- half-range) | vs AdamW-HSDP | vs full |",
        "| --- " * 8 + "|",
    ]
    for config, row in table.items():
        swept = ", ".join(
            f"{r['lr']:g} ({'diverged' if r['diverged'] else format(r['final_eval_loss'], '.4f')})"
            for r in sorted(row["bracket"], key=lambda r: r["lr"])
        )
        if not row["runs"]:
            lines.append(f"| {config} | {swept} | none | {long_run.centre(config):g} | 0 | - | - | - |")
            continue
        vs = [f"{row['loss_mean'] / ready[b]['loss_mean'] - 1:+.2%}" if b in ready else "-" for b in BASELINES]
        edge = ", at the edge" if row["at_edge"] else ""
        complete = all(done(rows, config, lr, 0) for lr in bracket(config))
        moved = "" if row["lr"] == long_run.centre(config) else " (moved)" if complete else " (bracket incomplete)"
        lines.append(
            f"| {config} | {swept} | {row['lr']:g}{edge} | {long_run.centre(config):g}{moved} "
            f"| {len(row['runs'])} | {row['loss_mean']:.4f} +- {row['spread']:.4f} | {vs[0]} | {vs[1]} |"
        )
    for base in BASELINES:
        against = paired(table, base)
        if not against:
            continue
        lines += ["", f"Against {base} on the same seed (each at its chosen rate; below 0 is better):", ""]
        lines += ["| config | seeds | each seed | mean | worst seed |", "| --- " * 5 + "|"]
        for config, row in against.items():
            each = ", ".join(f"{row['each'][s]:+.2%}" for s in row["seeds"])
            lines.append(
                f"| {label(config)} | {len(row['seeds'])} | {each} | {row['mean']:+.2%} | {row['worst']:+.2%} |"
            )
    for base in BASELINES:
        if base not in ready:
            continue
        lines += ["", f"Gap to {base} (mean curves) at a share of the run's tokens: does it grow or shrink?", ""]
        lines += ["| config | " + " | ".join(f"{f:.0%}" for f in FRACTIONS) + " |", "| --- " * 5 + "|"]
        for config, row in ready.items():
            if config != base:
                gap = gaps(row["curve"], ready[base]["curve"], tokens)
                cells = ("-" if gap[f] is None else f"{gap[f]:+.2%}" for f in FRACTIONS)
                lines.append(f"| {config} | " + " | ".join(cells) + " |")
    if "adamw_hsdp" in ready and preset.offline_text != "digits":  # the model of OLMo2-1B's steps
        reach = time_to_adamw(ready, wire_bytes)
        lines += [
            "",
            "Time to AdamW-HSDP's final loss, as a share of AdamW-HSDP's run: these curves' tokens, each step modelled "
            "as OLMo2-1B's on 2 nodes of 8 H100s (`olmo2_1b_step.py`: measured compute plus the bytes a node sends "
            "at the link's rate; the bytes through the real wire on OLMo2-1B's shapes). Measured here: the median "
            "s/step of the training steps alone in this configuration's runs, on this machine's 2 cores, which "
            "some runs shared with a second study process: a figure of this machine, not a benchmark.",
            "",
            "| config | 100 Mbit/s | 1 Gbit/s | s/step measured here |",
            "| --- | --- | --- | --- |",
        ]
        for config, ratios in reach.items():
            cells = " | ".join("not reached" if v is None else f"{v:.3f}" for v in ratios.values())
            lines.append(f"| {config} | {cells} | {ready[config]['step_s']:.3f} ({LONG_CONFIGS[config].layout}) |")
    lines.append("")
    for config in table:
        if table[config]["runs"]:
            lines.append(f"![{config}]({plot(out, config, table, preset)})")
    text = "\n".join(lines) + "\n"
    (out / "README.md").write_text(text)
    return text
