"""Core FlexDeMo checks in 2 simulated nodes x 2 processes (FSDP2 inside a node, gloo).

Run by tests/test_core_distributed.py through torchrun; every rank writes rank<N>.json
with what it measured, and the pytest side asserts on it. One start-up serves all checks.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from support.comm_spy import CommSpy
from support.tiny_models import OddShapes, batch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from hf_flexdemo import FlexDeMo
from hf_flexdemo.compression import ChunkPlan, from_coefficients
from hf_flexdemo.dtensor_utils import local_tensor
from hf_flexdemo.optim.flexdemo_reference import FlexDeMoReference
from hf_flexdemo.scheme_traits import SCHEME_SETTINGS, traits_of
from hf_flexdemo.schemes.momentum import momentum_dtype
from hf_flexdemo.state_store import StateStore
from hf_flexdemo.topology import replica_fingerprints

SCHEMES = ("demo", "random", "striding", "full", "diloco", "sparseloco", "none")
VARIANTS = {  # wire formats of the top-k schemes, run like the schemes
    "demo_1bit_packed": dict(scheme="demo", value_bits=1, pack_indices=True),
    "demo_4bit": dict(scheme="demo", value_bits=4),
    "demo_2bit_stochastic": dict(scheme="demo", value_bits=2, rounding="stochastic"),
    "sparseloco_2bit_packed": dict(scheme="sparseloco", value_bits=2, pack_indices=True, index_coding="elias_fano"),
    "demo_2bit_elias_fano": dict(scheme="demo", topk=16, value_bits=2, pack_indices=True, index_coding="elias_fano"),
    # Update rules (hf_flexdemo.updates): the same wire, another step.
    "demo_adam": dict(scheme="demo", update="adam"),
    "full_adam": dict(scheme="full", update="adam"),
    "demo_ortho_adam": dict(scheme="demo", update="orthogonal"),
    # Muon's inner step between SparseLoCo's outer steps (issue 45, direction 3)
    "sparseloco_ortho": dict(scheme="sparseloco", update="orthogonal", value_bits=2, pack_indices=True),
}
SMALL = dict(topk=4, chunk=8, rate=0.25, inner_steps=5)


def small(**hp) -> dict:
    """SMALL under ``hp``, less the settings the scheme does not read (given there, they are refused)."""
    merged = {**SMALL, **hp}
    reads = traits_of(merged.get("scheme", "demo")).reads
    return {key: value for key, value in merged.items() if key not in SCHEME_SETTINGS or key in reads}


def build(mesh, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    model = OddShapes().to(dtype)
    fully_shard(model, mesh=mesh["shard"])
    return model


def train(model, opt, coords, steps, first_step=0, dtype=torch.float32, on_step=None):
    losses = []
    for step in range(first_step, first_step + steps):
        x, y = batch(*coords, step, dtype=dtype)
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        if on_step:
            on_step()
        opt.step()
        losses.append(loss.item())
    return losses


def check_schemes(mesh, coords, spy) -> dict:
    """Every scheme: loss, replica agreement after 20 steps, counters against the wire."""
    out = {}
    for scheme, kwargs in [*((name, {"scheme": name}) for name in SCHEMES), *VARIANTS.items()]:
        model = build(mesh)
        opt = FlexDeMo(model.parameters(), lr=1e-2, weight_decay=0.01, mesh=mesh, **small(**kwargs))
        per_step, losses = [], []
        for step in range(20):
            x, y = batch(*coords, step)
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            with spy.watching():
                spy.clear()
                opt.step()
            inter = spy.inter_node()
            per_step.append(
                {
                    "counted": opt.last_step_stats.bytes_sent,
                    "wire": sum(c["bytes"] for c in inter),
                    "collectives": len(inter),
                    "counted_collectives": opt.last_step_stats.collectives,
                    "node_all_to_alls": len(spy.intra_node("all_to_all_single")),
                    "dense": opt.last_step_stats.dense_bytes,
                }
            )
            losses.append(loss.item())
        fps = replica_fingerprints(list(model.parameters()), opt.topology)
        total = opt.total_stats
        out[scheme] = {
            "losses": losses,
            "replicas_equal": len(set(fps)) == 1,
            "should_match": opt.replicas_should_match,
            "per_step": per_step,
            "total_sent": total.bytes_sent,
            "total_dense": total.dense_bytes,
            "dense_expected": sum(p.to_local().numel() * 2 for p in model.parameters()) * 20,  # bf16 baseline
            "ns_dtype_agreed": opt.config.update == "orthogonal" and opt.config.ns_dtype == "auto",
        }
    return out


def check_oracle(mesh, coords) -> dict:
    """Local shards against the one-process reference that simulates both replicas (float64)."""
    configs = {
        "demo": dict(scheme="demo", sign=False),
        "demo_sign": dict(scheme="demo", sign=True, update="sign"),
        "demo_packed": dict(scheme="demo", sign=False, pack_indices=True),  # a wire format: same results
        "demo_elias_fano": dict(scheme="demo", sign=False, topk=16, pack_indices=True, index_coding="elias_fano"),
        "demo_every2": dict(scheme="demo", sign=False, replicate_every=2),
        "random": dict(scheme="random", sign=False),
        "striding": dict(scheme="striding", sign=False),
        "full": dict(scheme="full", sign=False),
        "none": dict(scheme="none", sign=False),
        "diloco": dict(scheme="diloco", inner_steps=3),
        "diloco_ortho": dict(scheme="diloco", inner_steps=3, update="orthogonal", ns_dtype="float32"),
        "demo_adam": dict(scheme="demo", update="adam"),
        "full_adam": dict(scheme="full", update="adam"),
        # Newton-Schulz in float32 on both sides: bf16's rounding (the default) would swamp the comparison.
        "full_ortho": dict(scheme="full", update="orthogonal", ns_dtype="float32"),
        "demo_ortho_adam": dict(scheme="demo", update="orthogonal", ns_dtype="float32"),
    }
    group = mesh["replicate"].get_group()
    replicas = mesh["replicate"].size()
    out = {}
    for name, hp in configs.items():
        hp = small(**hp, lr=0.05, weight_decay=0.1)
        if not traits_of(hp["scheme"]).outer_steps:  # diloco's momentum is betas[0]: it refuses decay
            hp["decay"] = 0.9
        model = build(mesh, dtype=torch.float64)
        params = list(model.parameters())
        opt = FlexDeMo(params, mesh=mesh, **hp)
        locals_ = [local_tensor(p).detach().clone() for p in params]
        ref = FlexDeMoReference(locals_, replicas, gather_rows=gather_rows_in_node(mesh), **hp)
        for step in range(8):
            x, y = batch(*coords, step, dtype=torch.float64)
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            grads = []
            for p in params:
                g = local_tensor(p.grad).contiguous()
                parts = [torch.empty_like(g) for _ in range(replicas)]
                dist.all_gather(parts, g, group=group)
                grads.append(parts)
            ref.step([[grads[i][r] for i in range(len(params))] for r in range(replicas)])
            opt.step()
        mine = ref.params[coords[0]]
        err = max((local_tensor(p) - q).abs().max().item() if q.numel() else 0.0 for p, q in zip(params, mine))
        scale = max(q.abs().max().item() if q.numel() else 0.0 for q in mine)
        result = {"max_abs_err": err, "scale": scale}
        # The optimizer's state against the reference's, for every scheme: what it keeps per replica.
        if hp["scheme"] == "diloco":
            ours = [StateStore.local(opt.state[p]["exp_avg"], local_tensor(p)) for p in params]
            ours += [StateStore.local(opt.state[p]["anchor"], local_tensor(p)) for p in params]
            theirs = [m1 for m1, _ in ref.adam[coords[0]]] + list(ref.anchor)
        else:
            ours, theirs = [spatial_momentum(opt, p, hp) for p in params], ref.momenta[coords[0]]
        if hp.get("update") in ("adam", "orthogonal"):  # and adam's second moment (orthogonal: of the rest)
            kept = [opt.state[p].get("update_sq", torch.zeros_like(local_tensor(p))) for p in params]
            ours += [StateStore.local(v, local_tensor(p)) for v, p in zip(kept, params)]  # matrices keep none
            theirs = list(theirs) + ref.second[coords[0]]
        result["state_err"] = max((a - b).abs().max().item() if b.numel() else 0.0 for a, b in zip(ours, theirs))
        out[name] = result
    return out


def gather_rows_in_node(mesh):
    """The reference's own gather of a matrix's row shards (objects, one call per matrix)."""
    shard = mesh["shard"]

    def gather(local: torch.Tensor) -> tuple[torch.Tensor, int]:
        parts = [None] * shard.size()
        dist.all_gather_object(parts, local, group=shard.get_group())
        return torch.cat(parts), sum(t.shape[0] for t in parts[: shard.get_local_rank()])

    return gather


def spatial_momentum(opt, p, hp) -> torch.Tensor:
    """The momentum as the reference keeps it (DeMo stores its DCT coefficients)."""
    local = local_tensor(p)
    if hp["scheme"] != "demo":
        return StateStore.local(opt.state[p]["momentum"], local)
    plan = ChunkPlan.for_shape(local.shape, hp["chunk"], hp["topk"])
    return from_coefficients(StateStore.local(opt.state[p]["momentum_dct"], local), plan).view(local.shape)


def check_checkpoint(mesh, coords, ckpt_root: Path) -> dict:
    """DCP save/load restores each replica's own state; a resumed run continues the same curve."""
    out = {}
    names = ("demo", "random", "diloco", "sparseloco", "sparseloco_ortho", "demo_overlap", "demo_adam")
    names += ("demo_ortho",)
    for name in (*names, "demo_eliasfano"):
        scheme, _, variant = name.partition("_")
        hp = small(scheme=scheme, lr=1e-2, inner_steps=4)
        hp.update(overlap=variant == "overlap")
        if variant == "eliasfano":  # wire=2bit's wire format
            hp.update(value_bits=2, pack_indices=True, index_coding="elias_fano")
        outer = scheme in ("diloco", "sparseloco")  # AdamW inside unless 'ortho' (an explicit 'sign' is refused)
        hp.update(update={"adam": "adam", "ortho": "orthogonal"}.get(variant, None if outer else "sign"))
        model = build(mesh)
        opt = FlexDeMo(model.parameters(), mesh=mesh, **hp)
        train(model, opt, coords, 6)
        opt.synchronize()  # DiLoCo: replicas agree before a save (what the Trainer callback does)
        ckpt = ckpt_root / name
        dcp.save(
            {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=ckpt
        )
        key = {"demo": "momentum_dct", "diloco": "exp_avg", "sparseloco": "outer_error"}.get(scheme, "momentum")
        params = list(model.parameters())
        saved = [StateStore.local(opt.state[p][key], local_tensor(p)).clone() for p in params]
        saved_total = opt.total_stats.bytes_sent
        rule_state = [local_tensor(opt.state[p].get("update_sq", torch.zeros(0))).clone() for p in params]
        state_prints = replica_fingerprints(saved, opt.topology)
        train(model, opt, coords, 4, first_step=6)
        uninterrupted = [local_tensor(p).detach().clone() for p in params]

        model2 = build(mesh, seed=123)  # different init: the load must overwrite everything
        opt2 = FlexDeMo(model2.parameters(), mesh=mesh, **hp)
        state = {"model": get_model_state_dict(model2), "optim": get_optimizer_state_dict(model2, opt2)}
        dcp.load(state, checkpoint_id=ckpt)
        set_model_state_dict(model2, state["model"])
        set_optimizer_state_dict(model2, opt2, state["optim"])
        params2 = list(model2.parameters())
        loaded = [StateStore.local(opt2.state[p][key], local_tensor(p)).clone() for p in params2]
        restored_total = opt2.total_stats.bytes_sent
        rule_state2 = [local_tensor(opt2.state[p].get("update_sq", torch.zeros(0))).clone() for p in params2]
        train(model2, opt2, coords, 4, first_step=6)
        out[name] = {
            "state_differs_across_replicas": len(set(state_prints)) > 1,
            "state_restored_exactly": all(torch.equal(a, b) for a, b in zip(saved, loaded)),
            "state_dtype_kept": all(b.dtype == momentum_dtype(p) for b, p in zip(loaded, params2)),
            "counters_restored": restored_total == saved_total,
            "rule_state_restored": all(torch.equal(a, b) for a, b in zip(rule_state, rule_state2))
            and (variant != "adam" or any(bool(a.any()) for a in rule_state)),
            "step_restored": int(opt2.state[params2[0]]["step"]) == 10,
            "resume_matches": all(torch.equal(local_tensor(p), q) for p, q in zip(params2, uninterrupted)),
        }
    return out


def check_overlap(mesh, coords, spy) -> dict:
    """overlap=True (async exchange, applied one step late) against the plain run, with
    gradients that do not depend on the parameters: after a flush both must be bitwise equal."""
    hp = small(lr=1e-2)
    results = {}
    models = {}
    for overlap in (False, True):
        model = build(mesh)
        opt = FlexDeMo(model.parameters(), mesh=mesh, overlap=overlap, **hp)
        params = list(model.parameters())
        spy.clear()
        with spy.watching():
            for step in range(6):
                g = torch.Generator().manual_seed(10_000 * coords[0] + 100 * coords[1] + step)
                for p in params:
                    p.grad = torch.distributed.tensor.DTensor.from_local(
                        torch.randn(local_tensor(p).shape, generator=g), p.device_mesh, p.placements,
                        shape=p.shape, stride=p.stride(), run_check=False,
                    )  # fmt: skip
                opt.step()
            pending = opt._pending is not None
            opt.flush()
        models[overlap] = [local_tensor(p).clone() for p in params]
        results[f"overlap={overlap}"] = {
            "pending_before_flush": pending,
            "wire": spy.inter_node_bytes(),
            "counted": opt.total_stats.bytes_sent,
            "replicas_equal": len(set(replica_fingerprints(params, opt.topology))) == 1,
        }
    results["equal_to_plain"] = all(torch.equal(a, b) for a, b in zip(models[False], models[True]))
    return results


def check_drift_detection(mesh, coords) -> dict:
    """The Trainer callback's replica check: silent when replicas agree, loud when one drifts."""
    from hf_flexdemo.integrations.callback import FlexDeMoCallback, ReplicaDriftError

    model = build(mesh)
    opt = FlexDeMo(model.parameters(), mesh=mesh, **small())
    train(model, opt, coords, 3)
    callback = FlexDeMoCallback()
    callback._optimizer = opt
    callback.assert_replicas_in_sync(3)  # no error: replicas agree
    if coords[0] == 1:  # one replica drifts by one ulp in one entry
        with torch.no_grad():
            first = local_tensor(next(p for p in model.parameters() if local_tensor(p).numel()))
            first.view(-1)[0] = torch.nextafter(first.view(-1)[0], torch.tensor(float("inf")))
    try:
        callback.assert_replicas_in_sync(4)
        return {"raised": None}
    except ReplicaDriftError as e:
        return {"raised": str(e)}


def check_errors(mesh) -> dict:
    out = {}
    # HSDP: FSDP itself would all-reduce across nodes; FlexDeMo must refuse it.
    torch.manual_seed(0)
    model = OddShapes()
    fully_shard(model, mesh=mesh)
    opt = FlexDeMo(model.parameters(), mesh=mesh, **small())
    try:
        opt.step()
        out["hsdp"] = None
    except ValueError as e:
        out["hsdp"] = str(e)
    # No mesh in a multi-process job: never train unsynchronized.
    model = build(mesh)
    opt = FlexDeMo(model.parameters(), **small())
    try:
        opt.step()
        out["no_mesh"] = None
    except RuntimeError as e:
        out["no_mesh"] = str(e)
    return out


def check_start_sync(mesh) -> dict:
    """Replicas that start from different parameters are brought to replica 0's on the first step."""
    replica = mesh["replicate"].get_local_rank()
    model = build(mesh, seed=replica)  # different init per replica
    opt = FlexDeMo(model.parameters(), mesh=mesh, **small())
    before = replica_fingerprints(list(model.parameters()), opt.topology)
    opt.step()  # no gradients: zero update, but the start check runs
    after = replica_fingerprints(list(model.parameters()), opt.topology)
    return {"differed_before": len(set(before)) > 1, "equal_after": len(set(after)) == 1}


def check_settings_agreement(mesh, coords) -> dict:
    """Nodes launched with different settings are refused on the first step, before the exchange: a wire setting
    (buffers of other sizes: a hang or a failed collective) and the learning rate (other steps: silent drift)."""
    wire = small(value_bits=2, pack_indices=True)
    cases = {
        "index_coding": dict(wire, index_coding="elias_fano" if coords[0] == 1 else "fixed"),
        "lr": small(lr=2e-3 if coords[0] == 1 else 1e-3),
        "same": dict(wire, index_coding="elias_fano"),
    }
    out = {}
    for name, kwargs in cases.items():
        model = build(mesh)
        opt = FlexDeMo(model.parameters(), mesh=mesh, **kwargs)
        x, y = batch(*coords, 0)
        ((model(x) - y) ** 2).mean().backward()
        before = [local_tensor(p).detach().clone() for p in model.parameters()]
        try:
            opt.step()
            out[name] = {"raised": None}
        except ValueError as e:
            out[name] = {"raised": str(e)}
        out[name]["stepped"] = not all(torch.equal(a, local_tensor(p)) for a, p in zip(before, model.parameters()))
    return out


def check_ns_dtype_agreement(mesh, coords) -> dict:
    """ns_dtype='auto' with node 1's devices slow at bf16: every process of the job iterates in float32."""
    from hf_flexdemo.updates import orthogonal

    probe = orthogonal.multiplies_bf16_fast
    out = {}
    try:
        group, cpu = mesh["replicate"].get_group(), torch.device("cpu")
        orthogonal.multiplies_bf16_fast = lambda device: True
        out["all_fast"] = str(orthogonal.agreed_newton_schulz_dtype("auto", cpu, group))
        orthogonal.multiplies_bf16_fast = lambda device: coords[0] == 0
        out["node1_slow"] = str(orthogonal.agreed_newton_schulz_dtype("auto", cpu, group))
        out["node1_slow_forced"] = str(orthogonal.agreed_newton_schulz_dtype("bf16", cpu, group))
        model = build(mesh)
        opt = FlexDeMo(model.parameters(), mesh=mesh, update="orthogonal", elementwise=[], **small())
        train(model, opt, coords, 3)
        out["rule_dtype"] = str(opt.rules["orthogonal"].dtype)
        out["replicas_equal"] = len(set(replica_fingerprints(list(model.parameters()), opt.topology))) == 1
    finally:
        orthogonal.multiplies_bf16_fast = probe
    return out


def check_triton_kernels(mesh, coords, spy) -> dict | None:
    """kernels='triton' (Triton's interpreter on these CPU processes) against 'torch' on a small model whose shards
    make a few tiles (one process's shard of the head is empty): replicas bitwise equal, the same bytes on the wire.
    None where Triton is not installed."""
    if importlib.util.find_spec("triton") is None:
        return None
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' first use imports them
    out = {}
    for kernels in ("torch", "triton"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Flatten(), nn.Linear(24, 16), nn.Tanh(), nn.Linear(16, 1))
        fully_shard(model, mesh=mesh["shard"])
        opt = FlexDeMo(model.parameters(), lr=2**-7, weight_decay=0.01, mesh=mesh, update="sign", kernels=kernels,
                       value_bits=2, pack_indices=True, **small())  # fmt: skip
        wire = []
        for step in range(3):
            x, y = batch(*coords, step)
            opt.zero_grad()
            ((model(x).squeeze(-1) - y) ** 2).mean().backward()
            with spy.watching():
                spy.clear()
                opt.step()
            wire.append(sum(c["bytes"] for c in spy.inter_node()))
        out[kernels] = {
            "replicas_equal": len(set(replica_fingerprints(list(model.parameters()), opt.topology))) == 1,
            "wire": wire,
            "counted": opt.total_stats.bytes_sent,
            "params": [local_tensor(p).detach().reshape(-1).tolist() for p in model.parameters()],
        }
    return out


def main() -> None:
    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    coords = (mesh["replicate"].get_local_rank(), mesh["shard"].get_local_rank())
    spy = CommSpy(processes_per_node=2)
    result = {
        "rank": rank,
        "coords": coords,
        "schemes": check_schemes(mesh, coords, spy),
        "oracle": check_oracle(mesh, coords),
        "checkpoint": check_checkpoint(mesh, coords, out_dir / "ckpt"),
        "overlap": check_overlap(mesh, coords, spy),
        "drift": check_drift_detection(mesh, coords),
        "errors": check_errors(mesh),
        "start_sync": check_start_sync(mesh),
        "settings": check_settings_agreement(mesh, coords),
        "ns_dtype": check_ns_dtype_agreement(mesh, coords),
        "triton": check_triton_kernels(mesh, coords, spy),
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
