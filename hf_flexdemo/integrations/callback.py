"""FlexDeMoCallback: FlexDeMo's part of the Trainer loop.

- **Attaches and reports** at train start: the optimizer must have its replicate group
  (the Accelerate plugin attaches it in ``accelerator.prepare``).
- **Owns the replication schedule at step boundaries**: per-step schemes replicate inside
  ``optimizer.step()``. Before every checkpoint save, every evaluation and at the end, the
  callback calls ``optimizer.synchronize()``: a pending ``overlap`` exchange is applied,
  and DiLoCo runs an extra outer step, so that what is saved, evaluated and returned is
  the replicas' common model (DiLoCo replicas differ between outer steps).
- **Logs** the inter-node figures of node 0 (with fault tolerance, each node its own) at
  every logging step, into the Trainer logs (console, wandb, TensorBoard, ``log_history``):
  ``flexdemo/bytes_sent_per_step``, cumulative ``flexdemo/bytes_sent`` and ``flexdemo/bytes_received``,
  ``flexdemo/dense_bytes`` (what HSDP's dense all-reduce of bf16 gradients would have sent, 2 bytes
  per parameter, whatever this run's dtype) and ``flexdemo/x_fewer_than_bf16_dense`` (their ratio, the
  figure of README's wire table); with fault tolerance also ``flexdemo/live_replicas`` (the
  last quorum's nodes), ``flexdemo/committed_steps`` (torchft's count of committed rounds: the training
  steps and the rounds that synchronize before saves, evaluations and the end of training),
  ``flexdemo/samples_per_step`` (samples the last quorum's step trained on, over all its
  nodes: it rises as nodes join) and ``flexdemo/committed_samples`` (samples of every node in
  the steps this node committed since its process started), and the seconds per step this
  process spent in each phase of its quorum rounds, ``flexdemo/seconds_quorum``, ``_heal``,
  ``_exchange``, ``_commit``, ``_catch_up`` and ``_serve`` (see :mod:`hf_flexdemo.fault_tolerance.timeline`).
- **Checks replicas** at every logging step (and every ``check_every`` steps, if set):
  replicas that should hold the same parameters are compared by checksum, and training
  stops with an error if they drifted.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from .. import refusals
from ..fault_tolerance.rounds import managed_replicas
from ..optim import FlexDeMo, unwrap_flexdemo
from ..optim.counters import x_fewer_than_bf16_dense
from ..topology import collective_device
from .simulation import SimulatedSteps

logger = logging.getLogger(__name__)


RATIO_KEY = "flexdemo/x_fewer_than_bf16_dense"
"""The logged ratio: the dense bf16 all-reduce's bytes over the bytes sent (as README's wire table counts)."""


class ReplicaDriftError(RuntimeError):
    """Replicas that should be identical hold different parameters."""


class FlexDeMoCallback(TrainerCallback):
    """Routes FlexDeMo's inter-node step in the Trainer. Added to every FlexDeMo Trainer (``optim="flexdemo"``) by
    ``import hf_flexdemo``; a Trainer with another optimizer gets it only if passed in ``callbacks``, where it does
    nothing.

    Args:
        check_every: also compare replicas every this many steps (besides logging steps);
            ``0`` compares at logging steps only.
    """

    def __init__(self, check_every: int = 0):
        if check_every < 0:
            raise ValueError(f"FlexDeMoCallback: check_every={check_every} is invalid; it must be >= 0.")
        self.check_every = check_every
        self._optimizer: FlexDeMo | None = None
        self._node_group = None
        self._last = None  # (global_step, totals) at the last log
        self._last_clock: dict[str, float] = {}  # fault tolerance: cumulative seconds per round phase at the last log
        self._steps_run = 0  # steps this process ran since the last log (a heal can move global_step further)
        self._pending: dict[str, float] = {}
        self._node_samples = 0  # samples one node trains on per step (all its processes, accumulation included)
        self._micro_steps = 0  # micro-batches of this step done before the current one
        self._hook_checked = False  # the refusal hook, at this run's first step (after the reporters' on_train_begin)
        self._simulation: SimulatedSteps | None = None
        self.figures: dict[str, float] = {}
        """This node's latest figures (the logged keys; node 0's on the main process), refreshed at logging steps
        and at the end."""

    def on_train_begin(self, args, state, control, optimizer=None, **kw):
        self._hook_checked = False
        self._optimizer = unwrap_flexdemo(optimizer)
        if self._optimizer is None:
            return
        opt = self._optimizer
        replicas = opt.config.simulate_replicas
        self._simulation = SimulatedSteps(opt, args, replicas) if replicas > 1 else None
        world = dist.get_world_size() if dist.is_initialized() else 1
        if opt.store is None and world > 1:  # neither attached to a mesh nor wrapped
            raise RuntimeError(
                "FlexDeMo has no replicate group at train start. `import hf_flexdemo` before the Trainer is "
                "created and launch with an FSDP2 Accelerate config (see accelerate_configs/)."
            )
        topo = opt.topology
        if topo.mesh is not None:
            names = [n for n in topo.mesh.mesh_dim_names if n != topo.replicate_dim]
            self._node_group = topo.mesh[names[0]].get_group() if names else None
        managed = managed_replicas(opt)
        if managed is not None:  # each node is its own job: the node is the whole world
            self._node_group = dist.group.WORLD if dist.is_initialized() else None
            if state.is_world_process_zero:
                logger.info("FlexDeMo: %s trains in a torchft quorum of live nodes.", managed.identity.name)
        elif not opt.config.traits.sends and topo.size > 1:
            logger.warning(
                "FlexDeMo scheme='none' on %d replicas: nothing is exchanged, so replicas drift apart.", topo.size
            )
        if self._simulation is not None and state.is_world_process_zero:
            logger.info(
                "FlexDeMo: %d replicas simulated in this process, %d micro-batch(es) each per step.",
                replicas, self._simulation.micro_steps,
            )  # fmt: skip
        elif topo.size == 1 and managed is None and state.is_world_process_zero:
            logger.warning(
                "FlexDeMo has 1 replica: nothing crosses nodes (byte figures stay 0) and each step applies the "
                "update rule to this replica's own update. Launch several nodes (parallelism_config_dp_replicate_size) "
                "to replicate."
            )
        if state.is_world_process_zero:
            logger.info("FlexDeMo: %d replica(s), scheme=%r, %s", topo.size, opt.config.scheme, opt.config)
        self._last = (state.global_step, self._node_totals())
        self._last_clock = managed.clock.totals() if managed is not None else {}
        self._node_samples = args.per_device_train_batch_size * args.gradient_accumulation_steps * world

    # -- every step ----------------------------------------------------------------------

    def on_step_begin(self, args, state, control, **kw):
        if not self._hook_checked:  # once a run: back above a hook installed at train start (wandb.init)
            refusals.install()
            self._hook_checked = True
        if self._optimizer is not None and self._optimizer.wrapped_by is not None:
            self._optimizer.wrapped_by.begin_step()  # fault tolerance: join the quorum (and heal) before the forward
        self._micro_steps = 0

    def on_substep_end(self, args, state, control, **kw):
        """simulate_replicas: a replica's last micro-batch is done; the next ones are the next replica's."""
        self._micro_steps += 1
        if self._simulation is not None and self._micro_steps % self._simulation.micro_steps == 0:
            self._simulation.close_replica(self._simulation.micro_steps)

    def on_pre_optimizer_step(self, args, state, control, **kw):
        if self._simulation is not None:
            self._simulation.close_step(args, self._micro_steps + 1, state.global_step + 1)

    def on_step_end(self, args, state, control, **kw):
        opt = self._optimizer
        if opt is None:
            return
        self._steps_run += 1
        if control.should_save or control.should_evaluate or state.global_step >= state.max_steps:
            # Saves, evaluations and the final model see every update (overlap) and, for
            # DiLoCo, the replicas' average.
            opt.synchronize()
        check = self.check_every and state.global_step % self.check_every == 0
        if control.should_log or check:
            self.assert_replicas_in_sync(state.global_step)
        if control.should_log:
            self._pending = self._figures(state.global_step)

    def on_epoch_end(self, args, state, control, **kw):
        # Epoch strategies set should_save/should_evaluate after on_step_end has run.
        if self._optimizer is not None and (control.should_save or control.should_evaluate):
            self._optimizer.synchronize()

    def on_log(self, args, state, control, logs=None, **kw):
        if self._optimizer is None or not self._pending or logs is None or "loss" not in logs:
            return
        logs.update(self._pending)
        if state.log_history:
            state.log_history[-1].update(self._pending)
        self._pending = {}

    def on_train_end(self, args, state, control, **kw):
        if self._optimizer is not None:
            self._optimizer.synchronize()
            self.assert_replicas_in_sync(state.global_step)  # also after --load_best_model_at_end
            if state.global_step > self._last[0]:  # steps since the last log: refresh the figures
                self._figures(state.global_step)

    # -- helpers -------------------------------------------------------------------------

    def assert_replicas_in_sync(self, step: int) -> None:
        opt = self._optimizer
        if not opt.replicas_should_match:
            return
        prints = opt.replica_fingerprints()
        if len(set(prints)) > 1:
            raise ReplicaDriftError(
                f"FlexDeMo: replicas hold different parameters at step {step} (checksums {prints} on replica "
                f"group of rank {dist.get_rank() if dist.is_initialized() else 0}). They must stay bitwise "
                "identical; this points at non-deterministic kernels or a process that skipped a step."
            )

    def _node_totals(self) -> torch.Tensor:
        """This node's cumulative (sent, received, dense) bytes: the sum over its processes."""
        stats = self._optimizer.total_stats
        totals = torch.tensor([stats.bytes_sent, stats.bytes_received, stats.dense_bytes], dtype=torch.float64)
        if self._node_group is not None:
            totals = totals.to(collective_device(self._node_group))
            dist.all_reduce(totals, group=self._node_group)
        return totals.cpu()

    def _figures(self, step: int) -> dict[str, float]:
        totals = self._node_totals()
        last_step, last_totals = self._last
        self._last = (step, totals)
        steps = max(step - last_step, 1)
        sent, received, dense = totals.tolist()
        figures = {
            "flexdemo/bytes_sent_per_step": (sent - last_totals[0].item()) / steps,
            "flexdemo/bytes_sent": sent,
            "flexdemo/bytes_received": received,
            "flexdemo/dense_bytes": dense,
        }
        if sent:
            figures[RATIO_KEY] = x_fewer_than_bf16_dense(sent, dense)
        replicas = managed_replicas(self._optimizer)
        if replicas is not None:  # fault tolerance: who is training, and how far the quorum got
            figures["flexdemo/live_replicas"] = replicas.topology().size
            figures["flexdemo/committed_steps"] = replicas.step
            figures["flexdemo/samples_per_step"] = replicas.topology().size * self._node_samples
            figures["flexdemo/committed_samples"] = replicas.quorum.committed_node_steps * self._node_samples
            clock, ran = replicas.clock.totals(), max(self._steps_run, 1)
            for phase, seconds in clock.items():
                figures[f"flexdemo/seconds_{phase}"] = (seconds - self._last_clock.get(phase, 0.0)) / ran
            self._last_clock = clock
        self._steps_run = 0
        self.figures = figures
        return figures
