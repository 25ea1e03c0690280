"""The Accelerate plugin: FSDP2 inside a node, FlexDeMo between nodes.

Accelerate has no extension point for the jobs below, so :func:`install` wraps four of
its methods (idempotently, once per process; ``import hf_flexdemo`` calls it; every patch is
listed in :mod:`.patches`):

- ``FullyShardedDataParallelPlugin.__post_init__``: FSDP1 in a distributed job without an
  accelerator is refused before Accelerate's own set-up (which speaks of missing devices,
  or trains unsynchronized copies with HYBRID_SHARD); so is an FSDP1 strategy name in
  ``fsdp_reshard_after_forward`` under FSDP2 (Accelerate says only "invalid truth value").
- ``PartialState.__init__``: ``accelerate launch`` does not pass a config's ``use_cpu`` to
  multi-process jobs, so on a machine without a GPU each process of a distributed launch
  would believe it trains alone (N silent unsynchronized copies). A distributed launch
  with no accelerator device runs on CPU with gloo instead. ``distributed_type: MULTI_CPU``
  with ``num_processes`` above 1 and no mpirun, which Accelerate starts as one process, is
  refused (:func:`refuse_multi_cpu_started_alone`).
- ``AcceleratorState.__init__``: on a machine without a GPU, Accelerate turns
  ``distributed_type: FSDP`` into plain multi-CPU DDP without a word. The plugin keeps
  FSDP2 on (gloo), and refuses FSDP1 there, whose ``HYBRID_SHARD`` would silently train
  unsynchronized copies on CPU. Before Accelerate builds the device mesh, it refuses a
  ``parallelism_config`` whose sizes do not multiply to the processes launched (torch's
  own error there names no setting).
- ``Accelerator.prepare``: when the optimizer being prepared is FlexDeMo, FSDP2 shards
  on the intra-node mesh dimension only (so FSDP never all-reduces gradients across
  nodes) and FlexDeMo gets the replicate dimension. Any other optimizer gets Accelerate's
  ordinary layout (HSDP when ``dp_replicate_size > 1``). FlexDeMo without FSDP2 in a
  multi-process job is refused. Under FSDP2 it also makes T5-style tied embedding
  modules one module, which FSDP2 requires; keeps Accelerate from sharding an input
  embedding twice when its block is auto-wrapped already (ViT); flags the model as
  FSDP-managed so that ``generate`` keeps all ranks stepping together; makes FSDP2
  blocks return copies of view tensors (T5's position bias), which an in-place op would
  cut off from the block's backward all-gather; and silences
  torch's deprecation warning about Accelerate's own lookup of a flattened mesh dimension
  for other optimizers' HSDP (harmless on torch 2.13, see :func:`_quiet_flattened_mesh_slicing`).

:func:`check_flexdemo_layout` refuses every multi-process layout FlexDeMo cannot train
(DDP, FSDP1, FSDP2 with an FSDP1 sharding strategy, fp16, a parallelism config that does not
match the launch); the Trainer runs it at construction, before any data is loaded.

Layout: ``parallelism_config`` in the Accelerate YAML sets it; without one, FlexDeMo uses
nodes x processes-per-node (``WORLD_SIZE / LOCAL_WORLD_SIZE`` x ``LOCAL_WORLD_SIZE``).

Unlike the Trainer's patches (:mod:`.trainer`, FlexDeMo runs only), these act for every optimizer: a launch
with this package's Accelerate configs keeps the layout they set (FSDP2 kept on CPU, gloo on a CPU launch,
the refusals of a config that cannot run), because AdamW-HSDP on ``accelerate_configs/cpu_2x2.yaml`` is the
baseline the benchmarks compare FlexDeMo against. Only ``prepare``'s FlexDeMo layout waits for FlexDeMo.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings

import torch
from accelerate import Accelerator
from accelerate.parallelism_config import ParallelismConfig
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from accelerate.utils.constants import FSDP_SHARDING_STRATEGY
from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
from torch.distributed.device_mesh import init_device_mesh

from .. import elastic
from ..fsdp import clone_view_outputs
from ..optim import FlexDeMo, unwrap_flexdemo
from .patches import wrap

logger = logging.getLogger(__name__)

REPLICATE_DIM = "dp_replicate"


def fp16_refusal(setting: str, instead: str) -> str:
    """The one message for FlexDeMo with fp16 (Accelerate's mixed_precision or the Trainer's flag)."""
    return (
        f"FlexDeMo with {setting} is refused: the loss scaler skips steps per process, and replicas that "
        f"skip differently fall out of step. Use {instead}."
    )


class _ShardOnlyLayout(ParallelismConfig):
    """Accelerate's layout with FSDP restricted to the intra-node dimensions."""

    @property
    def fsdp_dim_names(self):
        if self.dp_shard_enabled and not self.cp_enabled:
            # "dp_shard_cp" is then "dp_shard" flattened alone: the same processes. Naming the mesh's own
            # dimension keeps torch (2.13) from warning, on every rank, that slicing a flattened dimension
            # from the root mesh will go, here and where FlexDeMo lays its state over (replicate, shard).
            return ["dp_shard"]
        return [name for name in super().fsdp_dim_names if name != REPLICATE_DIM]


def find_flexdemo(objects) -> FlexDeMo | None:
    """The FlexDeMo optimizer among ``objects`` (unwrapping Accelerate's optimizer wrapper)."""
    return next((found for found in map(unwrap_flexdemo, objects) if found is not None), None)


@contextlib.contextmanager
def _shard_only(config: ParallelismConfig):
    original = config.__class__
    config.__class__ = _ShardOnlyLayout
    try:
        yield
    finally:
        config.__class__ = original


def default_layout() -> tuple[int, int]:
    """(nodes, processes per node) of this launch."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    same = "FlexDeMo needs the same number of processes on every node. Launch each node with the same "
    same += "--num_processes / --nproc-per-node."
    if world % local:
        raise ValueError(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}: {same}")
    # torchelastic's node count: a node with fewer processes than the others may divide the world evenly.
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "0")) or world // local
    if nodes * local != world:
        raise ValueError(
            f"WORLD_SIZE={world} processes on GROUP_WORLD_SIZE={nodes} nodes, but LOCAL_WORLD_SIZE={local} on this "
            f"one: {same}"
        )
    return nodes, local


def _ensure_layout(accelerator: Accelerator) -> ParallelismConfig:
    """The accelerator's parallelism config; FlexDeMo's default hybrid one when there is none."""
    config = accelerator.parallelism_config
    if config is not None and config.total_size > 1 and (config.dp_replicate_enabled or config.dp_shard_enabled):
        # sp_enabled exists from accelerate 1.11 on (sequence parallelism); absent means off.
        if config.tp_enabled or config.cp_enabled or getattr(config, "sp_enabled", False):
            raise ValueError(
                "FlexDeMo supports data parallelism only (dp_replicate x dp_shard); the parallelism_config "
                f"also sets tp/cp/sp: {config}. Set the tp, cp and sp sizes to 1 (or leave them out)."
            )
        return config
    nodes, per_node = default_layout()
    config = ParallelismConfig(dp_replicate_size=nodes, dp_shard_size=per_node)
    if per_node == 1:
        # One process per node (DeMo's one-GPU-per-node setting): Accelerate leaves a size-1 shard
        # dimension out of its mesh, but FSDP2 needs one to wrap the model. FSDP2 over a single
        # process shards nothing; FlexDeMo replicates over the nodes as in any other layout.
        config.device_mesh = init_device_mesh(
            accelerator.device.type, (nodes, 1), mesh_dim_names=(REPLICATE_DIM, "dp_shard_cp")
        )
    accelerator.state.parallelism_config = config
    accelerator.state.device_mesh = config.get_device_mesh(accelerator.device.type)
    logger.info("FlexDeMo: no parallelism_config given; using %d nodes x %d processes per node.", nodes, per_node)
    return config


def share_tied_embedding_modules(model: torch.nn.Module) -> int:
    """Make embedding modules that share the input embedding's weight the same module object.

    FSDP2 refuses a weight reachable from two FSDP groups (T5's ``encoder.embed_tokens``
    and ``decoder.embed_tokens`` both hold ``shared.weight``). Returns how many were replaced.
    """
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if get else None
    if embedding is None:
        return 0
    replaced = 0
    for name, module in list(model.named_modules()):
        if module is not embedding and isinstance(module, torch.nn.Embedding) and module.weight is embedding.weight:
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, attr, embedding)
            replaced += 1
    return replaced


@contextlib.contextmanager
def _no_double_sharded_input_embedding(accelerator: Accelerator, model: torch.nn.Module):
    """Accelerate shards ``get_input_embeddings()`` by itself after auto-wrapping; when a wrapped
    block already holds it (ViT's patch embedding inside ``ViTEmbeddings``), ``fully_shard``
    meets its DTensors a second time and fails. Hide the embedding from that step."""
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if get else None
    plugin = accelerator.state.fsdp_plugin
    if embedding is None or plugin.auto_wrap_policy is None:
        yield
        return
    plugin.set_auto_wrap_policy(model)
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    holders = [m for m in model.modules() if m is not model and m is not embedding and _contains(m, embedding)]
    if policy is None or not any(policy(m) for m in holders):
        yield
        return
    model.get_input_embeddings = lambda: None
    try:
        yield
    finally:
        del model.get_input_embeddings


def _contains(module: torch.nn.Module, target: torch.nn.Module) -> bool:
    return any(child is target for child in module.modules())


def _after_fully_shard(result) -> None:
    """The prepared models: flagged as FSDP-managed, and with no view tensor among their blocks' outputs.

    transformers turns on ``synced_gpus`` in ``generate`` only for modules with the flag,
    which its own FSDP2 path sets and Accelerate's does not; without it, ranks that stop
    decoding at different steps leave FSDP's all-gathers waiting forever. A view returned by
    an FSDP2 block (T5's position bias) would lose the block's backward all-gather to an
    in-place op after it (:func:`~hf_flexdemo.fsdp.clone_view_outputs`)."""
    for obj in result if isinstance(result, (tuple, list)) else (result,):
        if isinstance(obj, torch.nn.Module):
            obj._is_fsdp_managed_module = True
            clone_view_outputs(obj)


FLATTENED_SLICE_WARNING = "Slicing a flattened dim from root mesh"


@contextlib.contextmanager
def _quiet_flattened_mesh_slicing():
    """For other optimizers (HSDP), Accelerate (1.15, ``fsdp2_prepare_model``) takes FSDP's mesh as
    ``mesh["dp_replicate", "dp_shard_cp"]``, a flattened dimension sliced from the root mesh, and
    torch (2.13) warns on every rank that this lookup will go. It still returns the right mesh,
    and once torch drops it the lookup fails loudly; so this one warning is silenced inside
    ``prepare`` only (docs/trainer.md)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=FLATTENED_SLICE_WARNING, category=UserWarning)
        yield


def _prepare(original, self: Accelerator, *args, **kwargs):
    if self.is_fsdp2:
        with contextlib.ExitStack() as stack:
            for obj in args:
                if isinstance(obj, torch.nn.Module):
                    share_tied_embedding_modules(obj)
                    stack.enter_context(_no_double_sharded_input_embedding(self, obj))
            stack.enter_context(_quiet_flattened_mesh_slicing())
            result = _prepare_flexdemo_aware(original, self, *args, **kwargs)
        _after_fully_shard(result)
        return result
    return _prepare_flexdemo_aware(original, self, *args, **kwargs)


def _prepare_flexdemo_aware(original, self: Accelerator, *args, **kwargs):
    flexdemo = find_flexdemo(args)
    if flexdemo is None:
        return original(self, *args, **kwargs)
    if self.num_processes == 1:
        flexdemo.attach(None)
        result = original(self, *args, **kwargs)
        _join_quorum(self, flexdemo)
        return result
    check_flexdemo_layout(self.state)
    config = _ensure_layout(self)
    with _shard_only(config):
        result = original(self, *args, **kwargs)
    if config.dp_replicate_enabled:
        flexdemo.attach(self.torch_device_mesh, replicate_dim=REPLICATE_DIM)
    else:
        flexdemo.attach(None)  # one node: FlexDeMo runs with a single replica
        _join_quorum(self, flexdemo)
    logger.info(
        "FlexDeMo: FSDP2 shards over %d processes per node; %d replicas exchange %r across nodes.",
        config.dp_shard_size,
        config.dp_replicate_size,
        flexdemo.config.scheme,
    )
    return result


def _join_quorum(accelerator: Accelerator, flexdemo: FlexDeMo) -> None:
    """fault_tolerance='torchft': this node's replicas are the live nodes of a torchft quorum."""
    if not flexdemo.config.fault_tolerant:
        return
    from ..fault_tolerance import node_replicas, wrap_optimizer

    device = accelerator.device
    wrap_optimizer(flexdemo, node_replicas(flexdemo.config, device=device if device.type == "cuda" else None))


def check_flexdemo_layout(state: AcceleratorState) -> None:
    """Refuse, with the setting to write, every multi-process layout FlexDeMo cannot train correctly.

    Run at ``Trainer(...)`` (before any data is loaded) and again at ``accelerator.prepare``.
    """
    if state.num_processes == 1:
        return
    plugin = getattr(state, "fsdp_plugin", None)
    if state.distributed_type != DistributedType.FSDP or plugin is None or plugin.fsdp_version != 2:
        hint = (
            " FSDP version 1 is not supported: set `fsdp_config: {fsdp_version: 2}` and give the hybrid layout as "
            "`parallelism_config: {parallelism_config_dp_replicate_size: <nodes>, "
            "parallelism_config_dp_shard_size: <processes per node>}` instead of fsdp_sharding_strategy."
            if plugin is not None
            else " Use an Accelerate config with `distributed_type: FSDP` and `fsdp_config: {fsdp_version: 2}` "
            "(with one process per node, leave `parallelism_config` out)."
        )
        raise ValueError(
            f"FlexDeMo needs FSDP2 inside each node, but Accelerate runs {state.distributed_type} "
            f"with {state.num_processes} processes, which would all-reduce every gradient densely.{hint}"
        )
    strategy = fsdp1_sharding_strategy(plugin)
    if strategy not in (None, "FULL_SHARD"):
        raise ValueError(
            f"fsdp_sharding_strategy={strategy} is an FSDP1 setting that FSDP2 ignores: FlexDeMo would train the "
            "usual sharded layout instead. With fsdp_version 2 only FULL_SHARD (the default) is allowed: remove "
            "`fsdp_sharding_strategy` from `fsdp_config` (or `--fsdp_sharding_strategy` from the command line). "
            "FSDP2 shards over the processes of a node (`parallelism_config_dp_shard_size`), and "
            "`fsdp_reshard_after_forward: false` keeps the gathered parameters between forward and backward."
        )
    if state.mixed_precision == "fp16":
        raise ValueError(fp16_refusal("mixed_precision='fp16'", "mixed_precision='bf16'"))
    refuse_parallelism_not_matching_launch(getattr(state, "parallelism_config", None), state.num_processes)


def refuse_parallelism_not_matching_launch(config, processes: int) -> None:
    """Before Accelerate builds the mesh: torch's own error names no setting and no fix."""
    if config is None or config.total_size in (1, processes):
        return
    if getattr(config, "sp_backend", None) == "deepspeed" and config.sp_size > 1:
        return  # DeepSpeed's sequence parallelism keeps its own groups; Accelerate skips this check too
    raise ValueError(
        f"parallelism_config asks for dp_replicate {config.dp_replicate_size} x dp_shard {config.dp_shard_size}"
        f" = {config.total_size} processes, but this launch started {processes} "
        f"({os.environ.get('LOCAL_WORLD_SIZE', processes)} per machine); the sizes must multiply to the processes "
        f"of all machines. Write `num_processes: {config.total_size}` in the Accelerate config or --num_processes "
        f"{config.total_size} on the command line (it counts all machines' processes: on {config.dp_replicate_size} "
        f"machines, --num_machines {config.dp_replicate_size} --num_processes {config.total_size}), or change "
        f"parallelism_config_dp_replicate_size and parallelism_config_dp_shard_size so that they multiply to "
        f"{processes}."
    )


def fsdp1_sharding_strategy(plugin) -> str | None:
    """The FSDP1 sharding strategy asked for, by name (``"NO_SHARD"``), or None.

    For FSDP2, Accelerate (1.15) leaves ``plugin.sharding_strategy`` empty: the YAML's
    ``fsdp_sharding_strategy`` and ``--fsdp_sharding_strategy`` reach the process only as
    ``FSDP_SHARDING_STRATEGY`` (a name or FSDP1's number, 1 to 5).
    """
    value = plugin.sharding_strategy
    if value is None and plugin.fsdp_version == 2:
        value = os.environ.get("FSDP_SHARDING_STRATEGY")
    value = getattr(value, "name", value)
    if value is None:
        return None
    text = str(value).strip().upper()
    if text.isdigit() and 1 <= int(text) <= len(FSDP_SHARDING_STRATEGY):
        return FSDP_SHARDING_STRATEGY[int(text) - 1]
    return text


def launched_distributed() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 or int(os.environ.get("LOCAL_RANK", "-1")) != -1


MPI_WORLD_SIZES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "WORLD_SIZE")
"""Where a process started by mpirun (or torchelastic) finds how many processes the job has."""


def refuse_multi_cpu_started_alone() -> None:
    """``distributed_type: MULTI_CPU`` with ``num_processes`` above 1 and no ``--mpirun_hostfile``.

    Accelerate (1.15) then starts one plain process: its MULTI_CPU launches several only through
    mpirun. The process gets ``MASTER_ADDR``/``MASTER_PORT`` (set for ``num_processes`` > 1) but no
    world size, and would train alone, silently.
    """
    launched_by_accelerate = "ACCELERATE_USE_CPU" in os.environ  # its plain launcher sets it, true or false
    if not launched_by_accelerate or "MASTER_PORT" not in os.environ:
        return
    if any(name in os.environ for name in MPI_WORLD_SIZES):
        return
    raise ValueError(
        "distributed_type: MULTI_CPU with num_processes above 1 started 1 process: Accelerate launches several CPU "
        "processes for MULTI_CPU only through mpirun (--mpirun_hostfile), so this run would train alone. On one "
        "machine, use `distributed_type: FSDP` with `use_cpu: true` and `fsdp_config: {fsdp_version: 2}` "
        "(accelerate_configs/cpu_2x2.yaml; hf_flexdemo keeps FSDP2 on CPU), which starts num_processes processes; "
        "or set num_processes: 1 to train in one process."
    )


def _cpu_without_accelerator(original, self: PartialState, cpu: bool = False, **kwargs):
    # Before the process group exists: a restarted round must not touch the stale rendezvous store.
    elastic.check_restart_setup()
    refuse_multi_cpu_started_alone()
    if not cpu and launched_distributed() and not torch.accelerator.is_available():
        cpu = True  # otherwise every process would think it trains alone
    original(self, cpu, **kwargs)


def _refuse_fsdp1_on_cpu(original, self: FullyShardedDataParallelPlugin, *args, **kwargs):
    # Before Accelerate's own set-up, which fails on CPU with a message about devices
    # (`fsdp_sync_module_states`) or goes on to train unsynchronized copies (HYBRID_SHARD).
    version = self.fsdp_version or int(os.environ.get("FSDP_VERSION", "1"))
    if version != 2 and launched_distributed() and not torch.accelerator.is_available():
        raise ValueError(
            "FSDP version 1 is refused on CPU: its HYBRID_SHARD falls back to unsynchronized copies there. "
            "Use FSDP2: `fsdp_config: {fsdp_version: 2}` and, for a hybrid layout, "
            "`parallelism_config: {parallelism_config_dp_replicate_size: <nodes>, "
            "parallelism_config_dp_shard_size: <processes per node>}` instead of fsdp_sharding_strategy."
        )
    if version == 2:
        _refuse_fsdp1_reshard_spelling(self.reshard_after_forward)
    original(self, *args, **kwargs)


FSDP2_RESHARD = {"FULL_SHARD": "true", "SHARD_GRAD_OP": "false"}
"""FSDP1 strategy names that ``fsdp_reshard_after_forward`` takes, and what FSDP2 spells them."""


def _refuse_fsdp1_reshard_spelling(value) -> None:
    """Before Accelerate's own refusal under FSDP2, which says only ``invalid truth value shard_grad_op``."""
    if value is None:
        value = os.environ.get("FSDP_RESHARD_AFTER_FORWARD")
    name = str(getattr(value, "name", value)).strip().upper()
    if name not in FSDP_SHARDING_STRATEGY:
        return
    instead = (
        f"write `fsdp_reshard_after_forward: {FSDP2_RESHARD[name]}`"
        if name in FSDP2_RESHARD
        else "FSDP2 has no such mode: write `fsdp_reshard_after_forward: true` (or false to keep the gathered "
        "parameters between forward and backward), and give a hybrid layout as `parallelism_config`"
    )
    raise ValueError(
        f"fsdp_reshard_after_forward={name} is FSDP1's spelling; with fsdp_version 2 it is true or false: {instead}."
    )


def _refuse_fsdp_without_a_shard_dimension(plugin, config) -> None:
    """Before Accelerate's own refusal of ``dp_shard_size: 1``, whose message is about tensor parallelism."""
    if plugin is None or config is None or config.total_size == 1:
        return
    if config.dp_shard_size == 1 and config.cp_size == 1 and config.tp_size == 1:
        raise ValueError(
            f"parallelism_config_dp_shard_size=1 with FSDP leaves FSDP nothing to shard inside a node "
            f"(dp_replicate {config.dp_replicate_size} x dp_shard 1). For FlexDeMo with one process per node, "
            "remove `parallelism_config` from the Accelerate config: FlexDeMo then uses nodes x 1 by itself. "
            "For another optimizer with one process per node, use `distributed_type: MULTI_GPU` (DDP)."
        )


def _keep_fsdp_on_cpu(original, self: AcceleratorState, *args, **kwargs):
    refuse_parallelism_not_matching_launch(kwargs.get("parallelism_config"), int(os.environ.get("WORLD_SIZE", "1")))
    _refuse_fsdp_without_a_shard_dimension(kwargs.get("fsdp_plugin"), kwargs.get("parallelism_config"))
    original(self, *args, **kwargs)
    plugin = kwargs.get("fsdp_plugin")
    if plugin is None or self.distributed_type != DistributedType.MULTI_CPU:
        return
    self.distributed_type = DistributedType.FSDP
    self.fsdp_plugin = plugin
    if self._mixed_precision != "no":
        plugin.set_mixed_precision(self._mixed_precision)
    # AcceleratorState() copies PartialState's type back on every construction: set both.
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


_INSTALLED = False


def install() -> None:
    """Wrap the four Accelerate methods (idempotent; the list: :mod:`.patches`)."""
    global _INSTALLED
    if not _INSTALLED:
        wrap("accelerate.state.PartialState.__init__", _cpu_without_accelerator)
        wrap("accelerate.utils.FullyShardedDataParallelPlugin.__post_init__", _refuse_fsdp1_on_cpu)
        wrap("accelerate.state.AcceleratorState.__init__", _keep_fsdp_on_cpu)
        wrap("accelerate.Accelerator.prepare", _prepare)
        _INSTALLED = True
