"""The quality study's bookkeeping: which runs a configuration's row holds, and its ratios."""

from __future__ import annotations

import sys

import pytest
from support.launch import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks" / "quality"))

from quality_study import CONFIGS, PRESETS, SWEEPS, modelled_step, summarize  # noqa: E402

pytestmark = pytest.mark.unit


def run(config, lr, seed, loss, step_s=0.5, sent=None, dense=4000):
    item = {"model": "t5", "config": config, "lr": lr, "seed": seed, "final_eval_loss": loss, "step_s": step_s}
    if sent is not None:
        item |= {"bytes_per_step": sent, "dense_bytes_per_step": dense}
    return item


def test_a_row_holds_the_seeds_at_the_rate_that_won_on_seed_0():
    items = [
        run("adamw_hsdp", 1e-3, 0, 4.0),
        run("adamw_hsdp", 2e-3, 0, 3.0),
        run("adamw_hsdp", 2e-3, 1, 3.2, step_s=0.4),
        run("demo", 4e-3, 0, 3.5, sent=40),
        run("demo", 8e-3, 0, 3.4, sent=40),
        run("demo", 8e-3, 1, 3.2, sent=40),
        run("demo", 4e-3, 1, 1.0, sent=40),  # a seed at the losing rate: not part of the row
    ]
    table = summarize(items)
    adamw, demo = table["t5", "adamw_hsdp"], table["t5", "demo"]
    assert (adamw["lr"], adamw["swept"], adamw["seeds"]) == (2e-3, [1e-3, 2e-3], 2)
    assert adamw["loss_mean"] == pytest.approx(3.1) and adamw["loss_spread"] == pytest.approx(0.1)
    assert adamw["step_s"] == 0.4  # the least disturbed run
    assert adamw["bytes_per_step"] == 4000  # AdamW-HSDP sends the dense all-reduce
    assert (demo["lr"], demo["seeds"]) == (8e-3, 2)
    assert demo["loss_mean"] == pytest.approx(3.3)
    assert demo["vs_adamw"] == pytest.approx(3.3 / 3.1 - 1)
    assert demo["ratio_to_dense"] == pytest.approx(100)
    assert modelled_step(demo, "100mbit") == pytest.approx(0.5 + 8 * 40 / 100e6)


def test_every_configuration_has_a_sweep_on_every_preset():
    assert set(SWEEPS) == set(PRESETS)
    for model in PRESETS:
        assert set(SWEEPS[model]) == set(CONFIGS), model
        assert all(rates and rates == tuple(sorted(rates)) for rates in SWEEPS[model].values())


def test_fine_tuning_runs_start_from_the_study_base_model(tmp_path, monkeypatch):
    import quality_study

    launched = []
    monkeypatch.setattr(quality_study, "launch", lambda script, args, out, **kw: launched.append((script, args, out)))
    base = quality_study.base_model(tmp_path)
    assert base == tmp_path / "base" and "docstrings" in launched[0][1] and "adamw_torch" in launched[0][1]
    (base / "model.safetensors").parent.mkdir(parents=True)
    (base / "model.safetensors").write_bytes(b"")
    (base / "config.json").write_text('{"hidden_size": 128}')
    assert quality_study.base_model(tmp_path) == base and len(launched) == 1  # pretrained once per study
    with pytest.raises(SystemExit, match="another preset's base model"):  # the 10x preset on the 1.6M base
        quality_study.base_model(tmp_path, "olmo2_ft_10x")
    with pytest.raises(FileNotFoundError):  # the launch was faked: no trainer_state.json
        quality_study.run("olmo2_ft", "demo_adam", 1e-3, 0, 10, tmp_path, 0, base)
    script, args, _ = launched[-1]
    assert script == "train_olmo2.py"
    assert args[args.index("--model_name_or_path") + 1] == str(base) and "--no_from_config" in args
    assert args[args.index("--optim_args") + 1] == "wire=demo,update=adam"


def test_time_to_the_baselines_final_loss_counts_the_modelled_time_of_the_first_evaluation_there():
    from quality_study import time_to_baseline

    def row(curve, step_s, sent):
        return {"runs": [{"eval_curve": curve}], "step_s": step_s, "bytes_per_step": sent}

    adamw = row([(10, 5.0), (20, 4.0)], step_s=1.0, sent=12.5e6)  # 1 s compute + 1 s of bytes at 100 Mbit/s
    fast = row([(10, 3.9), (20, 3.5)], step_s=1.0, sent=0)
    assert time_to_baseline(fast, adamw) == pytest.approx(10 * 1.0 / (20 * 2.0))
    assert time_to_baseline(row([(10, 4.5), (20, 4.1)], 1.0, 0), adamw) is None
    assert time_to_baseline(adamw, adamw) == pytest.approx(1.0)


def test_the_rules_wire_formats_run_at_the_rate_orthogonal_adam_chose_in_the_same_study():
    from quality_study import AT_ORTHO_ADAMS_RATE, swept_rates

    assert "demo_2bit_ortho_adam" in AT_ORTHO_ADAMS_RATE and "demo_top16_2bit_ortho_adam" in AT_ORTHO_ADAMS_RATE
    assert swept_rates("t5", "demo_2bit_ortho_adam", [], 360) == SWEEPS["t5"]["demo_2bit_ortho_adam"]  # no winner yet
    items = [run("demo_ortho_adam", lr, 0, loss) | {"steps": 360} for lr, loss in ((4e-3, 3.9), (8e-3, 3.7))]
    items.append(run("demo_ortho_adam", 4e-3, 1, 1.0) | {"steps": 360})  # another seed does not choose
    assert swept_rates("t5", "demo_2bit_ortho_adam", items, 360) == (8e-3,)
    assert swept_rates("t5", "demo_2bit_ortho_adam", items, 100) == SWEEPS["t5"]["demo_2bit_ortho_adam"]
    assert swept_rates("t5", "demo_ortho_adam", items, 360) == SWEEPS["t5"]["demo_ortho_adam"]


def test_the_uncompressed_wire_runs_at_the_rate_its_rule_chose_on_demos_wire():
    from quality_study import swept_rates

    items = [run("demo_adam", lr, 0, loss) | {"steps": 250} for lr, loss in ((2e-3, 3.9), (4e-3, 3.7), (8e-3, 3.8))]
    assert swept_rates("t5", "full_adam", items, 250) == (4e-3,)
    assert swept_rates("t5", "full_ortho_adam", items, 250) == SWEEPS["t5"]["full_ortho_adam"]  # not chosen yet


def test_the_sign_configurations_name_their_rule_whatever_the_default():
    for name, (optim, args) in CONFIGS.items():
        if optim == "flexdemo" and "scheme=diloco" not in args and "scheme=sparseloco" not in args:
            assert "update=" in args, name


def test_retiming_takes_every_configuration_in_turns_and_reports_the_median(tmp_path, monkeypatch):
    import argparse

    import quality_study

    items = [run("adamw_hsdp", 2e-3, 0, 3.0) | {"steps": 10}, run("demo", 8e-3, 0, 3.3, sent=40) | {"steps": 10}]
    (tmp_path / "runs.json").write_text(quality_study.json.dumps(items))
    timed = iter([0.30, 0.20, 0.36, 0.22, 0.31, 0.90])
    calls = []

    def fake_run(model, name, lr, seed, steps, work, batch, base, timing=False):
        calls.append((name, lr, steps, timing))
        return {"model": model, "config": name, "lr": lr, "steps": steps, "step_s": next(timed)}

    monkeypatch.setattr(quality_study, "run", fake_run)
    configs = ["adamw_hsdp", "demo"]
    args = argparse.Namespace(model="t5", configs=configs, out=tmp_path, retime=3, retime_steps=7, batch=0)
    quality_study.retime(args, quality_study.Runs(tmp_path / "runs.json"))
    assert [c[0] for c in calls] == ["adamw_hsdp", "demo"] * 3  # in turns, not one after the other
    chosen = {"adamw_hsdp": 2e-3, "demo": 8e-3}
    assert all(lr == chosen[name] and steps == 7 and timing for name, lr, steps, timing in calls)
    quality_study.retime(args, quality_study.Runs(tmp_path / "runs.json"))
    assert len(calls) == 6  # resumed: nothing timed twice
    timings = quality_study.json.loads((tmp_path / "timings.json").read_text())
    table = summarize(items, timings)
    assert table["t5", "adamw_hsdp"]["step_s"] == pytest.approx(0.31)
    assert table["t5", "demo"]["step_s"] == pytest.approx(0.22)  # the median: one disturbed run does not count
    assert table["t5", "demo"]["timed"] == "median of 3" and summarize(items)["t5", "demo"]["timed"] == "fastest run"


def test_a_missing_matplotlib_is_said_before_the_runs_with_the_install_line(monkeypatch):
    from quality_study import check_plotting

    check_plotting()  # installed by make's venv (the bench extra)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an install without the extra looks like
    with pytest.raises(SystemExit, match=r"pip install -e '\.\[bench\]'"):
        check_plotting()


def test_the_presets_at_scale_simulate_two_replicas_in_one_process(tmp_path, monkeypatch):
    import quality_study

    launched = []
    monkeypatch.setattr(quality_study, "launch", lambda script, args, out, **kw: launched.append((args, kw)))
    for name in ("demo_ortho_adam", "adamw_hsdp"):
        with pytest.raises(FileNotFoundError):  # the launch was faked: no trainer_state.json
            quality_study.run("olmo2_10x", name, 1e-3, 0, 10, tmp_path, 0, None)
    (flexdemo, kw), (adamw, _) = launched
    assert kw == {"one_process": True}
    for args in (flexdemo, adamw):  # one micro-batch per replica: AdamW-HSDP's counterpart takes their mean
        assert args[args.index("--gradient_accumulation_steps") + 1] == "2"
        assert args[args.index("--hidden_size") + 1] == "320" and args[args.index("--num_layers") + 1] == "8"
    optim_args = flexdemo[flexdemo.index("--optim_args") + 1].split(",")
    assert "simulate_replicas=2" in optim_args
    assert "--optim_args" not in adamw


def test_a_study_cut_short_by_its_time_budget_resumes_where_it_stopped(tmp_path, monkeypatch):
    import argparse

    import quality_study

    clock, calls = [0.0], []

    def fake_run(model, name, lr, seed, steps, work, batch, base, timing=False):
        calls.append((name, lr, seed))
        clock[0] += 100  # every run takes 100 s
        return {"model": model, "config": name, "lr": lr, "seed": seed, "steps": steps, "final_eval_loss": lr}

    monkeypatch.setattr(quality_study, "run", fake_run)
    monkeypatch.setattr(quality_study.time, "time", lambda: clock[0])
    configs = ["adamw_hsdp", "demo_ortho_adam"]
    args = argparse.Namespace(
        model="olmo2_10x",
        configs=configs,
        out=tmp_path,
        steps=10,
        batch=0,
        seeds=[0, 1],
        time_budget=250,
        rates={"adamw_hsdp": (1e-3, 2e-3, 4e-3), "demo_ortho_adam": (2e-3, 4e-3)},
    )
    assert not quality_study.study(args)  # runs started at 0, 100 and 200 s; none after 250 s
    assert calls == [("adamw_hsdp", 1e-3, 0), ("adamw_hsdp", 2e-3, 0), ("adamw_hsdp", 4e-3, 0)]
    args.time_budget = 1000
    assert quality_study.study(args)  # resumed: nothing twice, every sweep before any further seed
    assert calls[3:] == [
        ("demo_ortho_adam", 2e-3, 0), ("demo_ortho_adam", 4e-3, 0),
        ("adamw_hsdp", 1e-3, 1), ("demo_ortho_adam", 2e-3, 1),
    ]  # fmt: skip


def test_real_node_runs_without_their_own_adamw_are_measured_against_the_simulated_one():
    from time_to_loss import borrow_baseline

    table = {
        ("olmo2_ft_10x", "adamw_hsdp"): {"loss_mean": 4.0, "vs_adamw": 0.0},
        ("olmo2_ft_10x_nodes", "none_ortho_adam"): {"loss_mean": 3.9},
        ("olmo2_10x_nodes", "none_ortho_adam"): {"loss_mean": 5.0},  # another model: left alone
    }
    borrow_baseline(table, {"olmo2_ft_10x", "olmo2_ft_10x_nodes"})
    assert table[("olmo2_ft_10x_nodes", "none_ortho_adam")]["vs_adamw"] == pytest.approx(-0.025)
    assert "vs_adamw" not in table[("olmo2_10x_nodes", "none_ortho_adam")]


def test_every_configuration_is_settings_the_package_takes():
    """A study configuration names only settings that exist and apply, so a rerun trains what its name says; a
    preset taken out of the package is spelled out as the knobs it had (``wire=top144_c128_2bit``'s, say)."""
    from hf_flexdemo import FlexDeMoConfig

    for name, (optim, optim_args) in CONFIGS.items():
        if optim == "flexdemo":
            FlexDeMoConfig.from_optim_args(optim_args)
    spelled = FlexDeMoConfig.from_optim_args(CONFIGS["wire_top144_c128_2bit_ortho_adam"][1])
    assert (spelled.topk, spelled.chunk, spelled.scale_topk, spelled.value_bits) == (144, 128, True, 2)


def test_the_long_studys_default_configuration_trains_the_package_default():
    from long_run import DEFAULT_CONFIG, LONG_CONFIGS, ORTHO

    from hf_flexdemo import FlexDeMoConfig
    from hf_flexdemo.config import WIRE_CHOICES

    spelled = FlexDeMoConfig.from_optim_args(LONG_CONFIGS[DEFAULT_CONFIG].optim_args)
    default = FlexDeMoConfig.from_optim_args(ORTHO)
    assert [getattr(spelled, k) for k in WIRE_CHOICES] == [getattr(default, k) for k in WIRE_CHOICES]
    assert (spelled.decay, spelled.update) == (default.decay, default.update)


# The long run (issue 64): its plan, the study directory's guard, divergence, the time budget and the report.


def long_args(tmp_path, **changes):
    import argparse

    from long_run import LONG_CONFIGS

    base = dict(out=tmp_path, configs=tuple(LONG_CONFIGS), time_budget=0, steps=None, dry_run=False, report=None)
    return argparse.Namespace(**(base | changes))


def long_row(config, lr, seed, losses, steps=100, wall_s=1000.0, train_s=900.0, step_s=9.0, diverged=False):
    """A finished long run as runs.json holds it: ``losses`` at evenly spaced evaluations."""
    from long_run import LONG_CONFIGS, LongPreset

    per_step = LongPreset().tokens_per_step
    evals = [{"step": steps * (i + 1) // len(losses), "eval_loss": loss} for i, loss in enumerate(losses)]
    for e in evals:
        e["tokens"] = e["step"] * per_step
    return {
        "config": config, "lr": lr, "seed": seed, "steps": steps, "evals": evals, "diverged": diverged,
        "final_eval_loss": None if diverged else losses[-1], "wall_s": wall_s, "train_s": train_s, "step_s": step_s,
        "optim": LONG_CONFIGS[config].optim, "epochs": 1.5, "parameters": 1_574_016, "device": "CPU (2 cores)",
        "bytes_per_step": 100.0, "dense_bytes_per_step": 10_000.0,
    }  # fmt: skip


def test_the_long_plan_trains_ten_tokens_per_parameter_and_lists_every_run(tmp_path, capsys):
    from long_run import DEFAULT_PRESET, LONG_CONFIGS, LONG_PRESETS, LongPreset, dry_run, olmo2_parameters, run_args

    preset = LongPreset()
    assert preset.steps * preset.tokens_per_step / preset.parameters >= 10
    small = LONG_PRESETS[DEFAULT_PRESET]
    assert small.steps * small.tokens_per_step / small.parameters >= 20 and small.parameters == 262_720
    lines = dry_run(long_args(tmp_path), preset)
    runs = [line for line in lines if line.startswith("| ") and line[2].isdigit()]
    from long_run import SEEDS

    assert len(runs) == sum(3 + len(SEEDS[name]) - 1 for name in LONG_CONFIGS)  # a bracket of 3, then the other seeds
    brackets = [r.split(" | ") for r in runs if "| bracket |" in r]
    for name, spec in LONG_CONFIGS.items():
        rates = sorted(float(r[4]) for r in brackets if r[2] == name)
        assert rates == pytest.approx([spec.short_best / 2, spec.short_best, spec.short_best * 2]), name
    assert all(float(r.split(" | ")[8]) >= 10 for r in runs)  # tokens per parameter, every run
    assert f"{len(runs)} runs" in lines[-1] and "h in all" in lines[-1] and not (tmp_path / "study.json").exists()
    # the parameters the plan counts are the stock script's model's
    sys.path.insert(0, str(REPO_ROOT / "training_scripts"))
    from train_olmo2 import Olmo2Arguments, offline_model

    class Tokenizer:
        pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

        def __len__(self):
            return 300

    model = offline_model(Olmo2Arguments(hidden_size=32, num_layers=3, block_size=16), Tokenizer())
    assert olmo2_parameters(300, 32, 3) == sum(p.numel() for p in model.parameters())
    # every layout trains the same blocks a step: 2 simulated replicas x 16, or 2 nodes x 2 processes x 8
    simulated, one_process = run_args(preset, "wire_demo", 4e-3, 0)
    nodes, apart = run_args(preset, "sparseloco_h4_2bit", 3.2e-2, 0)
    assert one_process and not apart
    assert simulated[simulated.index("--per_device_train_batch_size") + 1] == "16"
    assert simulated[simulated.index("--gradient_accumulation_steps") + 1] == "2"
    assert "simulate_replicas=2" in simulated[simulated.index("--optim_args") + 1]
    assert (
        nodes[nodes.index("--per_device_train_batch_size") + 1] == "8" and "--gradient_accumulation_steps" not in nodes
    )
    for args in (simulated, nodes):
        assert (
            args[args.index("--lr_scheduler_type") + 1] == "cosine" and args[args.index("--warmup_steps") + 1] == "0.05"
        )
        assert args[args.index("--offline_text") + 1] == "python_source"


def test_a_long_study_resumed_with_another_step_count_or_corpus_is_refused_naming_it(tmp_path):
    from long_run import LongPreset, dry_run, study

    def never(*args):
        raise AssertionError("a refused study ran")

    corpus = {"offline_text": "python_source", "documents": 3, "chars": 10, "sha1": "aa"}
    assert study(long_args(tmp_path, configs=()), LongPreset(), run=never, fingerprint=lambda text: corpus)
    with pytest.raises(SystemExit, match=r"steps: the directory holds 4000, this command 40\b"):
        study(long_args(tmp_path), LongPreset(steps=40), run=never, fingerprint=lambda text: corpus)
    with pytest.raises(SystemExit, match=r"steps: the directory holds 4000, this command 40\b"):
        dry_run(long_args(tmp_path), LongPreset(steps=40))
    other = corpus | {"sha1": "bb"}  # another machine's packages: another text
    with pytest.raises(SystemExit, match=r"corpus: the directory holds .*'aa'.*this command .*'bb'"):
        study(long_args(tmp_path), LongPreset(), run=never, fingerprint=lambda text: other)
    with pytest.raises(SystemExit, match=r"settings: .*'hidden_size': 128.*'hidden_size': 64"):
        study(long_args(tmp_path), LongPreset(hidden_size=64), run=never, fingerprint=lambda text: corpus)


def test_a_long_run_that_diverges_is_recorded_at_its_rate_and_the_sweep_goes_on(tmp_path, monkeypatch):
    import json

    import long_run

    def fake_launch(script, args, out, one_process=False):
        lr = float(args[args.index("--learning_rate") + 1])
        broken = float("nan") if lr > 1e-2 else 4.0 + abs(lr - 8e-3) * 100  # the largest rate diverges, 8e-3 wins
        history = [{"step": 50, "loss": 5.0, "epoch": 0.5}, {"step": 100, "loss": broken, "epoch": 1.0}]
        history += [{"step": s, "eval_loss": loss, "eval_runtime": 1.0} for s, loss in ((50, 5.0), (100, broken))]
        history += [{"step": 100, "train_runtime": 52.0}, {"step": 100, "eval_loss": broken, "eval_runtime": 1.0}]
        out.mkdir(parents=True)
        (out / "trainer_state.json").write_text(json.dumps({"log_history": history}))

    monkeypatch.setattr(long_run, "launch", fake_launch)
    monkeypatch.setattr(long_run, "parameter_count", lambda out: 1000)
    corpus = {"offline_text": "python_source", "sha1": "aa"}
    preset = long_run.LongPreset(steps=100)
    assert long_run.study(long_args(tmp_path, configs=("wire_2bit",)), preset, fingerprint=lambda text: corpus)
    text = (tmp_path / "runs.json").read_text()
    rows = json.loads(text, parse_constant=lambda name: pytest.fail(f"runs.json holds {name}"))
    assert [(r["lr"], r["seed"], r["diverged"]) for r in rows] == [
        (4e-3, 0, False), (8e-3, 0, False), (1.6e-2, 0, True), (8e-3, 1, False)
    ]  # fmt: skip
    broken = rows[2]
    assert (
        broken["final_eval_loss"] is None and broken["evals"][-1]["eval_loss"] is None and broken["phase"] == "bracket"
    )
    good = rows[1]
    assert [(e["step"], e["tokens"]) for e in good["evals"]] == [(50, 50 * 4096), (100, 100 * 4096)]
    assert good["final_eval_loss"] == pytest.approx(4.0) and good["step_s"] == pytest.approx(0.5)  # evals left out
    assert good["tokens"] == 100 * 4096 and good["parameters"] == 1000 and good["epochs"] == 1.0
    assert good["device"].startswith("CPU")


def test_the_long_studys_time_budget_starts_no_run_that_would_not_finish(tmp_path, monkeypatch):
    import long_run

    clock, calls = [0.0], []

    def fake_run(preset, config, lr, seed, work):
        calls.append((config, lr, seed))
        clock[0] += 1000
        return long_row(config, lr, seed, [5.0, 4.0 + abs(lr - 1.6e-2)], steps=preset.steps, wall_s=1000.0, step_s=9.0)

    monkeypatch.setattr(long_run.time, "time", lambda: clock[0])
    preset, corpus = long_run.LongPreset(steps=100), (lambda text: {"sha1": "aa"})
    args = long_args(tmp_path, configs=("wire_demo",), time_budget=2500)
    # the first run's estimate is the pilot's; the second's its own 1,000 s, which end by 2,000 s; the third's would not
    assert not long_run.study(args, preset, run=fake_run, fingerprint=corpus)
    rows = long_run.StudyDir(tmp_path).rows
    longer = long_run.LongPreset(steps=200)
    assert len(calls) == 2 and long_run.estimate_s(rows, "wire_demo", longer) == 900 + 100 * 9 + 100
    assert long_run.estimate_s(rows, "wire_demo", longer, seed=1) == 1900 + long_run.PREPARE_S  # tokenized first
    assert long_run.estimate_s(rows, "adamw_hsdp", longer) == pytest.approx(1800 / long_run.RULE_COST["flexdemo"] + 100)
    args.time_budget = 1e9
    assert long_run.study(args, preset, run=fake_run, fingerprint=corpus)  # resumed: nothing twice
    # its bracket (best at its top, 8e-3), 1.6e-2 beyond it (best again), 3.2e-2 (worse: the edges stop), seeds 1, 2
    assert len(calls) == len(set(calls)) == 3 + 2 + 2
    assert calls[3:5] == [("wire_demo", 1.6e-2, 0), ("wire_demo", 3.2e-2, 0)]
    assert calls[5:] == [("wire_demo", 1.6e-2, 1), ("wire_demo", 1.6e-2, 2)]


def test_the_long_reports_gaps_grow_or_shrink_along_the_run_and_the_time_to_adamws_loss(tmp_path):
    import json

    from long_report import gaps, loss_at, report, summary, time_to_adamw
    from long_run import StudyDir, manifest
    from olmo2_1b_step import RATES, step_seconds

    baseline = [(100, 6.0), (200, 5.0), (400, 4.0)]
    curve = [(100, 6.6), (200, 5.25), (400, 4.0)]  # 10% behind early, level at the end
    assert loss_at(curve, 300) == pytest.approx(4.625)
    assert gaps(curve, baseline, 400, (0.5, 1.0)) == pytest.approx({0.5: 0.05, 1.0: 0.0})
    assert gaps(curve, baseline, 400, (0.1, 0.25)) == {0.1: None, 0.25: pytest.approx(0.1)}  # none before the first
    with pytest.raises(ValueError, match="outside"):
        loss_at(curve, 500)

    from long_run import LongPreset

    preset = LongPreset(steps=100)
    rows = [
        long_row("adamw_hsdp", 4e-3, 0, [6.0, 5.0, 4.5, 4.0]),
        long_row("adamw_hsdp", 4e-3, 1, [6.2, 5.2, 4.7, 4.2]),
        long_row("adamw_hsdp", 8e-3, 0, [6.0, 5.0, 4.5, 4.3]),
        long_row("full", 4e-3, 0, [5.0, 4.2, 3.9, 3.6]),
        long_row("wire_demo", 4e-3, 0, [5.5, 4.5, 4.3, 3.8]),
        long_row("wire_demo", 4e-3, 1, [5.7, 4.7, 4.5, 3.9]),
        long_row("wire_demo", 8e-3, 0, [9.0, 9.0, 9.0, 9.0], diverged=True),
    ]
    StudyDir(tmp_path).start(manifest(preset, {"offline_text": "python_source", "documents": 3, "chars": 1e6}))
    first, second = StudyDir(tmp_path), StudyDir(tmp_path)  # two study processes, each with its own configs
    for i, row in enumerate(rows):
        (second if i % 2 else first).append(row)
    assert StudyDir(tmp_path).rows == json.loads(json.dumps(rows))  # neither wrote over the other's rows
    table = summary(rows)
    demo = table["wire_demo"]
    assert demo["lr"] == 4e-3 and len(demo["runs"]) == 2 and demo["loss_mean"] == pytest.approx(3.85)
    assert demo["spread"] == pytest.approx(0.05) and demo["at_edge"]  # 8e-3 diverged: the best is the lowest rate
    per_step = preset.tokens_per_step
    assert demo["curve"][0] == (25 * per_step, pytest.approx(5.6))
    adamw_mean = table["adamw_hsdp"]["curve"]
    assert gaps(demo["curve"], adamw_mean, 100 * per_step, (0.25, 1.0)) == pytest.approx(
        {0.25: 5.6 / 6.1 - 1, 1.0: 3.85 / 4.1 - 1}
    )
    wire = {"dense_bytes": 1e9, "demo": 2e7}
    reach = time_to_adamw(table, wire)
    # demo's mean (4.4 at 75%, 3.85 at 100%) is first at or below AdamW-HSDP's final mean (4.1) at the last evaluation
    for rate, bits in RATES.items():
        expected = step_seconds("flexdemo", 2e7, bits) / step_seconds("adamw", 1e9, bits)
        assert reach["wire_demo"][rate] == pytest.approx(expected)
        assert reach["adamw_hsdp"][rate] == pytest.approx(1.0)
    wire_path = tmp_path / "wire_presets.json"
    wire_path.write_text(json.dumps({"dense_bytes": 1e9, "presets": [{"wire": "demo", "bytes_per_step": 2e7}]}))
    text = report(tmp_path, wire_path)
    row = "| wire_demo | 0.004 (3.8000), 0.008 (diverged) | 0.004, at the edge | 0.004 | 2 | 3.8500 +- 0.0500 |"
    assert row in text
    assert (
        f"| wire_demo | - | {5.6 / 6.1 - 1:+.2%} |" in text
        and "--report benchmarks/results/quality/olmo2_long\n" in text
    )
    assert (tmp_path / "README.md").read_text() == text
    assert sorted(p.name for p in tmp_path.glob("*.png")) == [
        "adamw_hsdp_loss_vs_tokens.png", "full_loss_vs_tokens.png", "wire_demo_loss_vs_tokens.png"
    ]  # fmt: skip
