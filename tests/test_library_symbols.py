"""The other libraries' symbols hf_flexdemo relies on, checked by name.

No public registry exists for a Trainer optimizer name, for Accelerate's FSDP2 preparation or
for the model card's optimizer line, so the integrations patch the symbols listed in
``hf_flexdemo.integrations.patches.PATCHES``; the rest they read. A release that moves one fails
here, by name, before any training test does.
"""

from __future__ import annotations

import importlib
import inspect

import accelerate
import pytest
import transformers

from hf_flexdemo.integrations.patches import PATCHES, Patch, _owner_of, applied, wrap

pytestmark = [pytest.mark.unit, pytest.mark.lowest]

MAJOR = int(transformers.__version__.split(".")[0])


def _applies_here(patch) -> bool:
    return patch.applies(
        {"transformers": transformers.__version__, "accelerate": accelerate.__version__}[patch.library]
    )


@pytest.mark.parametrize("patch", PATCHES, ids=[patch.target for patch in PATCHES])
def test_every_listed_patch_finds_its_target_on_the_installed_versions(patch):
    if not _applies_here(patch):
        pytest.skip(f"{patch.target} applies to other versions of {patch.library}")
    owner, name = _owner_of(patch.target)
    assert hasattr(owner, name), f"{patch.target} moved ({patch.library} {getattr(owner, '__version__', '')})"


def test_importing_hf_flexdemo_applies_exactly_the_listed_patches_for_these_versions():
    import hf_flexdemo.integrations

    hf_flexdemo.integrations.install()
    assert applied() == {patch.target for patch in PATCHES if _applies_here(patch)}
    for patch in PATCHES:  # the wrapped ones still call what they wrap
        if patch.change == "wrapped" and _applies_here(patch):
            owner, name = _owner_of(patch.target)
            assert hasattr(inspect.getattr_static(owner, name), "__wrapped__") or hasattr(
                getattr(owner, name), "__wrapped__"
            ), patch.target


def test_an_unlisted_patch_is_refused_by_name():
    with pytest.raises(RuntimeError, match=r"transformers.Trainer.evaluate is patched but not listed .*PATCHES"):
        wrap("transformers.Trainer.evaluate", lambda original, self, *a, **k: original(self, *a, **k))


def test_a_moved_target_stops_the_install_with_the_patch_named(monkeypatch):
    from hf_flexdemo.integrations import patches

    gone = Patch("transformers.Trainer.no_such_method", "wrapped", "a test", ("4.57.1", "5.24.0"))
    monkeypatch.setitem(patches._BY_TARGET, gone.target, gone)
    with pytest.raises(
        RuntimeError, match=r"has no transformers.Trainer.no_such_method.*checked on transformers 4\.57"
    ):
        patches.located(gone.target)
    assert gone.target not in applied()


@pytest.mark.parametrize(
    "module,name",
    [
        ("transformers.trainer", "DEFAULT_CALLBACKS"),  # read: FlexDeMo's callbacks go right after these
        ("transformers.trainer_utils", "PREFIX_CHECKPOINT_DIR"),
        ("accelerate.parallelism_config", "ParallelismConfig"),
        ("accelerate.utils.fsdp_utils", "fsdp2_prepare_auto_wrap_policy"),
        ("accelerate.utils.constants", "FSDP_SHARDING_STRATEGY"),  # the names FSDP1's number 1..5 stands for
    ],
)
def test_the_symbols_we_read_exist(module, name):
    assert hasattr(importlib.import_module(module), name), f"{module}.{name} moved ({transformers.__version__})"


def test_the_interpreter_exit_steps_a_distributed_worker_runs_itself_exist():
    """training_scripts/script_utils.py's exit_worker(): what Python's exit does before its teardown."""
    import atexit
    import threading

    assert callable(getattr(threading, "_shutdown", None)) and callable(getattr(atexit, "_run_exitfuncs", None))


def test_the_cpu_bf16_probes_behind_ns_dtype_auto_exist():
    """ns_dtype='auto' asks torch whether the CPU has AVX-512 BF16 or AMX (private functions). Without them the
    rule takes float32 on every CPU: correct, but slower where bf16 is fast, so a release that moves them fails
    here."""
    import torch

    assert isinstance(torch.cpu._is_avx512_bf16_supported(), bool)
    assert isinstance(torch.cpu._is_amx_tile_supported(), bool)


def test_the_optimizer_table_is_where_this_major_version_keeps_it():
    if MAJOR >= 5:
        from transformers import trainer_optimizer

        assert isinstance(trainer_optimizer._OPTIMIZER_HANDLERS, dict)
    else:
        assert isinstance(inspect.getattr_static(transformers.Trainer, "get_optimizer_cls_and_kwargs"), staticmethod)


def test_the_checkpoint_folder_name_is_the_one_the_marker_logic_parses():
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    from hf_flexdemo.integrations.checkpoints import CHECKPOINT_NAME

    assert CHECKPOINT_NAME.match(f"{PREFIX_CHECKPOINT_DIR}-12")


def test_the_layout_properties_we_read_exist():
    from accelerate.parallelism_config import ParallelismConfig

    for name in ("fsdp_dim_names", "dp_replicate_enabled", "dp_shard_enabled", "tp_enabled", "cp_enabled"):
        assert hasattr(ParallelismConfig, name), f"ParallelismConfig.{name} moved (accelerate {accelerate.__version__})"
    assert "best_global_step" in inspect.signature(transformers.TrainerState).parameters


def test_the_logging_step_a_healing_node_moves_is_kept_by_the_trainer():
    from hf_flexdemo.integrations.fault_tolerant_trainer import LAST_LOGGED

    source = inspect.getsource(transformers.Trainer)
    assert f"self.{LAST_LOGGED}" in source, f"Trainer.{LAST_LOGGED} moved ({transformers.__version__})"


def test_accelerate_takes_fsdp2s_mesh_from_fsdp_dim_names():
    """The plugin narrows ``fsdp_dim_names`` so that FSDP2 shards inside a node: Accelerate must read it there."""
    from accelerate.utils import fsdp_utils

    source = inspect.getsource(fsdp_utils.fsdp2_prepare_model)
    assert "fsdp_dim_names" in source, f"fsdp2_prepare_model no longer reads fsdp_dim_names ({accelerate.__version__})"


def test_training_arguments_check_bf16_in_post_init():
    """The bf16-on-CPU wrapper runs before ``TrainingArguments.__post_init__``, where transformers refuses it."""
    source = inspect.getsource(transformers.TrainingArguments.__post_init__)
    assert "bf16" in source and "use_cpu" in source, f"the bf16 check moved ({transformers.__version__})"


@pytest.mark.parametrize(
    "version,table", [("4.57.1", False), ("5.0.0.dev0", True), ("5.0.0rc1", True), ("5.24.0", True)]
)
def test_one_way_to_build_the_optimizer_applies_to_each_transformers_version_pre_releases_included(version, table):
    by_target = {patch.target: patch for patch in PATCHES}
    assert by_target["transformers.trainer_optimizer._OPTIMIZER_HANDLERS"].applies(version) is table
    assert by_target["transformers.Trainer.get_optimizer_cls_and_kwargs"].applies(version) is not table
