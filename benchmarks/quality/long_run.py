"""The loss over a long run (issue 64): each wire at ten tokens per parameter or more, against AdamW-HSDP and the
same rule uncompressed.

Two presets of the quality study's OLMo2 (untied head, byte-level BPE, 128-token blocks), each trained in steps of
2 replicas x 16 blocks (4,096 tokens), with a 5% linear warmup and a cosine decay to zero (the Trainer's
``lr_scheduler_type=cosine``), on the Python source that the installed packages ship (``--offline_text
python_source``), evaluated 20 times on 16 held-out files:

- ``olmo2_long_263k`` (the default): width 64, 2 layers, a 1,024-token vocabulary; 262,720 parameters trained
  1,300 steps, 5.3M tokens, 20.3 per parameter. Its text's training split holds 14.0M tokens (109,667 blocks), so
  a run sees 0.38 of it. The whole plan fits one sitting on 2 cores (about 3 min a simulated run).
- ``olmo2_long``: the 1.6M-parameter model of the short study (width 128, a 4,096-token vocabulary); 4,000 steps,
  16.4M tokens, 10.4 per parameter, its text seen 1.56 times; about 14 h of runs on 2 idle cores.

Replicas are simulated in one process (``simulate_replicas=2``) where the scheme keeps one model after every step,
and run on 2 nodes x 2 processes where it does not (SparseLoCo's outer steps).

Each configuration's rate is chosen at full length: a bracket around its short-run best (``LongConfig.short_best``) on
seed 0, one more rate beyond the edge while the edge wins (MAX_EDGES at most), then the other seeds at the
winner. One command per stage::

    # the plan: every run, its steps, tokens, tokens per parameter and estimated hours (no training)
    .venv/bin/python benchmarks/quality/quality_study.py --stage long --dry_run
    # the runs, in the plan's order; each finished run is appended to runs.json at once (commit it as it comes),
    # and no run starts that the budget would not see finish; the same command resumes
    nice -n 10 .venv/bin/python benchmarks/quality/quality_study.py --stage long --time_budget 7200
    # the report: README.md and a PNG per configuration in the study directory
    .venv/bin/python benchmarks/quality/quality_study.py --stage long \\
        --report benchmarks/results/quality/olmo2_long_263k

(``--long_preset olmo2_long`` for the 1.6M model; its study directory is ``benchmarks/results/quality/olmo2_long``.
``benchmarks/quality/long_study.py`` takes the same flags; its dry run imports neither torch nor transformers. This
module holds the study's presets, configurations, plan and runs; the report is ``long_report.py``.)
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

from stock_scripts import DATA_CACHE, device_name, launch, parameter_count

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "quality"
SIMULATED, NODES = "simulated", "nodes"


@dataclasses.dataclass(frozen=True)
class LongPreset:
    """The long run's model, data and schedule; a study directory holds one (``study.json``)."""

    name: str = "olmo2_long"
    hidden_size: int = 128
    num_layers: int = 2
    vocab_size: int = 4096
    block_size: int = 128
    replicas: int = 2
    blocks_per_replica: int = 16  # the short study's 2 x 2 x 8 blocks a step: 4,096 tokens
    steps: int = 4000
    evals: int = 20
    warmup: float = 0.05  # of the steps (the Trainer's warmup_steps below 1)
    eval_files: int = 16  # --max_eval_samples counts documents: the first 16 held-out files, 300 to 400 blocks
    offline_text: str = "python_source"
    script: str = "train_olmo2.py"

    @property
    def tokens_per_step(self) -> int:
        return self.replicas * self.blocks_per_replica * self.block_size

    @property
    def eval_every(self) -> int:
        return max(self.steps // self.evals, 1)

    @property
    def parameters(self) -> int:
        return olmo2_parameters(self.vocab_size, self.hidden_size, self.num_layers)

    def flags(self) -> list[str]:
        """The stock script's flags every run of the preset shares."""
        return [
            "--offline_text", self.offline_text, "--hidden_size", str(self.hidden_size),
            "--num_layers", str(self.num_layers), "--vocab_size", str(self.vocab_size),
            "--block_size", str(self.block_size), "--max_steps", str(self.steps),
            "--lr_scheduler_type", "cosine", "--warmup_steps", str(self.warmup),
            "--eval_strategy", "steps", "--eval_steps", str(self.eval_every),
            "--logging_steps", str(max(self.eval_every // 4, 1)), "--max_eval_samples", str(self.eval_files),
            "--logging_nan_inf_filter", "false",  # a diverged run's loss logged as NaN, not hidden
            "--save_strategy", "no", "--report_to", "none",
        ]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class DigitsPreset(LongPreset):
    """A small-data, many-epoch task: ``train_vit.py``'s offline ViT on scikit-learn's 1,797 digits (1,438 to train),
    2 replicas x 64 images a step (as 2 x 2 x 32), evaluated on the held-out fifth. Generalisation decides here, not
    optimisation: the regime where DeMo's own wire won a held-out check. A "token" is an image."""

    name: str = "vit_digits"
    steps: int = 500  # 44 epochs
    blocks_per_replica: int = 64
    block_size: int = 1
    eval_files: int = 0
    offline_text: str = "digits"
    script: str = "train_vit.py"

    @property
    def parameters(self) -> int:
        return 105_034  # the offline preset's ViT (width 64, 2 layers, 16 x 16 images), read from a saved run

    def flags(self) -> list[str]:
        return [
            "--max_steps", str(self.steps), "--lr_scheduler_type", "cosine", "--warmup_steps", str(self.warmup),
            "--eval_strategy", "steps", "--eval_steps", str(self.eval_every),
            "--logging_steps", str(max(self.eval_every // 4, 1)), "--logging_nan_inf_filter", "false",
            "--save_strategy", "no", "--report_to", "none",
        ]  # fmt: skip


LONG_PRESETS = {
    "olmo2_long_263k": LongPreset(name="olmo2_long_263k", hidden_size=64, vocab_size=1024, steps=1300),
    # width 128: every weight matrix spans several 64 x 64 tiles (attention 4, MLP 16), as a large model's do
    "olmo2_w128_525k": LongPreset(name="olmo2_w128_525k", hidden_size=128, num_layers=1, vocab_size=1024, steps=1300),
    "olmo2_long": LongPreset(),
    "vit_digits": DigitsPreset(),
}
DEFAULT_PRESET = "olmo2_long_263k"


def olmo2_parameters(vocab: int, hidden: int, layers: int) -> int:
    """The offline preset's OLMo2 (untied head, MLP 4x wide, q/k norms over the width): its parameter count."""
    per_layer = 4 * hidden * hidden + 3 * hidden * 4 * hidden + 4 * hidden  # attention, MLP, four norms
    return 2 * vocab * hidden + layers * per_layer + hidden


@dataclasses.dataclass(frozen=True)
class LongConfig:
    optim: str
    optim_args: str
    layout: str  # SIMULATED or NODES
    short_best: float  # its best rate on the 250-step study (1.6M, 0.65 tokens per parameter)
    wire: tuple[str, int]  # its bytes at OLMo2-1B's scale: (wire_presets.json entry or "dense", every H steps)


ORTHO = "update=orthogonal"  # the default rule (Muon on the matrices, Adam's elementwise step on the rest)
EF = "pack_indices=true,index_coding=elias_fano"  # the indices as the presets code them
LONG_CONFIGS = {
    "adamw_hsdp": LongConfig("adamw_torch", "", SIMULATED, 4e-3, ("dense", 1)),
    "full": LongConfig("flexdemo", f"scheme=full,{ORTHO}", SIMULATED, 4e-3, ("dense", 1)),
    # DeMo's wire (the package default until the long runs; its rows before that named no wire)
    "wire_demo": LongConfig("flexdemo", f"wire=demo,{ORTHO}", SIMULATED, 4e-3, ("demo", 1)),
    "wire_top128_4bit": LongConfig(
        "flexdemo",
        f"topk=128,value_bits=4,pack_indices=true,index_coding=elias_fano,{ORTHO}",
        SIMULATED,
        8e-3,
        ("top128_4bit", 1),
    ),
    "wire_top128_4bit_d095": LongConfig(
        "flexdemo",
        f"topk=128,value_bits=4,pack_indices=true,index_coding=elias_fano,decay=0.95,{ORTHO}",
        SIMULATED,
        8e-3,
        ("top128_4bit", 1),
    ),
    # about 100x: the sign of 64 coefficients a tile and the tile's mean magnitude
    "wire_top64_1bit": LongConfig(
        "flexdemo",
        f"topk=64,value_bits=1,pack_indices=true,index_coding=elias_fano,{ORTHO}",
        SIMULATED,
        8e-3,
        ("top64_1bit", 1),
    ),
    "wire_2bit": LongConfig("flexdemo", f"wire=2bit,{ORTHO}", SIMULATED, 8e-3, ("2bit", 1)),
    # the screen of issue 70's candidates: more coefficients at fewer bits, at 40x to 800x
    "wire_top128_1bit": LongConfig("flexdemo", f"{EF},topk=128,value_bits=1,{ORTHO}", SIMULATED, 8e-3, ("top128_1bit", 1)),
    "wire_top96_2bit": LongConfig("flexdemo", f"wire=top96_2bit,{ORTHO}", SIMULATED, 8e-3, ("top96_2bit", 1)),
    "wire_top64_8bit": LongConfig("flexdemo", f"{EF},topk=64,value_bits=8,{ORTHO}", SIMULATED, 8e-3, ("top64_8bit", 1)),
    "wire_top24_2bit": LongConfig("flexdemo", f"{EF},topk=24,value_bits=2,{ORTHO}", SIMULATED, 8e-3, ("top24_2bit", 1)),
    "wire_top32_1bit": LongConfig("flexdemo", f"{EF},topk=32,value_bits=1,{ORTHO}", SIMULATED, 8e-3, ("top32_1bit", 1)),
    "wire_top4_1bit": LongConfig("flexdemo", f"wire=top4_1bit,{ORTHO}", SIMULATED, 8e-3, ("top4_1bit", 1)),
    # about 1,000x: wire=2bit's coefficients every 4 steps, Muon's step inside; replicas apart between outer steps
    "sparseloco_h4_2bit": LongConfig(
        "flexdemo",
        f"scheme=sparseloco,inner_steps=4,topk=32,value_bits=2,pack_indices=true,index_coding=elias_fano,{ORTHO}",
        NODES,
        3.2e-2,
        ("2bit", 4),
    ),
}
"""``short_best``: benchmarks/results/quality/quality_olmo2 (SparseLoCo: quality_olmo2_beyond_300x)."""
DEFAULT_CONFIG = "wire_top128_4bit"
"""The package default's configuration (its knobs are ``DEFAULT_WIRE``'s, spelled out so that its rows keep their
meaning when the default moves); reports name it ``default``."""
BASELINES = ("adamw_hsdp", "full")
BRACKET = (0.5, 1.0, 2.0)
"""Seed 0's rates: these multiples of the short-run best; a winner at an edge gets a rate beyond it (MAX_EDGES)."""
MAX_EDGES = 3
"""Rates beyond the bracket a configuration may get, one at a time while its best stays at the outermost."""
SEEDS = {name: (0, 1) for name in LONG_CONFIGS} | {
    name: (0, 1, 2)
    for name in ("adamw_hsdp", "full", "wire_demo", "wire_top128_4bit", "wire_top128_4bit_d095", "wire_top64_1bit")
}
"""Every finalist runs 3 paired seeds: a seed fixes the held-out split, so configurations are compared per seed."""
CENTRES = {
    "olmo2_w128_525k": {"adamw_hsdp": 4e-3, "full": 8e-3, "wire_demo": 1.6e-2, "wire_top128_4bit": 8e-3,
                        "wire_top128_4bit_d095": 8e-3, "wire_top64_1bit": 8e-3},
    # train_vit.py's offline rate for every rule
    "vit_digits": dict.fromkeys(("adamw_hsdp", "full", "wire_demo", "wire_top128_4bit", "wire_top128_4bit_d095"), 2e-3),
}  # fmt: skip
"""A preset's bracket centres where they are not ``short_best``: the rates that won at full length on
``olmo2_long_263k`` (its README), so that a second model shape starts where the first one ended."""
PHASES = ("bracket", "edge", "seeds", "third seed")
RULE_COST = {"adamw_torch": 1.0, "flexdemo": 1.57}
"""A step's cost against AdamW's (medians of the 250-step study at 1.6M): scales a measured run to another rule."""
PILOTS = {
    "olmo2_long_263k": {"steps": 60, "train_s": 20.9, "step_s": 0.131, "setup_s": 9.0, "optim": "adamw_torch"},
    # not a pilot: the 263K pilot scaled by the parameters (2x), until the preset's first run finishes
    "olmo2_w128_525k": {"steps": 60, "train_s": 41.8, "step_s": 0.262, "setup_s": 9.0, "optim": "adamw_torch"},
    "vit_digits": {"steps": 40, "train_s": 20.0, "step_s": 0.3, "setup_s": 15.0, "optim": "flexdemo"},  # a guess
    "olmo2_long": {"steps": 60, "train_s": 54.7, "step_s": 0.470, "setup_s": 40.0, "optim": "flexdemo"},
}
"""Before any run of a study has finished, the estimate: each preset's pilot (60 steps, 20 evaluations; 2026-12-02
on 2 idle cores): its training loop (``train_s``, evaluations included), a step of it without them, and the rest of
a run (start, the closing evaluation, saving)."""
PREPARE_S = 300.0
"""The first run of a seed tokenizes its text (the split is seeded) into ``DATA_CACHE``: 1 to 8 min in the pilots,
as the load varied."""
FRACTIONS = (0.1, 0.25, 0.5, 1.0)


@dataclasses.dataclass(frozen=True)
class Planned:
    phase: str
    config: str
    lr: float | None  # None: the bracket's winner, not known yet
    seed: int


def done(rows: list[dict], config: str, lr: float, seed: int) -> dict | None:
    return next((r for r in rows if (r["config"], r["lr"], r["seed"]) == (config, lr, seed)), None)


def winner(rows: list[dict], config: str) -> dict | None:
    """Seed 0's best finished run of ``config`` that did not diverge."""
    ran = [r for r in rows if r["config"] == config and r["seed"] == 0 and not r["diverged"]]
    return min(ran, key=lambda r: r["final_eval_loss"]) if ran else None


CURRENT_PRESET = DEFAULT_PRESET
"""The preset whose centres :func:`bracket` uses; ``long_study.main`` sets it from ``--long_preset``, the report
from the study directory's preset."""


def centre(config: str) -> float:
    """The rate seed 0's bracket is centred on, in the current preset."""
    return CENTRES.get(CURRENT_PRESET, {}).get(config, LONG_CONFIGS[config].short_best)


def bracket(config: str) -> list[float]:
    return [float(f"{centre(config) * m:.6g}") for m in BRACKET]


def edge_rates(rows: list[dict], config: str) -> list[float]:
    """The rates beyond the bracket, once it ran: while seed 0's best sits at the outermost rate tried (or every
    rate diverged: below the lowest), one more beyond it, up to MAX_EDGES. The last may not have run yet."""
    rates = bracket(config)
    if not all(done(rows, config, lr, 0) for lr in rates):
        return []
    edges: list[float] = []
    while len(edges) < MAX_EDGES and all(done(rows, config, lr, 0) for lr in edges):
        tried = sorted({*rates, *edges})
        best = winner([r for r in rows if r["lr"] in tried], config)
        if best is None or best["lr"] == tried[0]:
            edges.append(float(f"{tried[0] / 2:.6g}"))
        elif best["lr"] == tried[-1]:
            edges.append(float(f"{tried[-1] * 2:.6g}"))
        else:
            break
    return edges


def plan(rows: list[dict], configs=tuple(LONG_CONFIGS)) -> list[Planned]:
    """Every run, in order: each bracket on seed 0, the edges, the second seeds at the winners, the third seeds.
    A winner not known yet is None (the dry run's "at the winner"); an edge not known yet is not listed."""
    items = [Planned("bracket", c, lr, 0) for c in configs for lr in bracket(c)]
    items += [Planned("edge", c, lr, 0) for c in configs for lr in edge_rates(rows, c)]
    for phase, index in (("seeds", 1), ("third seed", 2)):
        for c in configs:
            if len(SEEDS[c]) > index:
                bracketed = all(done(rows, c, lr, 0) for lr in bracket(c)) and not edge_pending(rows, c)
                best = winner(rows, c) if bracketed else None
                items.append(Planned(phase, c, best["lr"] if best else None, SEEDS[c][index]))
    return items


def edge_pending(rows: list[dict], config: str) -> bool:
    return any(done(rows, config, lr, 0) is None for lr in edge_rates(rows, config))


def estimate_s(rows: list[dict], config: str, preset: LongPreset, seed: int | None = None) -> float:
    """Seconds a run of ``config`` will take: the training loop of its own slowest finished run, else of the study's
    slowest scaled by the rules' cost, else the preset's pilot (:data:`PILOTS`), each scaled from its steps to
    ``steps`` (the evaluations stay 20); plus the least start-up of any run, and for a seed no run has used, its
    text's tokenizing (:data:`PREPARE_S`)."""
    optim, steps, prior = LONG_CONFIGS[config].optim, preset.steps, PILOTS[preset.name]

    def scaled(row: dict) -> float:
        return (row["train_s"] + (steps - row["steps"]) * row["step_s"]) * RULE_COST[optim] / RULE_COST[row["optim"]]

    own = [r for r in rows if r["config"] == config]
    setup = min((r["wall_s"] - r["train_s"] for r in rows if not r.get("prepared_data")), default=prior["setup_s"])
    fresh = seed is not None and all(r["seed"] != seed for r in rows)
    return max(map(scaled, own or rows or [prior])) + setup + (PREPARE_S if fresh else 0.0)


class StudyDir:
    """``study.json`` (the preset, steps and corpus the runs share) and ``runs.json`` (every finished run).

    Several study processes may share one directory, each with its own ``--long_configs``: every append re-reads
    the file under a lock, and each process reads the others' rows before it picks its next run."""

    def __init__(self, path: Path):
        self.path = path
        self.runs_path = path / "runs.json"
        self.rows = self.reload()

    def reload(self) -> list[dict]:
        self.rows = json.loads(self.runs_path.read_text()) if self.runs_path.exists() else []
        return self.rows

    def append(self, row: dict) -> None:
        with (self.path / ".runs.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.reload().append(row)
            written = self.runs_path.with_suffix(".json.tmp")
            written.write_text(json.dumps(self.rows, indent=1) + "\n")
            written.replace(self.runs_path)  # a reader never sees half a file

    def check(self, manifest: dict) -> None:
        """Refuse a study resumed with another preset, step count or corpus than the directory holds."""
        held_path = self.path / "study.json"
        if not held_path.exists():
            return
        held = json.loads(held_path.read_text())
        differ = [k for k in manifest if k in held and held[k] != manifest[k]]
        if differ:
            said = "; ".join(f"{k}: the directory holds {held[k]!r}, this command {manifest[k]!r}" for k in differ)
            raise SystemExit(
                f"quality_study: {self.path} holds another study ({said}). Resume it with its own settings, or give "
                "another --out for a new study."
            )

    def start(self, manifest: dict) -> None:
        self.check(manifest)
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "study.json").write_text(json.dumps(manifest, indent=1) + "\n")


def manifest(preset: LongPreset, corpus: dict | None) -> dict:
    """What the runs of one study share; ``corpus`` is None where it is not computed (the dry run)."""
    settings = {k: v for k, v in dataclasses.asdict(preset).items() if k not in ("name", "steps")}
    if settings["script"] == LongPreset.script:  # studies before other scripts did not record it
        del settings["script"]
    held = {"preset": preset.name, "steps": preset.steps, "settings": settings}
    return held | ({"corpus": corpus} if corpus is not None else {})


def corpus_fingerprint(offline_text: str) -> dict:
    """The training text as the script reads it (its documents hashed): the installed packages decide what
    ``python_source`` holds, so another machine's text is another study."""
    sys.path.insert(0, str(ROOT / "training_scripts"))
    import offline_data

    if offline_text == "digits":
        images, labels = offline_data.digit_images()
        digest = hashlib.sha1(images.tobytes() + labels.tobytes()).hexdigest()
        return {"offline_text": offline_text, "documents": len(labels), "sha1": digest}
    documents = offline_data.python_source() if offline_text == "python_source" else None
    if documents is None:
        raise ValueError(f"long run: offline_text={offline_text!r}; the long preset trains on 'python_source'.")
    digest = hashlib.sha1()
    for text in documents:
        digest.update(text.encode())
    return {"offline_text": offline_text, "documents": len(documents), "chars": sum(map(len, documents)),
            "sha1": digest.hexdigest()}  # fmt: skip


# ------------------------------------------------------------------------------------------------------- one run


def finite(value) -> float | None:
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def parse_history(history: list[dict], preset: LongPreset) -> dict:
    """A run's curves from its ``log_history``; a NaN or infinite loss anywhere marks it diverged."""
    evals = {h["step"]: h["eval_loss"] for h in history if "eval_loss" in h}  # the closing evaluation repeats one
    train = [(h["step"], h["loss"]) for h in history if "loss" in h]
    diverged = any(finite(v) is None for v in [*evals.values(), *(loss for _, loss in train)])
    final = evals[max(evals)] if evals else None
    summary = next(h for h in history if "train_runtime" in h)
    eval_s = [h["eval_runtime"] for h in history if "eval_runtime" in h]
    row = {
        "evals": [
            {"step": s, "tokens": s * preset.tokens_per_step, "eval_loss": finite(v)} for s, v in sorted(evals.items())
        ],
        "train_curve": [[s, finite(v)] for s, v in train],
        "final_eval_loss": None if diverged else finite(final),
        "diverged": diverged or finite(final) is None,
        "epochs": max((h["epoch"] for h in history if "epoch" in h), default=None),
        # the training steps alone: the evaluations inside train_runtime taken out
        "train_s": summary["train_runtime"],
        "step_s": (summary["train_runtime"] - sum(eval_s[:-1])) / preset.steps,
        "eval_s": statistics.mean(eval_s) if eval_s else None,
    }  # fmt: skip
    logged = [h for h in history if "flexdemo/bytes_sent" in h]
    if logged:
        row["bytes_per_step"] = logged[-1]["flexdemo/bytes_sent"] / logged[-1]["step"]
        row["dense_bytes_per_step"] = logged[-1]["flexdemo/dense_bytes"] / logged[-1]["step"]
    return row


def run_args(preset: LongPreset, config: str, lr: float, seed: int) -> tuple[list[str], bool]:
    """The stock script's flags for one run, and whether it runs in one process (replicas simulated)."""
    spec = LONG_CONFIGS[config]
    args = [*preset.flags(), "--seed", str(seed), "--learning_rate", str(lr), "--optim", spec.optim]
    args += ["--data_cache", str(DATA_CACHE)] if preset.script == "train_olmo2.py" else []
    optim_args = spec.optim_args
    if spec.layout == SIMULATED:  # one micro-batch per simulated replica
        args += ["--per_device_train_batch_size", str(preset.blocks_per_replica)]
        args += ["--gradient_accumulation_steps", str(preset.replicas)]
        if spec.optim == "flexdemo":
            optim_args = ",".join(filter(None, (optim_args, f"simulate_replicas={preset.replicas}")))
    else:  # 2 nodes x 2 processes: a node's blocks split between its two
        args += ["--per_device_train_batch_size", str(preset.blocks_per_replica // 2)]
    if optim_args:
        args += ["--optim_args", optim_args]
    return args, spec.layout == SIMULATED


def run_one(preset: LongPreset, config: str, lr: float, seed: int, work: Path) -> dict:
    """One run through the stock script; its row for ``runs.json``."""
    args, one_process = run_args(preset, config, lr, seed)
    out = work / f"{preset.name}_{config}_lr{lr:g}_s{seed}"
    cached = set(DATA_CACHE.glob("*/ready"))
    started = time.time()
    launch(preset.script, args, out, one_process=one_process)
    prepared = bool(set(DATA_CACHE.glob("*/ready")) - cached)  # this run tokenized its text: a longer start
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    spec = LONG_CONFIGS[config]
    parameters = parameter_count(out)
    row = {
        "model": preset.name, "config": config, "lr": lr, "seed": seed, "steps": preset.steps,
        "optim": spec.optim, "optim_args": spec.optim_args, "layout": spec.layout,
        "parameters": parameters, "tokens": preset.steps * preset.tokens_per_step,
        "tokens_per_parameter": preset.steps * preset.tokens_per_step / parameters, "device": device_name(),
    }  # fmt: skip
    return row | parse_history(history, preset) | {"wall_s": time.time() - started, "prepared_data": prepared}


def study(args, preset: LongPreset, run=run_one, fingerprint=corpus_fingerprint) -> bool:
    """Every planned run not in ``runs.json`` yet, in order; False where the time budget stopped it (resume later)."""
    store = StudyDir(args.out)
    store.start(manifest(preset, fingerprint(preset.offline_text)))
    deadline = time.time() + args.time_budget if args.time_budget else math.inf
    with tempfile.TemporaryDirectory() as tmp:
        while True:
            store.reload()  # another process's finished runs too
            todo = [
                p
                for p in plan(store.rows, args.configs)
                if p.lr is None or not done(store.rows, p.config, p.lr, p.seed)
            ]
            if not todo:
                return True
            item = todo[0]
            if item.lr is None:  # cannot happen: a winner's bracket and edge come first in the plan
                raise AssertionError(f"long run: {item} has no rate yet")
            need = estimate_s(store.rows, item.config, preset, item.seed)
            if time.time() + need > deadline:
                left = max(deadline - time.time(), 0)
                print(
                    f"quality_study: the next run ({item.config} lr={item.lr:g} seed {item.seed}) needs about "
                    f"{need / 3600:.2f} h, {left / 3600:.2f} h of --time_budget are left; run again to resume"
                )
                return False
            row = run(preset, item.config, item.lr, item.seed, Path(tmp)) | {"phase": item.phase}
            store.append(row)
            loss = "diverged" if row["diverged"] else f"{row['final_eval_loss']:.4f}"
            print(f"{preset.name} {item.config} lr={item.lr:g} seed={item.seed}: eval loss {loss}, "
                  f"{row['wall_s'] / 3600:.2f} h", flush=True)  # fmt: skip


# ---------------------------------------------------------------------------------------------------- the dry run


def dry_run(args, preset: LongPreset) -> list[str]:
    """The plan, with the estimate of each run: lines, printed (no training, no torch)."""
    store = StudyDir(args.out)
    store.check(manifest(preset, None))
    rows = store.rows
    tokens = preset.steps * preset.tokens_per_step
    lines = [
        f"{preset.name}: OLMo2 of {preset.parameters:,} parameters (width {preset.hidden_size}, {preset.num_layers} "
        f"layers, vocabulary {preset.vocab_size}), {preset.steps:,} steps x {preset.replicas} replicas x "
        f"{preset.blocks_per_replica} blocks x {preset.block_size} tokens = {tokens:,} tokens, "
        f"{tokens / preset.parameters:.1f} tokens per parameter; cosine decay after a {preset.warmup:.0%} warmup; "
        f"{preset.evals} evaluations (every {preset.eval_every} steps) on {preset.eval_files} held-out files; "
        f"text: --offline_text {preset.offline_text}",
        f"study directory {args.out}: {len(rows)} runs finished",
        "| # | phase | config | layout | lr | seed | steps | tokens | tokens/param | est. h | state |",
        "| --- " * 11 + "|",
    ]
    total = left = 0.0
    plan_items = plan(rows, args.configs)
    seeds = set()  # a seed's text is tokenized by its first run only
    for number, item in enumerate(plan_items, 1):
        row = done(rows, item.config, item.lr, item.seed) if item.lr is not None else None
        first = item.seed if item.seed not in seeds else None
        seeds.add(item.seed)
        hours = (row["wall_s"] if row else estimate_s(rows, item.config, preset, first)) / 3600
        total += hours
        left += 0 if row else hours
        state = ("diverged" if row["diverged"] else f"done, {row['final_eval_loss']:.4f}") if row else "to run"
        lr = "the winner" if item.lr is None else f"{item.lr:g}"
        lines.append(
            f"| {number} | {item.phase} | {item.config} | {LONG_CONFIGS[item.config].layout} | {lr} | {item.seed} "
            f"| {preset.steps:,} | {tokens:,} | {tokens / preset.parameters:.1f} | {hours:.2f} | {state} |"
        )
    edges = sum(
        1 for c in args.configs if not edge_rates(rows, c) and not all(done(rows, c, lr, 0) for lr in bracket(c))
    )
    lines.append(
        f"{len(plan_items)} runs, {total:.1f} h in all, {left:.1f} h to run (one run at a time on this machine); "
        f"up to {edges} more where a bracket's best sits at its edge (a rate beyond it at a time, up to "
        f"{MAX_EDGES} each, about "
        f"{estimate_s(rows, 'wire_demo', preset) / 3600:.2f} h apiece)"
    )  # fmt: skip
    print("\n".join(lines))
    return lines
