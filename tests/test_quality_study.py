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
    assert args[args.index("--optim_args") + 1] == "update=adam"


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
        ("demo_ortho_adam", 2e-3, 0), ("demo_ortho_adam", 4e-3, 0), ("adamw_hsdp", 1e-3, 1), ("demo_ortho_adam", 2e-3, 1)
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
