"""What each wire format and scheme costs in loss: the offline presets, 2 nodes x 2 processes.

Every run is a user's command: `accelerate launch --config_file accelerate_configs/cpu_2x2.yaml
training_scripts/train_<model>.py --preset offline` with the configuration's `--optim` and
`--optim_args`, evaluated every `steps / 10` steps. Each configuration's learning rate is
chosen by a sweep on seed 0 (the rates in ``SWEEPS``; best final validation loss),
then every seed runs at that rate. Bytes per step are node 0's (`flexdemo/bytes_sent_per_step`);
AdamW-HSDP's are the dense ring all-reduce of the same gradients (`flexdemo/dense_bytes`).

Wall-clock at a link rate is modelled as the measured time of a step (this machine, loopback)
plus the bytes at the rate: `t = compute + 8 * bytes / rate`. The time of a step is the fastest
of the configuration's runs, or with ``--retime N`` the median of N short runs without
evaluations, every configuration's taken in turns so that all see the same machine::

    .venv/bin/python benchmarks/quality/quality_study.py --model olmo2 --steps 250 \\
        --configs adamw_hsdp demo_ortho_adam \\
        --retime 3 --out benchmarks/results/quality/quality_olmo2

    .venv/bin/python benchmarks/quality/quality_study.py --model olmo2 --steps 250 --seeds 0 1 2 \\
        --out benchmarks/results/quality/quality_olmo2
    # the table and PNGs
    .venv/bin/python benchmarks/quality/quality_study.py --report benchmarks/results/quality/quality_olmo2
    .venv/bin/python benchmarks/quality/quality_study.py --model t5 --steps 360 --seeds 0 1 2 \\
        --out benchmarks/results/quality/quality_t5  # + BLEU, chrF

OLMo2 trains on ``--offline_text stdlib`` (4.6x the preset's text), so that 250 steps are about
two epochs rather than twelve.

``--model olmo2_ft`` is fine-tuning: an OLMo2 base model is pretrained once with AdamW-HSDP on
the standard library's docstrings (``<out>/base``, saved in the Hub's format, seed 0), and every
run fine-tunes it on the documentation's prose through the stock script
(``--model_name_or_path <out>/base --no_from_config --offline_text pydoc``)::

    .venv/bin/python benchmarks/quality/quality_study.py --model olmo2_ft --steps 100 --seeds 0 1 2 \\
        --out benchmarks/results/quality/quality_olmo2_ft

``--stage long`` is the long-run study (issue 64: each wire at 20 tokens per parameter, rates bracketed at full
length; ``benchmarks/quality/long_run.py``)::

    .venv/bin/python benchmarks/quality/quality_study.py --stage long --dry_run  # the plan and its hours
    nice -n 10 .venv/bin/python benchmarks/quality/quality_study.py --stage long --time_budget 7200
    .venv/bin/python benchmarks/quality/quality_study.py --stage long \\
        --report benchmarks/results/quality/olmo2_long_263k

Writes ``<out>/runs.json`` (every run, resumable: finished runs are not repeated), and with
``--report`` the markdown table and ``loss_vs_steps.png``, ``loss_vs_time_100mbit.png``,
``loss_vs_time_1gbit.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import long_study
from stock_scripts import DATA_CACHE, device_name, launch, parameter_count

ROOT = Path(__file__).resolve().parents[2]
RATES = {"100mbit": 100e6, "1gbit": 1e9}

# name: (--optim, --optim_args). The sign-update configurations name `update=sign`: they measure that
# rule whatever the default is.
SIGN_CONFIGS = {
    "demo": "wire=demo",  # DeMo's wire, the package default when these ran (the default is now top128_4bit)
    "demo_bf16": "value_dtype=bf16",
    "demo_sign": "value_bits=1,pack_indices=true",
    "demo_4bit": "value_bits=4,pack_indices=true",
    "demo_2bit": "value_bits=2,pack_indices=true",
    "demo_top16_2bit": "topk=16,value_bits=2,pack_indices=true",
    # Between the 2-bit default wire (~250x) and top 16 (~480x): about 350x.
    "demo_top24_2bit": "topk=24,value_bits=2,pack_indices=true",
    # Twice demo's coefficients at 2 bits: about bf16's bytes, spent on more of the momentum.
    "demo_top64_2bit": "topk=64,value_bits=2,pack_indices=true",
    "demo_aggressive": "topk=4,chunk=64,value_bits=1,pack_indices=true",
    # Every momentum entry, all-reduced: the sign-of-momentum update with no compression at all.
    "full": "scheme=full",
    "random": "scheme=random",
    "striding": "scheme=striding",
}
RULE_WIRES = ("demo", "full", "demo_2bit", "demo_top64_2bit", "demo_top24_2bit", "demo_top16_2bit", "demo_aggressive")
"""The wire formats that the update rules (hf_flexdemo.updates) run on."""
CONFIGS = {
    "adamw_hsdp": ("adamw_torch", ""),
    **{name: ("flexdemo", ",".join(filter(None, (args, "update=sign")))) for name, args in SIGN_CONFIGS.items()},
    "diloco": ("flexdemo", "scheme=diloco,inner_steps=20"),
    **{
        f"{wire}_{rule}": ("flexdemo", ",".join(filter(None, (SIGN_CONFIGS[wire], f"update={full}"))))
        for wire in RULE_WIRES
        for rule, full in (
            ("adam", "adam"),
            ("ortho_adam", "orthogonal"),
        )
    },
    "sparseloco": ("flexdemo", "scheme=sparseloco,inner_steps=20,topk=64,value_bits=2,pack_indices=true"),
    # Issue 45, direction 3: outer steps every 3 steps carrying `wire=2bit`'s coefficients (about 1,000x)
    "sparseloco_h3_2bit": (
        "flexdemo",
        "scheme=sparseloco,inner_steps=3,topk=32,value_bits=2,pack_indices=true,index_coding=elias_fano",
    ),
    # ... and with the default rule's orthogonalized step inside (Muon's on the replica's own momentum); every 4
    # steps, about 1,250x; every 5, so that evaluations every 10 steps fall on outer steps
    **{
        f"sparseloco_h{h}_2bit_ortho_adam": (
            "flexdemo",
            f"scheme=sparseloco,inner_steps={h},topk=32,value_bits=2,pack_indices=true,index_coding=elias_fano,"
            "update=orthogonal",
        )
        for h in (3, 4, 5)
    },
    # The same bytes per step (about 1,150x) spent as fewer coefficients more often or more coefficients less often:
    # the top 16 every 2 steps, the top 64 every 8, the top 128 every 16 (Elias-Fano indices cost a little less a
    # coefficient as the top-k grows, so the larger ones send slightly fewer bytes); every 9 and 12 steps divide T5's
    # evaluations (every 36 of 360 steps), so no evaluation adds an outer step there
    # (and every 4 steps at 4x and 16x the density: the outer steps' frontier towards dense averaging)
    **{
        f"sparseloco_h{h}_top{k}_2bit_ortho_adam": (
            "flexdemo",
            f"scheme=sparseloco,inner_steps={h},topk={k},value_bits=2,pack_indices=true,index_coding=elias_fano,"
            "update=orthogonal",
        )
        for h, k in ((2, 16), (8, 64), (16, 128), (9, 72), (12, 96), (4, 128), (4, 512))
    },
    # ... and the top 64 every 8 steps with the outer step's own settings moved: the whole averaged pseudo-gradient
    # (outer_lr=1, against 0.7), and less or more of the unsent part forgotten at each outer step (error feedback's
    # decay, 0.9 by default)
    **{
        f"sparseloco_h8_top64_2bit_ortho_adam_{name}": (
            "flexdemo",
            "scheme=sparseloco,inner_steps=8,topk=64,value_bits=2,pack_indices=true,index_coding=elias_fano,"
            f"update=orthogonal,{setting}",
        )
        for name, setting in (
            ("outer_lr1", "outer_lr=1.0"),
            ("ef0.95", "outer_momentum=0.95"),
            ("ef0.99", "outer_momentum=0.99"),
            ("ef0.8", "outer_momentum=0.8"),
            ("ef0.5", "outer_momentum=0.5"),
        )
    },
    # ... and on 128 x 128 tiles at one share (`wire=top144_c128_2bit`'s knobs, which beat `2bit` at 300x on all three
    # presets), every 4 steps and, with twice the top-k, every 8; about the same bytes as top 32 every 4 steps; each
    # also with error feedback's decay at 0.8 (0.9 by default), the fine-tuning probes' best
    **{
        f"sparseloco_h{h}_c128_2bit_ortho_adam{suffix}": (
            "flexdemo",
            f"scheme=sparseloco,inner_steps={h},topk={k},chunk=128,scale_topk=true,value_bits=2,pack_indices=true,"
            f"index_coding=elias_fano,update=orthogonal{setting}",
        )
        for h, k in ((4, 144), (8, 288))
        for suffix, setting in (("", ""), ("_ef0.8", ",outer_momentum=0.8"))
    },
    "sparseloco_h4_2bit_ortho_adam_ef0.8": (
        "flexdemo",
        "scheme=sparseloco,inner_steps=4,topk=32,value_bits=2,pack_indices=true,index_coding=elias_fano,"
        "update=orthogonal,outer_momentum=0.8",
    ),
    # Where the outer steps' loss goes: the same outer steps every 4 steps with the whole pseudo-gradient averaged
    # (DiLoCo with Muon inside, its outer Nesterov step; 3x to 4x fewer bytes than dense), and SparseLoCo's top 32
    # with float32 values and 16-bit indices (no quantization)
    "diloco_h4_ortho_adam": ("flexdemo", "scheme=diloco,inner_steps=4,update=orthogonal"),
    # ... and the parameters averaged every 4 steps (no outer momentum, outer_lr=1): local Muon's steps
    "diloco_h4_avg_ortho_adam": (
        "flexdemo",
        "scheme=diloco,inner_steps=4,outer_lr=1.0,outer_momentum=0.0,update=orthogonal",
    ),
    "sparseloco_h4_f32_ortho_adam": (
        "flexdemo",
        "scheme=sparseloco,inner_steps=4,topk=32,update=orthogonal",
    ),
    # The control: nothing crosses nodes, each node trains alone with the default rule (what the wire is worth)
    "none_ortho_adam": ("flexdemo", "scheme=none,update=orthogonal"),
}
OUTER_STEP_PROBES = tuple(
    name
    for name in CONFIGS
    if name.startswith("sparseloco_h8_top64_2bit_ortho_adam_")
    or "_c128_" in name
    or name.endswith("_ef0.8")
    or name.startswith("diloco_h4_")
    or name == "sparseloco_h4_f32_ortho_adam"
)
"""The outer step's own settings and tiles moved (probes, 2026-11-29): swept as the outer steps with Muon inside."""
WIRE_PROBES = {
    "demo_top128": "topk=128",
    "demo_top512": "topk=512",
    "demo_top32_1bit": "value_bits=1,pack_indices=true",  # about 300x: more coefficients at fewer bits than top 24
    "demo_top6_1bit": "topk=6,value_bits=1,pack_indices=true",  # about 1200x, against top 4's 1500x
    "demo_top96_2bit": "topk=96,value_bits=2,pack_indices=true",  # DeMo's default bytes (0.9x), 3x its coefficients
    "demo_top26_1bit": "topk=26,value_bits=1,pack_indices=true",  # top 24 at 2 bits' bytes (318x-347x), 2 more
    # Elias-Fano indices (9 bits each): top 24 at 2 bits' bytes with fixed-width indices
    "demo_top32_1bit_ef": "value_bits=1,pack_indices=true,index_coding=elias_fano",
    # 128 x 128 tiles at 2 bits, the same density (128 of 16,384): one scale per 4 of today's tiles, and the
    # top-k drawn over a larger area (towards top-k per matrix); 0.94x `2bit`'s bytes with Elias-Fano
    "demo_top128_chunk128_2bit_ef": "topk=128,chunk=128,value_bits=2,pack_indices=true,index_coding=elias_fano",
    # The most coefficients at 2 bits within the default wire's bytes (1,520 of its 1,536 bits a tile)
    "demo_top176_2bit_ef": "topk=176,value_bits=2,pack_indices=true,index_coding=elias_fano",
    # Top 128 at 4 bits, within the default wire's bytes (1,440 of its 1,536 bits a tile): top 128's fp32 loss?
    "demo_top128_4bit_ef": "topk=128,value_bits=4,pack_indices=true,index_coding=elias_fano",
    # At 2bit's bytes (376 of its 384 bits a tile): fewer coefficients at 4 bits instead of 32 at 2
    "demo_top26_4bit_ef": "topk=26,value_bits=4,pack_indices=true,index_coding=elias_fano",
    # 2bit's bytes to the bit (384 a tile): 36 coefficients at 1 bit instead of 32 at 2, whose codes are nearly all
    # the tile's largest value (the top 32 of a tile are within a few percent of each other after error feedback)
    "demo_top36_1bit_ef": "topk=36,value_bits=1,pack_indices=true,index_coding=elias_fano",
    # About 1,000x: 128 x 128 tiles at 1 bit, one scale per 16,384 positions and Elias-Fano indices, so that the
    # bytes of top 4 of 4,096 at 1 bit carry 2 to 4 times its coefficients
    **{
        f"demo_top{k}_chunk128_1bit_ef": f"topk={k},chunk=128,value_bits=1,pack_indices=true,index_coding=elias_fano"
        for k in (16, 20, 22, 24, 28, 32)
    },
    # About `2bit`'s bytes (334x): 128 x 128 tiles at 1 bit, 40 coefficients per 4,096 against its 32 at 2 bits
    "demo_top160_chunk128_1bit_ef": "topk=160,chunk=128,value_bits=1,pack_indices=true,index_coding=elias_fano",
    # Issue 45: 128 x 128 tiles with every tile at one density (scale_topk): a smaller tile (a side 128 does not
    # divide, a half-width FSDP shard, a norm) keeps its share of the top 144 (1 in 114), where unscaled it kept all
    # 128 (237x on T5); about 325x on the OLMo2 and T5 presets' shapes
    "demo_top144_chunk128_2bit_ef_scaled": (
        "topk=144,chunk=128,scale_topk=true,value_bits=2,pack_indices=true,index_coding=elias_fano"
    ),
    # Issue 45, direction 3 (its simplest form): `wire=2bit`'s exchange every 3 steps, the gradients of the steps
    # between accumulated in the momentum (replicate_every), so about 1,000x fewer bytes per step than dense
    "demo_2bit_every3": "topk=32,value_bits=2,pack_indices=true,index_coding=elias_fano,replicate_every=3",
}
"""Issue 35: more of each tile's coefficients on the wire (DeMo sends 32 of 4,096): how the default rule's loss
moves between DeMo's wire and the uncompressed one, and at equal bytes, more coefficients at fewer bits."""
CONFIGS |= {f"{wire}_ortho_adam": ("flexdemo", f"{args},update=orthogonal") for wire, args in WIRE_PROBES.items()}
STUDIED_PRESETS = ("demo", "top96_2bit", "2bit", "top4_1bit")
"""The named wires this study ran by name (its runs.json rows keep them); a preset taken out since is spelled out."""
CONFIGS |= {f"wire_{preset}_ortho_adam": ("flexdemo", f"wire={preset},update=orthogonal") for preset in STUDIED_PRESETS}
CONFIGS["wire_top24_2bit_ortho_adam"] = (
    "flexdemo", "topk=24,value_bits=2,pack_indices=true,index_coding=elias_fano,update=orthogonal"
)  # fmt: skip
CONFIGS |= {  # presets taken out of the package (commit 17d8727): their knobs, spelled out
    "wire_top128_4bit_ortho_adam": ("flexdemo", f"{WIRE_PROBES['demo_top128_4bit_ef']},update=orthogonal"),
    "wire_top144_c128_2bit_ortho_adam": (
        "flexdemo",
        f"{WIRE_PROBES['demo_top144_chunk128_2bit_ef_scaled']},update=orthogonal",
    ),
    "wire_top16_2bit_ortho_adam": (
        "flexdemo",
        "topk=16,value_bits=2,pack_indices=true,index_coding=elias_fano,update=orthogonal",
    ),
}
"""The ``wire=`` presets as a user names them. Those that code indices in Elias-Fano send the same coefficients
as their fixed-width twins above (``demo_2bit_ortho_adam`` for ``wire=2bit``), so their runs are the twins' runs
in fewer bytes; ``--wire_bytes`` measures those bytes without training."""
MOMENTUM_DECAYS = (0.99, 0.95, 0.9)
"""Issue 35: the momentum's ``decay`` with the default rule (DeMo's 0.999 was tuned for the sign rule). An entry
DeMo does not send waits in the momentum, so the decay bounds how stale the update's entries are."""
CONFIGS |= {
    f"{wire}_ortho_adam_decay{decay:g}": (
        "flexdemo",
        ",".join(
            filter(
                None,
                ((SIGN_CONFIGS | WIRE_PROBES)[wire], "update=orthogonal", f"decay={decay}"),
            )
        ),
    )
    for wire in ("demo", "demo_2bit", "demo_top24_2bit", "demo_aggressive", "demo_top6_1bit")
    for decay in MOMENTUM_DECAYS
}

# The learning rates swept on seed 0, per model. OLMo2's come from the 150-step pilot
# (BENCHMARKS.md): each configuration's best rate there and twice it where the best sat at the
# top of the pilot's x0.5/1/2 sweep (DiLoCo's was inside it, so 1.5x). T5's bracket AdamW-HSDP's
# and `demo`'s best; the `demo` wire formats run at `demo`'s best (on OLMo2 they end within a
# few tenths of a percent of each other at either rate), DiLoCo and SparseLoCo get their own.
SIGN_UPDATE = (4e-3, 8e-3)
AT_DEMOS_T5_RATE = ("demo_bf16", "demo_sign", "demo_4bit", "demo_2bit", "demo_top16_2bit", "demo_top24_2bit")
AT_DEMOS_T5_RATE += ("demo_top64_2bit", "demo_aggressive", "full", "random", "striding")
UPDATE_RULE_CONFIGS = tuple(name for name in CONFIGS if name.endswith("_adam") or "_decay" in name)
UPDATE_RULE_RATES = (4e-3, 8e-3, 1.6e-2)
"""The rules take steps of about a sign step's size per entry: swept around sign's best (OLMo2's 8e-3),
extended downwards where the best sat at the bottom."""
AT_ORTHO_ADAMS_RATE = tuple(f"{wire}_ortho_adam" for wire in RULE_WIRES if wire not in ("demo", "full"))
"""Wire formats with the orthogonal + adam rule: run at demo_ortho_adam's chosen rate, found by its sweep in
the same study (as the sign wire formats at demo's on T5). Their ``SWEEPS`` entry is the fallback."""
AT_DEMOS_RULE_RATE = {f"full_{rule}": f"demo_{rule}" for rule in ("adam", "ortho_adam")}
"""The uncompressed wire with a rule: run at the rate the rule chose on DeMo's wire, so that the two rows
differ only in the compression."""
SWEEPS = {
    "olmo2": {
        "adamw_hsdp": (2e-3, 4e-3, 8e-3),
        **dict.fromkeys(UPDATE_RULE_CONFIGS, UPDATE_RULE_RATES),
        "demo_ortho_adam": (2e-3, 4e-3, 8e-3),  # 1.6e-2 ended 3.8% above 4e-3's loss in the first sweep
        "demo_adam": (2e-3, 4e-3, 8e-3, 1.6e-2),  # steps of Adam's size per entry: around AdamW-HSDP's best
        **dict.fromkeys(("demo", "demo_sign", "demo_2bit", "demo_top16_2bit", "demo_aggressive"), SIGN_UPDATE),
        **dict.fromkeys(("demo_top64_2bit", "demo_top24_2bit"), SIGN_UPDATE),  # not run on OLMo2
        # Run last: they took demo's best without a sweep.
        **dict.fromkeys(("demo_bf16", "demo_4bit", "full", "random", "striding"), (8e-3,)),
        "diloco": (1e-3, 1.5e-3),
        "sparseloco": (2e-3, 4e-3),
        "sparseloco_h3_2bit": (4e-3, 8e-3, 1.6e-2, 3.2e-2),  # each best at the top of the ones before
        # The inner steps of Muon's size: from the default's rate up, as the best kept sitting at the top
        **dict.fromkeys(
            ("sparseloco_h3_2bit_ortho_adam", "sparseloco_h4_2bit_ortho_adam", "sparseloco_h5_2bit_ortho_adam"),
            (4e-3, 8e-3, 1.6e-2, 3.2e-2, 6.4e-2),
        ),
        **dict.fromkeys(OUTER_STEP_PROBES, (8e-3, 1.6e-2, 3.2e-2)),
    },
    "t5": {
        "adamw_hsdp": (1e-3, 2e-3, 4e-3, 8e-3),
        **dict.fromkeys(UPDATE_RULE_CONFIGS, UPDATE_RULE_RATES),
        "demo_ortho_adam": (2e-3, 4e-3, 8e-3, 1.6e-2),  # 8e-3 won at the top of 2e-3..8e-3
        "demo_adam": (2e-3, 4e-3, 8e-3, 1.6e-2),
        "demo": (2e-3, 4e-3, 8e-3),
        **dict.fromkeys(AT_DEMOS_T5_RATE, (4e-3,)),
        "diloco": (1e-3, 2e-3),
        "sparseloco": (2e-3, 4e-3),
        "sparseloco_h3_2bit": (4e-3, 8e-3, 1.6e-2),
        **dict.fromkeys(("sparseloco_h4_2bit_ortho_adam", "sparseloco_h5_2bit_ortho_adam"), (8e-3, 1.6e-2, 3.2e-2)),
        **dict.fromkeys(OUTER_STEP_PROBES, (8e-3, 1.6e-2, 3.2e-2)),
    },
    # At scale: each side's small-scale best and the next rate in the direction larger models move (down), the
    # compressed presets from their small-scale best (twice the default's) down.
    # (The other configurations take OLMo2's sweeps there; see below.)
    "olmo2_10x": {  # AdamW-HSDP's and the default's best sat at the bottom of 2e-3..4e-3, so both go to 1e-3;
        # the compressed presets, twice the default's rate at 1.6M, bracket the default's best at 10x and twice it
        "adamw_hsdp": (1e-3, 2e-3, 4e-3),
        "demo_ortho_adam": (1e-3, 2e-3, 4e-3),
        "wire_2bit_ortho_adam": (2e-3, 4e-3),
        "wire_top128_4bit_ortho_adam": (2e-3, 4e-3),
    },  # fmt: skip
    "olmo2_125m": {
        "adamw_hsdp": (5e-4, 1e-3, 2e-3),
        "demo_ortho_adam": (1e-3, 2e-3, 4e-3),
        "wire_2bit_ortho_adam": (1e-3, 2e-3, 4e-3),
        "wire_top128_4bit_ortho_adam": (1e-3, 2e-3, 4e-3),
    },  # fmt: skip
    # Fine-tuning: swept from 2.5e-4 (fine-tuning often wants small steps) up to where the loss turns
    # (8e-3 won at the top of 2.5e-4..8e-3 for AdamW-HSDP, demo and orthogonal + adam, hence 1.6e-2).
    "olmo2_ft": {name: (2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2) for name in CONFIGS}
    | {"demo_adam": (2e-3, 4e-3, 8e-3, 1.6e-2)}  # about the others' best (8e-3)
    | {"sparseloco_h4_2bit_ortho_adam": (4e-3, 8e-3, 1.6e-2, 3.2e-2, 6.4e-2)},  # as on pretraining: the best at the top
    # The 10x model on real nodes, for what one process cannot simulate (replicas that drift apart): each side at the
    # default's 10x rate, the outer steps from twice it up (at 1.6M their best was 2x-4x the default's)
    "olmo2_10x_nodes": {
        "none_ortho_adam": (1e-3, 2e-3, 4e-3),
        "sparseloco_h4_2bit_ortho_adam": (4e-3, 8e-3),
        "adamw_hsdp": (2e-3,),
        "demo_ortho_adam": (2e-3,),
    },
}
for _model in ("olmo2_10x", "olmo2_125m"):
    SWEEPS[_model] = SWEEPS["olmo2"] | SWEEPS[_model]
SWEEPS["olmo2_10x_nodes"] = SWEEPS["olmo2_10x"] | SWEEPS["olmo2_10x_nodes"]
# Fine-tuning at 10x: each side's 1.6M best (8e-3) down to a quarter of it, as pretraining's best halved at 10x; the
# outer steps from half their 1.6M best (1.6e-2) up.
_AT_FT_10X = ("adamw_hsdp", "demo_ortho_adam", "wire_2bit_ortho_adam", "wire_top128_4bit_ortho_adam", "none_ortho_adam")
SWEEPS["olmo2_ft_10x"] = SWEEPS["olmo2_ft"] | dict.fromkeys(_AT_FT_10X, (2e-3, 4e-3, 8e-3))
SWEEPS["olmo2_ft_10x_nodes"] = SWEEPS["olmo2_ft_10x"] | dict.fromkeys(
    ("sparseloco_h4_2bit_ortho_adam", "sparseloco_h5_2bit_ortho_adam"), (8e-3, 1.6e-2, 3.2e-2)
)


# model: (script, its flags); "{base}" is the study's pretrained base model (olmo2_ft).
PRESETS = {
    "olmo2": ("train_olmo2.py", ["--offline_text", "stdlib"]),  # 4.6x the text: 250 steps are 2 epochs, not 12
    "t5": ("train_t5.py", []),
    "olmo2_ft": (
        "train_olmo2.py",
        ["--offline_text", "pydoc", "--model_name_or_path", "{base}", "--no_from_config"],
    ),
}
SIMULATED = {"olmo2_10x": 2, "olmo2_125m": 2}
"""The presets at scale: R replicas simulated in one process (``simulate_replicas``; AdamW-HSDP's counterpart is
AdamW on the mean of the R micro-batches' gradients), one micro-batch per replica and step."""
PRESETS |= {
    # 10x the offline preset's 1.57M parameters (15.7M: width 320, 8 layers, the same 4,096-token vocabulary and
    # 128-token blocks), on 2 CPU cores.
    "olmo2_10x": ("train_olmo2.py", ["--offline_text", "stdlib", "--hidden_size", "320", "--num_layers", "8"]),
    # 125.9M (width 768, 12 layers, an 8,192-token vocabulary, 512-token blocks) on one GPU, on 40 MB of Python
    # source: 1,000 steps of 2 x 8 blocks read 8M tokens, less than the text holds.
    "olmo2_125m": (
        "train_olmo2.py",
        [
            "--offline_text",
            "python_source",
            "--hidden_size",
            "768",
            "--num_layers",
            "12",
            "--vocab_size",
            "8192",
            "--block_size",
            "512",
            "--bf16",
            "--dataloader_num_workers",
            "2",
        ],
    ),  # fmt: skip
}
PRESETS["olmo2_10x_nodes"] = ("train_olmo2.py", [*PRESETS["olmo2_10x"][1], "--per_device_train_batch_size", "4"])
"""The 10x model on 2 nodes x 2 processes, 4 blocks a process: 8 a node a step, as each simulated replica takes.
For ``scheme=none`` and the outer-step schemes, whose replicas ``simulate_replicas`` cannot hold apart."""
# Fine-tuning at 10x: the 10x model pretrained once (BASE_MODELS), then fine-tuned as olmo2_ft is, with replicas
# simulated or (for none and the outer steps) on real nodes, 8 blocks a replica a step as at 10x pretraining.
PRESETS["olmo2_ft_10x"] = PRESETS["olmo2_ft"]
PRESETS["olmo2_ft_10x_nodes"] = ("train_olmo2.py", [*PRESETS["olmo2_ft"][1], "--per_device_train_batch_size", "4"])
SIMULATED["olmo2_ft_10x"] = 2
AT_SCALE = ("olmo2_10x", "olmo2_125m", "olmo2_10x_nodes")
"""The presets whose tokenized text is cached in ``DATA_CACHE`` (pretraining from a config)."""
SCALE_CONFIGS = ("adamw_hsdp", "demo_ortho_adam", "wire_2bit_ortho_adam", "wire_top128_4bit_ortho_adam")
"""AdamW-HSDP, the default (DeMo's wire and the default rule), and the two compressed presets the README leads with."""
DRY_RUN = ["--hidden_size", "64", "--num_layers", "2", "--vocab_size", "1024", "--block_size", "64"]
DRY_RUN += ["--max_train_samples", "256", "--max_eval_samples", "16"]
"""``--dry_run``: every configuration a few steps on a model this small, to find a broken pipeline in seconds."""
BASE_MODEL = ["--offline_text", "docstrings", "--optim", "adamw_torch"]
BASE_MODEL += ["--max_steps", "300", "--warmup_steps", "15", "--seed", "0", "--save_strategy", "no"]
BASE_MODELS = {
    "olmo2_ft": [*BASE_MODEL, "--learning_rate", "4e-3"],
    # the 10x model, at AdamW-HSDP's best 10x pretraining rate, 8 blocks a node as its fine-tuning takes
    "olmo2_ft_10x": [*BASE_MODEL, "--learning_rate", "2e-3", "--hidden_size", "320", "--num_layers", "8"]
    + ["--per_device_train_batch_size", "4"],
}
"""Each fine-tuning preset's base: AdamW-HSDP on the standard library's docstrings (its best pretraining rate on
OLMo2 at that size)."""
BASE_MODELS["olmo2_ft_10x_nodes"] = BASE_MODELS["olmo2_ft_10x"]


def base_model(study_dir: Path, model: str = "olmo2_ft") -> Path:
    """The pretrained base model that a fine-tuning preset fine-tunes, trained once per study directory (the 10x
    presets, simulated and on nodes, share theirs)."""
    base = study_dir / "base"
    flags = BASE_MODELS[model]
    width = int(flags[flags.index("--hidden_size") + 1]) if "--hidden_size" in flags else 128  # the script's default
    if not (base / "model.safetensors").exists():
        print(f"pretraining the base model into {base}", flush=True)
        launch("train_olmo2.py", [*flags, "--report_to", "none"], base)
    elif json.loads((base / "config.json").read_text())["hidden_size"] != width:
        sys.exit(f"quality_study: {base} is another preset's base model (not {width} wide); --model {model} needs "
                 "its own --out")  # fmt: skip
    return base


def run(
    model: str,
    name: str,
    lr: float,
    seed: int,
    steps: int,
    work: Path,
    batch: int,
    base: Path | None,
    timing=False,
    dry_run: bool = False,
) -> dict:
    """One training run; ``timing``: no evaluations, only the time per step is kept."""
    optim, optim_args = CONFIGS[name]
    replicas = SIMULATED.get(model)
    out = work / f"{model}_{name}_lr{lr:g}_s{seed}"
    eval_every = max(steps // 10, 1)
    script, flags = PRESETS[model]
    args = [
        "--max_steps", str(steps), "--seed", str(seed),
        "--learning_rate", str(lr), "--optim", optim, "--logging_steps", str(eval_every),
        "--save_strategy", "no", "--report_to", "none", "--warmup_steps", str(steps // 20),
    ]  # fmt: skip
    if timing:
        args += ["--eval_strategy", "no"]
    else:
        args += ["--eval_strategy", "steps", "--eval_steps", str(eval_every), "--max_eval_samples", "128"]
    args += [flag.format(base=base) for flag in flags]
    if batch:
        args += ["--per_device_train_batch_size", str(batch)]
    if model in AT_SCALE:  # the text tokenized once for every run
        args += ["--data_cache", str(DATA_CACHE)]
    if replicas:  # one micro-batch per simulated replica
        args += ["--gradient_accumulation_steps", str(replicas)]
        if optim == "flexdemo":
            optim_args = ",".join(filter(None, (optim_args, f"simulate_replicas={replicas}")))
    if dry_run:
        args += DRY_RUN + (["--bf16", "false"] if "--bf16" in args else [])
    if optim_args:
        args += ["--optim_args", optim_args]
    started = time.time()
    launch(script, args, out, one_process=bool(replicas))
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    train = next(h for h in history if "train_runtime" in h)
    if timing:
        timed = {"model": model, "config": name, "lr": lr, "steps": steps, "step_s": train["train_runtime"] / steps}
        return timed | steady_bytes(history)
    evals = [(h["step"], h["eval_loss"]) for h in history if "eval_loss" in h and h["step"] <= steps]
    logged = [h for h in history if "flexdemo/bytes_sent" in h]
    result = {
        "model": model, "config": name, "lr": lr, "seed": seed, "steps": steps,
        "eval_curve": evals, "final_eval_loss": evals[-1][1],
        "step_s": train["train_runtime"] / steps, "wall_s": time.time() - started,
    }  # fmt: skip
    scores = [h for h in history if "eval_bleu" in h]
    if scores:  # T5: the final evaluation's BLEU and chrF
        result["bleu"], result["chrf"] = scores[-1]["eval_bleu"], scores[-1]["eval_chrf"]
    if logged:
        last = logged[-1]
        result["bytes_per_step"] = last["flexdemo/bytes_sent"] / last["step"]
        result["dense_bytes_per_step"] = last["flexdemo/dense_bytes"] / last["step"]
    if replicas:
        result |= {"replicas": replicas, "parameters": parameter_count(out), "device": device_name()}
    return result


def steady_bytes(history: list[dict]) -> dict:
    """Bytes per step after the first (which also carries the one-off start check), from a run logged every
    step; empty for a run that logged no bytes or fewer than two steps."""
    sent = [h for h in history if "flexdemo/bytes_sent" in h]
    if len(sent) < 2 or sent[-1]["step"] - sent[0]["step"] != len(sent) - 1:
        return {}
    first, last, steps = sent[0], sent[-1], len(sent) - 1
    return {
        "bytes_per_step": (last["flexdemo/bytes_sent"] - first["flexdemo/bytes_sent"]) / steps,
        "dense_bytes_per_step": (last["flexdemo/dense_bytes"] - first["flexdemo/dense_bytes"]) / steps,
    }


class Runs:
    """Every finished run, kept in ``runs.json`` so that an interrupted study resumes."""

    def __init__(self, path: Path):
        self.path = path
        self.items = json.loads(path.read_text()) if path.exists() else []

    def get(self, model, name, lr, seed, steps, work, batch, base=None, deadline=math.inf) -> dict | None:
        """The run, from ``runs.json`` or run now; None if it is not there and ``deadline`` (a ``time.time()``) has
        passed."""
        for item in self.items:
            if (item["model"], item["config"], item["lr"], item["seed"], item["steps"]) == (
                model,
                name,
                lr,
                seed,
                steps,
            ):
                return item
        if time.time() > deadline:
            return None
        item = run(model, name, lr, seed, steps, work, batch, base)
        self.items.append(item)
        self.path.write_text(json.dumps(self.items, indent=1))
        print(f"{model} {name} lr={lr:g} seed={seed}: eval loss {item['final_eval_loss']:.4f}", flush=True)
        return item


def study(args) -> bool:
    """Every configuration's sweep on seed 0, then its seeds at the best rate; returns whether all ran (False: the
    time budget ran out first; the next call resumes)."""
    args.out.mkdir(parents=True, exist_ok=True)
    runs = Runs(args.out / "runs.json")
    base = base_model(args.out, args.model) if "{base}" in PRESETS[args.model][1] else None
    deadline = time.time() + args.time_budget if args.time_budget else math.inf
    best = {}
    with tempfile.TemporaryDirectory() as tmp:
        # Every configuration's sweep before any seed: a study cut short still compares them all on seed 0.
        for name in args.configs:
            rates = args.rates.get(name) or swept_rates(args.model, name, runs.items, args.steps)
            swept = [
                runs.get(args.model, name, lr, 0, args.steps, Path(tmp), args.batch, base, deadline) for lr in rates
            ]
            if None in swept:
                return False
            best[name] = min(
                swept, key=lambda r: r["final_eval_loss"] if math.isfinite(r["final_eval_loss"]) else math.inf
            )
        for name in args.configs:
            for seed in args.seeds:
                if (
                    runs.get(
                        args.model, name, best[name]["lr"], seed, args.steps, Path(tmp), args.batch, base, deadline
                    )
                    is None
                ):
                    return False
    return True


def dry_run(args) -> None:
    """``--dry_run``: every configuration 3 steps on a tiny model of the preset's kind, nothing recorded."""
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs:
            started = time.time()
            item = run(args.model, name, 1e-3, 0, 3, Path(tmp), args.batch, None, dry_run=True)
            print(f"dry run {args.model} {name}: eval loss {item['final_eval_loss']:.3f}, {item['parameters']:,} "
                  f"parameters on {item['device']}, {time.time() - started:.0f} s", flush=True)  # fmt: skip


def retime(args, runs: Runs) -> None:
    """``--retime N``: N short runs of each configuration at its chosen rate, taken in turns, so that
    every configuration's compute per step is timed under the same conditions (the median is reported).
    Resumable like the study: ``<out>/timings.json``."""
    table = summarize([i for i in runs.items if i["model"] == args.model])
    names = [name for name in args.configs if (args.model, name) in table]
    path = args.out / "timings.json"
    timings = json.loads(path.read_text()) if path.exists() else []
    done = {(t["model"], t["config"], t["lr"], t["steps"], t["rep"]) for t in timings}
    base = base_model(args.out, args.model) if "{base}" in PRESETS[args.model][1] else None
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.retime):
            for name in names:
                lr = table[(args.model, name)]["lr"]
                if (args.model, name, lr, args.retime_steps, rep) in done:
                    continue
                item = run(args.model, name, lr, 0, args.retime_steps, Path(tmp), args.batch, base, timing=True)
                timings.append(item | {"rep": rep})
                path.write_text(json.dumps(timings, indent=1))
                print(f"timing {args.model} {name} lr={lr:g} #{rep}: {item['step_s']:.3f} s/step", flush=True)


def wire_bytes(args) -> None:
    """``--wire_bytes``: each configuration's bytes per step from a 3-step run (no evaluations, any rate), without
    the first step's one-off start check: ``<out>/wire_bytes.json``."""
    path = args.out / "wire_bytes.json"
    measured = json.loads(path.read_text()) if path.exists() else {}
    base = base_model(args.out, args.model) if "{base}" in PRESETS[args.model][1] else None
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs:
            if name in measured:
                continue
            timed = run(args.model, name, 1e-3, 0, 3, Path(tmp), args.batch, base, timing=True)
            measured[name] = {key: timed[key] for key in ("bytes_per_step", "dense_bytes_per_step")}
            path.write_text(json.dumps(measured, indent=1))
            row = measured[name]
            fewer = row["dense_bytes_per_step"] / row["bytes_per_step"]
            print(
                f"{args.model} {name}: {row['bytes_per_step']:,.0f} bytes per step, {fewer:.0f}x fewer than dense",
                flush=True,
            )


def swept_rates(model: str, name: str, items: list[dict], steps: int) -> tuple[float, ...]:
    """The rates ``name`` runs on seed 0: its sweep, or the rate its rule chose on DeMo's default wire."""
    chooser = "demo_ortho_adam" if name in AT_ORTHO_ADAMS_RATE else AT_DEMOS_RULE_RATE.get(name)
    if chooser:
        key = (model, chooser, 0, steps)
        chosen = [i for i in items if (i["model"], i["config"], i["seed"], i["steps"]) == key]
        if chosen:
            return (min(chosen, key=lambda r: r["final_eval_loss"])["lr"],)
    return SWEEPS[model][name]


def summarize(items: list[dict], timings: list[dict] = ()) -> dict[str, dict]:
    """Per (model, config): the seeds at the chosen (best-on-seed-0) learning rate.

    The compute per step is the median of the ``--retime`` runs where there are any, else the
    fastest of the chosen runs (other work on this machine only ever slows a step down)."""
    table = {}
    for key in sorted({(i["model"], i["config"]) for i in items}):
        mine = [i for i in items if (i["model"], i["config"]) == key]
        seed0 = [i for i in mine if i["seed"] == 0]
        lr = min(seed0, key=lambda r: r["final_eval_loss"])["lr"]
        chosen = [i for i in mine if i["lr"] == lr]
        losses = [i["final_eval_loss"] for i in chosen]
        row = {
            "lr": lr,
            "swept": sorted({i["lr"] for i in seed0}),
            "seeds": len(chosen),
            "loss_mean": statistics.mean(losses),
            "loss_spread": (max(losses) - min(losses)) / 2,
            "step_s": min(i["step_s"] for i in chosen),
            "timed": "fastest run",
            "runs": chosen,
        }
        timed = [t["step_s"] for t in timings if (t["model"], t["config"], t["lr"]) == (*key, lr)]
        if timed:
            row["step_s"], row["timed"] = statistics.median(timed), f"median of {len(timed)}"
        for score in ("bleu", "chrf"):
            if all(score in i for i in chosen):
                values = [i[score] for i in chosen]
                row[score] = (statistics.mean(values), (max(values) - min(values)) / 2)
        if "bytes_per_step" in chosen[0]:
            row["bytes_per_step"] = statistics.median(i["bytes_per_step"] for i in chosen)
            row["dense_bytes_per_step"] = statistics.median(i["dense_bytes_per_step"] for i in chosen)
        table[key] = row
    for (model, name), row in table.items():
        dense = next(
            (r["dense_bytes_per_step"] for (m, _), r in table.items() if m == model and "dense_bytes_per_step" in r),
            None,
        )
        if name == "adamw_hsdp" and dense is not None:
            row["bytes_per_step"] = dense  # its all-reduce: the dense bytes the FlexDeMo runs count
        if dense and row.get("bytes_per_step"):
            row["ratio_to_dense"] = dense / row["bytes_per_step"]
        baseline = table.get((model, "adamw_hsdp"))
        if baseline:
            row["vs_adamw"] = row["loss_mean"] / baseline["loss_mean"] - 1
    return table


RULES_PLOT = ("adamw_hsdp", "demo", "full")
"""Besides the update-rule configurations, what their plots (``<model>_rules_*.png``) compare against."""


def modelled_step(row: dict, rate: str) -> float:
    """Seconds a step would take on a link of ``rate``: its compute plus its bytes at the rate."""
    return row["step_s"] + 8 * row.get("bytes_per_step", 0) / RATES[rate]


def mean_curve(row: dict) -> list[tuple[int, float]]:
    """(step, validation loss averaged over the row's seeds) at every evaluation."""
    curves = [r["eval_curve"] for r in row["runs"]]
    return [(step, statistics.mean(c[i][1] for c in curves)) for i, (step, _) in enumerate(curves[0])]


def time_to_baseline(row: dict, baseline: dict, rate: str = "100mbit") -> float | None:
    """Modelled time to reach the baseline's final loss (mean curves), as a fraction of the baseline's
    whole run at ``rate``; None if the configuration never reaches it. Resolution: the evaluations."""
    target_step, target = mean_curve(baseline)[-1]
    whole = target_step * modelled_step(baseline, rate)
    reached = next((step for step, loss in mean_curve(row) if loss <= target), None)
    return None if reached is None else reached * modelled_step(row, rate) / whole


def check_plotting() -> None:
    """The report plots with matplotlib (the ``bench`` extra): said before hours of runs, not after them."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        sys.exit(
            f"quality_study: the report's plots need matplotlib; run {sys.executable} -m pip install -e '.[bench]'"
        )


def report(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timings = json.loads((out / "timings.json").read_text()) if (out / "timings.json").exists() else []
    table = summarize(json.loads((out / "runs.json").read_text()), timings)
    lines = []
    for model in sorted({m for m, _ in table}):
        rows = {name: row for (m, name), row in table.items() if m == model}
        scored = all("bleu" in row for row in rows.values())
        extra = " BLEU | chrF |" if scored else ""
        lines += [
            f"| {model} | lr (of those swept) | seeds | final val. loss (mean +- half-range) | vs AdamW-HSDP |{extra} "
            "bytes/step (node 0) | x fewer than dense | compute/step (s) | modelled s/step at 100 Mbit/s, 1 Gbit/s "
            "| time to AdamW-HSDP's final loss at 100 Mbit/s (x its time) |",
            "| --- " * (10 + 2 * scored) + "|",
        ]  # fmt: skip
        simulated = model in SIMULATED  # a step's time is every replica's compute in one process: no link model
        for name, row in rows.items():
            reach = time_to_baseline(row, rows["adamw_hsdp"]) if "adamw_hsdp" in rows and not simulated else None
            swept = ", ".join(f"{lr:g}" for lr in row["swept"])
            planned = SWEEPS.get(model, {}).get(name, ())
            if set(planned) - set(row["swept"]):  # a study cut short: the rate is the best of those run so far
                swept += "; sweep incomplete"
            scores = "".join(f" {row[s][0]:.2f} +- {row[s][1]:.2f} |" for s in ("bleu", "chrf")) if scored else ""
            lines.append(
                f"| {name} | {row['lr']:g} ({swept}) | {row['seeds']} "
                f"| {row['loss_mean']:.4f} +- {row['loss_spread']:.4f} "
                f"| {row.get('vs_adamw', float('nan')):+.1%} |{scores} {row.get('bytes_per_step', float('nan')):,.0f} "
                f"| {row.get('ratio_to_dense', float('nan')):.0f} | {row['step_s']:.3f} ({row['timed']}) "
                + (
                    "| not modelled (simulated replicas) | not modelled |" if simulated else
                    f"| {modelled_step(row, '100mbit'):.3f}, {modelled_step(row, '1gbit'):.3f} "
                    f"| {'not reached' if reach is None else f'{reach:.2f}'} |"
                )
            )  # fmt: skip
        lines.append("")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    for model in sorted({m for m, _ in table}):
        every = {name: row for (m, name), row in table.items() if m == model}
        rules = {name: row for name, row in every.items() if name in RULES_PLOT or name.endswith(("_adam", "_ortho"))}
        axes = ("steps",) if model in SIMULATED else ("steps", *RATES)
        for prefix, rows, axis in [(model, every, a) for a in axes] + [(f"{model}_rules", rules, a) for a in axes]:
            fig, ax = plt.subplots(figsize=(8, 5))
            for index, (name, row) in enumerate(rows.items()):
                steps, mean = zip(*mean_curve(row))
                xs = steps if axis == "steps" else [s * modelled_step(row, axis) for s in steps]
                style = "-" if index < 10 else "--"  # the default cycle has ten colours
                ax.plot(xs, mean, style, label=name, linewidth=2.5 if name == "adamw_hsdp" else 1.5)
            ax.set_xlabel("step" if axis == "steps" else f"modelled wall-clock at {axis} (s)")
            ax.set_ylabel("validation loss (mean over seeds)")
            layout = (
                f"{SIMULATED[model]} replicas simulated in one process"
                if model in SIMULATED
                else "2 nodes x 2 processes"
            )
            ax.set_title(f"{model}, offline preset, {layout}")
            ax.legend(fontsize=8)
            fig.tight_layout()
            fig.savefig(out / f"{prefix}_loss_vs_{'steps' if axis == 'steps' else 'time_' + axis}.png", dpi=110)
            plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=tuple(PRESETS), default="olmo2")
    parser.add_argument("--steps", type=int, help="default 300 (--stage long: the long preset's)")
    parser.add_argument("--batch", type=int, help="per process (default: the preset's, 8 for OLMo2, 16 for T5)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--configs", nargs="+", choices=list(CONFIGS), help="default: every configuration (the presets at scale: 4)"
    )
    parser.add_argument(
        "--rates",
        nargs="+",
        default=[],
        metavar="CONFIG=LR[:LR...]",
        help="replace a configuration's swept rates (SWEEPS; e.g. demo=2e-3 runs the seeds at 2e-3)",
    )
    parser.add_argument(
        "--out", type=Path, help="default benchmarks/results/quality/study (--stage long: the long preset's name)"
    )
    parser.add_argument("--report", type=Path, help="only write the table and plots of this study directory")
    parser.add_argument(
        "--retime",
        type=int,
        default=0,
        metavar="N",
        help="after the study, time each of --configs N times at its chosen rate, in turns (timings.json)",
    )
    parser.add_argument("--retime_steps", type=int, default=40, help="steps of each timing run")
    parser.add_argument("--wire_bytes", action="store_true", help="only measure --configs' bytes per step")
    parser.add_argument(
        "--time_budget",
        type=float,
        default=0,
        help="seconds: start no run after this (--stage long: no run that would end after it); 0: no limit; resume "
        "later",
    )
    parser.add_argument(
        "--dry_run",
        action="store_true",
        help=f"{SIMULATED} presets: each configuration 3 steps on a tiny model (--stage long: the plan, no training)",
    )
    parser.add_argument(
        "--stage", choices=("long",), help="long: the long-run study (issue 64; benchmarks/quality/long_run.py)"
    )
    long_study.add_arguments(parser)
    args = parser.parse_args()
    check_plotting()
    if args.stage == "long":
        long_study.main(args)
        return
    args.steps = args.steps or 300
    args.out = args.out or ROOT / "benchmarks" / "results" / "quality" / "study"
    if args.configs is None:
        args.configs = list(SCALE_CONFIGS if args.model in SIMULATED else CONFIGS)
    args.rates = {k: tuple(float(v) for v in lrs.split(":")) for k, _, lrs in (r.partition("=") for r in args.rates)}
    if args.report:
        report(args.report)
        return
    if args.wire_bytes:
        wire_bytes(args)
        return
    if args.dry_run:
        if "{base}" in PRESETS[args.model][1]:
            sys.exit(f"quality_study: --dry_run builds a tiny model from a config; {args.model!r} fine-tunes a "
                     "pretrained base: dry-run olmo2_10x instead")  # fmt: skip
        if args.model not in SIMULATED:
            sys.exit(f"quality_study: --dry_run is for the presets at scale {sorted(SIMULATED)}, not {args.model!r}")
        dry_run(args)
        return
    if not study(args):
        print(f"quality_study: --time_budget {args.time_budget:g} s spent; run the same command again to resume")
        report(args.out)
        return
    if args.retime:
        retime(args, Runs(args.out / "runs.json"))
    report(args.out)


if __name__ == "__main__":
    main()
