"""FlexDeMo's optimizer step on a GPU: bf16, NCCL, T5-small and OLMo2-1B shapes, against AdamW.

    # one GPU: the step's compute, phase by phase
    python benchmarks/step/gpu_step.py --model olmo2-1b
    # one process per GPU, each a replica (NCCL): adds the real exchange and AdamW-HSDP's all-reduce
    torchrun --standalone --nproc-per-node 8 benchmarks/step/gpu_step.py --model olmo2-1b

Parameters and gradients are bf16 on the GPU (FlexDeMo keeps its momentum in float32).
Times are medians over ``--repeats`` runs of ``--steps`` steps after one warm-up run,
with ``torch.cuda.synchronize()`` around each run. Phases are DeMo's update over the
same shapes (DCT, top-k, error feedback, decode, inverse DCT, signed update), in ms.
``--profile`` adds, per FlexDeMo configuration, one step under ``torch.profiler``: CUDA kernels
launched, the host's time in the step and the GPU's busy time, and the five costliest kernels.
``--fwd_bwd`` times the model's own forward and backward (random weights, bf16, batch
``--batch`` x ``--seq`` tokens), the denominator of "share of a training step".
Refuses to run without CUDA (``--node_of N --dry_run`` below excepted): CPU figures are
`optimizer_step.py` and `demo_phases.py`.

``--node_of N``: one GPU measures what ONE rank of a node of N GPUs does per step (FSDP2 inside
the node, one node of the job)::

    python benchmarks/step/gpu_step.py --model olmo2-1b --node_of 8 --fwd_bwd
    python benchmarks/step/gpu_step.py --model olmo2-1b --node_of 8 --dry_run   # the plan alone, no GPU

- Every parameter at its FSDP2 shard shape: FSDP2 cuts dim 0 as ``torch.chunk`` does,
  ``ceil(rows / N)`` rows per rank, the last ranks shorter or empty; rank 0's shard, the
  largest, is the one timed.
- Fused AdamW on those shards (what a rank of AdamW-FSDP does), and FlexDeMo on them (plain
  tensors, no process group, so one replica): ``update='sign'``, and the default rule's pipeline
  without Newton-Schulz (``sign`` on the matrices it would orthogonalize, ``adam`` on the rest).
- Newton-Schulz as this rank runs it: each whole matrix has one owner among the node's ranks
  (``deal_owners`` over the buckets ``build_buckets`` makes of the whole shapes, batched as the
  optimizer hands them to the rule); this rank orthogonalizes the whole matrices it owns, in the
  dtype the rule picks on this GPU. "Default rule, one rank of N" is pipeline + Newton-Schulz.
- Not timed, one GPU being one rank: the rule's two all-to-alls per batch inside the node (the
  bytes this rank would send and receive are printed, computed from the shapes) and the copies
  that pack and unpack them, and FSDP2's all-gathers and reduce-scatters. ``--fwd_bwd`` times the whole model's forward and backward
  of this rank's batch on this GPU, unsharded: the ratio "default rule / fwd+bwd" is the
  issue's target (at most 10%).
- ``--dry_run`` prints the plan (shards, owned matrices, all-to-all bytes) on any machine;
  ``--device cpu`` runs the timing on CPU for ``--model t5-small`` only, as a smoke test.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from demo_phases import median_ms, phase_functions
from torch.distributed.device_mesh import init_device_mesh

from hf_flexdemo import FlexDeMo, elementwise_parameters
from hf_flexdemo.buckets import ParamSlot, build_buckets
from hf_flexdemo.config import ELEMENTWISE_UPDATE, NS_DTYPES
from hf_flexdemo.state_store import StateView
from hf_flexdemo.updates import with_elementwise_groups
from hf_flexdemo.updates.orthogonal import OrthogonalRule, deal_owners, scaled_newton_schulz
from hf_flexdemo.wire import ring_all_reduce_bytes

DEVICE = "cuda"


def build_model(name: str, device: str = "meta") -> torch.nn.Module:
    """The named model with random weights on ``device`` (``meta``: shapes only, no memory, no download)."""
    from transformers import Olmo2Config, Olmo2ForCausalLM, T5Config, T5ForConditionalGeneration

    with torch.device(device):
        if name == "t5-small":
            model = T5ForConditionalGeneration(T5Config())
        elif name == "olmo2-1b":  # allenai/OLMo-2-0425-1B's sizes
            config = Olmo2Config(
                vocab_size=100352,
                hidden_size=2048,
                intermediate_size=8192,
                num_hidden_layers=16,
                num_attention_heads=16,
                num_key_value_heads=16,
                tie_word_embeddings=False,
            )
            model = Olmo2ForCausalLM(config)
        else:
            raise ValueError(f"--model={name!r} is invalid; choose 't5-small' or 'olmo2-1b'.")
    return model


def model_shapes(name: str) -> tuple[list[torch.Size], int]:
    """Parameter shapes of the named model and its vocabulary."""
    model = build_model(name)
    return [p.shape for p in model.parameters()], model.config.vocab_size


def forward_backward_ms(name: str, batch: int, seq: int, repeats: int, device: str = DEVICE) -> float:
    """Median ms of one forward and backward of the model in bf16 on ``batch`` x ``seq`` random tokens."""
    model = build_model(name, device).to(torch.bfloat16)
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)
    extra = {"decoder_input_ids": tokens} if model.config.is_encoder_decoder else {}

    def once():
        model(input_ids=tokens, labels=tokens, **extra).loss.backward()
        model.zero_grad(set_to_none=True)

    return median_ms(once, repeats, synchronizer(device))


def profile_step(step) -> str:
    """One step under torch.profiler: kernels, host ms, GPU busy ms and the five costliest kernels."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        step()
        host = time.perf_counter() - start
        torch.cuda.synchronize()
    # The optimizer's record_function range shows up on the GPU's timeline too: it is not a kernel.
    on_gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [e for e in on_gpu if not e.name.startswith("Optimizer.")]
    busy = sum(e.device_time for e in kernels) / 1e3  # device_time is in us
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name] = by_name.get(e.name, 0.0) + e.device_time / 1e3
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:5]
    costliest = "; ".join(f"{ms:.2f} ms {name[:60]}" for name, ms in top)
    return f"{len(kernels)} kernels, host {host * 1e3:.1f} ms, GPU busy {busy:.1f} ms | {costliest}"


def synchronizer(device: str):
    """What waits for ``device``'s queued work (nothing to wait for on a CPU)."""
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def time_steps(step, steps: int, repeats: int, sync=torch.cuda.synchronize) -> float:
    for _ in range(steps):
        step()
    times = []
    for _ in range(repeats):
        if dist.is_initialized():
            dist.barrier()
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        times.append((time.perf_counter() - start) / steps)
    return statistics.median(times)


# -- --node_of N: one rank of a node of N GPUs ---------------------------------------------------


def fsdp_shard_shape(shape: torch.Size, n: int, rank: int) -> torch.Size:
    """``rank``'s FSDP2 shard of a parameter of ``shape`` over ``n`` ranks: dim 0 cut as ``torch.chunk`` does."""
    if len(shape) == 0:
        return shape
    per = math.ceil(shape[0] / n)
    return torch.Size((max(0, min(per, shape[0] - rank * per)), *shape[1:]))


@dataclass(frozen=True)
class OwnerExchange:
    """One application of the orthogonal rule to a batch of buckets: one all-to-all out, one back."""

    matrices: tuple[tuple[int, int, int], ...]
    """``(count, rows, cols)`` of each 2-D bucket the rule orthogonalizes in this batch (whole shapes)."""
    owned: tuple[int, ...]
    """How many of each bucket's matrices this rank owns (``deal_owners``)."""
    out_entries: int
    """Entries this rank sends the other ranks (its padded row shards of the matrices they own); the
    back all-to-all brings it as many."""
    in_entries: int
    """Entries it receives from the other ranks (their row shards of the matrices it owns); it sends as
    many back."""


@dataclass(frozen=True)
class NodeShardPlan:
    """What one rank of a node of ``n`` holds and computes, from the model's shapes alone."""

    n: int
    rank: int
    whole_shapes: tuple[torch.Size, ...]
    """Every parameter's shape, in ``model.parameters()`` order."""
    shard_shapes: tuple[torch.Size, ...]
    """This rank's FSDP2 shard of each."""
    orthogonalized: tuple[bool, ...]
    """Whether the default rule orthogonalizes the parameter (2-D, not an embedding or output head)."""
    exchanges: tuple[OwnerExchange, ...]

    def owned_matrices(self) -> list[tuple[int, int, int]]:
        """``(count, rows, cols)`` of the whole matrices this rank orthogonalizes, one entry per bucket."""
        return [
            (mine, rows, cols)
            for exchange in self.exchanges
            for mine, (_, rows, cols) in zip(exchange.owned, exchange.matrices)
            if mine
        ]

    def all_to_all_bytes(self, ns_dtype: torch.dtype) -> tuple[int, int]:
        """Bytes this rank sends and receives over the node's links per step, both all-to-alls of every
        batch: out in float32, back in Newton-Schulz's dtype (what stays on the rank is not counted)."""
        back = torch.finfo(ns_dtype).bits // 8
        out = sum(e.out_entries for e in self.exchanges)
        into = sum(e.in_entries for e in self.exchanges)
        return 4 * out + back * into, 4 * into + back * out


def node_shard_plan(model: torch.nn.Module, n: int, rank: int = 0) -> NodeShardPlan:
    """Rank ``rank``'s shards of ``model`` (any device; ``meta`` allocates nothing) in a node of ``n``, and the
    whole matrices it owns under the default rule.

    The groups are the Trainer's (embeddings and heads apart, ``elementwise_parameters``), the buckets
    ``build_buckets``'s over the whole shapes, batched for the rule as ``RuleApplier.decode_and_apply``
    does (a batch closes at ``bucket_entries`` whole entries), and each batch's matrices dealt by
    ``deal_owners``, as ``_orthogonalize_by_owner`` deals them.
    """
    if not (isinstance(n, int) and n >= 1 and 0 <= rank < n):
        raise ValueError(f"--node_of={n} with rank {rank} is invalid; N must be a positive integer and 0 <= rank < N.")
    tables = elementwise_parameters(model)
    table_ids = {id(p) for p in tables}
    params = [p for p in model.parameters() if p.requires_grad]
    slots_by_group, index = [], 0
    for group in with_elementwise_groups(params, tables, ELEMENTWISE_UPDATE):
        rule = {"update": group.get("update", OrthogonalRule.name)}  # the optimizer's default rule for demo
        slots = []
        for p in group["params"]:
            index += 1
            local = torch.empty(fsdp_shard_shape(p.shape, n, rank), dtype=p.dtype, device="meta")
            slots.append(ParamSlot(local, StateView(None, p, local, {}), rule, index))
        slots_by_group.append(slots)
    batches, batch, entries = [], [], 0
    for bucket in build_buckets(slots_by_group, FlexDeMo.bucket_entries):
        batch.append(bucket)
        entries += bucket.count * bucket.full_shape.numel()
        if entries >= FlexDeMo.bucket_entries:
            batches.append(batch)
            batch, entries = [], 0
    batches.append(batch)
    exchanges = []
    for batch in batches:
        buckets = [b for b in batch if b.group["update"] == OrthogonalRule.name and len(b.full_shape) == 2]
        if not buckets:
            continue
        matrices = tuple((b.count, *b.full_shape) for b in buckets)
        owned = deal_owners(tuple((count, rows * cols) for count, rows, cols in matrices), n)
        block = [math.ceil(rows / n) * cols for _, rows, cols in matrices]  # one padded row shard
        out = sum(owned[j][q] * block[j] for q in range(n) if q != rank for j in range(len(matrices)))
        into = (n - 1) * sum(owned[j][rank] * block[j] for j in range(len(matrices)))
        exchanges.append(OwnerExchange(matrices, tuple(row[rank] for row in owned), out, into))
    return NodeShardPlan(
        n=n,
        rank=rank,
        whole_shapes=tuple(p.shape for p in params),
        shard_shapes=tuple(fsdp_shard_shape(p.shape, n, rank) for p in params),
        orthogonalized=tuple(p.dim() == 2 and id(p) not in table_ids for p in params),
        exchanges=tuple(exchanges),
    )


def rule_ns_dtype(device: str, setting: str | None = None) -> torch.dtype:
    """The dtype the orthogonal rule's Newton-Schulz iterates in on ``device`` (``setting``: ``ns_dtype``, the
    optimizer's default when None): asked of the optimizer itself, one step on a small matrix."""
    param = torch.nn.Parameter(torch.zeros(8, 8, device=device))
    param.grad = torch.ones_like(param)
    opt = FlexDeMo([param], topk=1, chunk=4, elementwise=[], **({"ns_dtype": setting} if setting else {}))
    opt.step()
    return opt.rules[OrthogonalRule.name].dtype


def describe_plan(name: str, plan: NodeShardPlan, ns_dtype: torch.dtype, verbose: bool = False) -> list[str]:
    """The plan in words: shards, owned matrices and the all-to-all bytes."""
    whole = sum(s.numel() for s in plan.whole_shapes)
    shard = sum(s.numel() for s in plan.shard_shapes)
    entries = [count * rows * cols for exchange in plan.exchanges for count, rows, cols in exchange.matrices]
    owned = sum(count * rows * cols for count, rows, cols in plan.owned_matrices())
    n_owned = sum(count for count, _, _ in plan.owned_matrices())
    n_all = sum(count for exchange in plan.exchanges for count, _, _ in exchange.matrices)
    sent, received = plan.all_to_all_bytes(ns_dtype)
    ns = str(ns_dtype).removeprefix("torch.")
    lines = [
        f"{name} as rank {plan.rank} of a node of {plan.n} (FSDP2 shards: ceil(rows / {plan.n}) rows per rank, "
        f"rank 0's the largest)",
        f"  this rank's shards: {shard / 1e6:.1f}M of {whole / 1e6:.1f}M parameters ({len(plan.whole_shapes)} tensors)",
        f"  Newton-Schulz: this rank owns {n_owned} of {n_all} whole matrices, {owned / 1e6:.1f}M entries "
        f"(a rank's average {sum(entries) / plan.n / 1e6:.1f}M), in {ns}",
        f"  not timed (one GPU): the rule's in-node all-to-alls, {2 * len(plan.exchanges)} per step "
        f"({len(plan.exchanges)} batches, out in float32, back in {ns}): this rank sends {sent / 1e6:.1f} MB and "
        f"receives {received / 1e6:.1f} MB; FSDP2's all-gathers and reduce-scatters",
    ]
    for i, exchange in enumerate(plan.exchanges if verbose else ()):
        mine = zip(exchange.owned, exchange.matrices)
        owns = ", ".join(f"{owned} of {count} x {rows}x{cols}" for owned, (count, rows, cols) in mine)
        out, into = exchange.out_entries / 1e6, exchange.in_entries / 1e6
        back = f"back: the reverse, in {ns}"
        lines.append(f"    batch {i}: owns {owns}; out sends {4 * out:.1f} MB, receives {4 * into:.1f} MB ({back})")
    return lines


def node_rank_ms(args: argparse.Namespace, plan: NodeShardPlan, ns_dtype: torch.dtype, device: str) -> dict:
    """Median ms per step of each part of one rank's step on ``plan``'s shards (see the module doc)."""
    sync = synchronizer(device)
    g = torch.Generator(device=device).manual_seed(0)
    bf16 = dict(generator=g, device=device, dtype=torch.bfloat16)
    params = [torch.nn.Parameter(torch.randn(s, **bf16) * 0.02) for s in plan.shard_shapes]
    grads = [torch.randn(s, **bf16) * 1e-3 for s in plan.shard_shapes]
    matrices = [p for p, ortho in zip(params, plan.orthogonalized) if ortho]
    others = [p for p, ortho in zip(params, plan.orthogonalized) if not ortho]
    settings = {"lr": 1e-4, "topk": args.topk, "chunk": args.chunk}
    makers = {
        "adamw (fused)": lambda: torch.optim.AdamW(params, lr=1e-4, fused=True),
        "flexdemo sign": lambda: FlexDeMo(params, update="sign", **settings),
        # The default rule less its Newton-Schulz: sign's few element-wise ops stand in for the subtraction
        # of each matrix's orthogonalized rows; the rest take the element-wise rule as they would.
        "pipeline": lambda: FlexDeMo(
            [{"params": matrices}, {"params": others, "update": ELEMENTWISE_UPDATE}], update="sign", **settings
        ),
    }
    if device == "cuda":  # the fused kernels (kernels='triton'), the same configurations
        makers["flexdemo sign, triton"] = lambda: FlexDeMo(params, update="sign", kernels="triton", **settings)
        makers["pipeline, triton"] = lambda: FlexDeMo(
            [{"params": matrices}, {"params": others, "update": ELEMENTWISE_UPDATE}],
            update="sign", kernels="triton", **settings,
        )  # fmt: skip
    times = {}
    for name, make in makers.items():
        opt = make()
        if isinstance(opt, FlexDeMo):  # buckets of as many shards as the node's buckets hold whole parameters
            opt.bucket_entries = max(1, FlexDeMo.bucket_entries // plan.n)

        def step(opt=opt):
            for p, grad in zip(params, grads):
                p.grad = grad
            opt.step()

        times[name] = time_steps(step, args.steps, args.repeats, sync) * 1e3
        del opt
    params.clear(), grads.clear(), matrices.clear(), others.clear()
    wholes = [torch.randn(shape, generator=g, device=device) for shape in plan.owned_matrices()]

    def newton_schulz_owned():
        for whole in wholes:
            scaled_newton_schulz(whole, ns_dtype)

    times["newton-schulz"] = time_steps(newton_schulz_owned, args.steps, args.repeats, sync) * 1e3
    wholes.clear()
    if device == "cuda":
        torch.cuda.empty_cache()
    if args.fwd_bwd:
        times["fwd+bwd"] = forward_backward_ms(args.model, args.batch, args.seq, args.repeats, device)
    return times


def node_of_main(args: argparse.Namespace) -> None:
    """``--node_of N``: the plan (``--dry_run``), or the timing of one rank's step (see the module doc)."""
    if "WORLD_SIZE" in os.environ:
        raise SystemExit("--node_of times one rank of a node on one GPU: run it with python, not torchrun.")
    if args.only or args.profile:
        raise SystemExit("--only and --profile apply to the whole-model mode; drop them with --node_of.")
    if args.device == "cpu" and not args.dry_run and args.model != "t5-small":
        raise SystemExit("--device cpu is a smoke test: use it with --model t5-small (or --dry_run); figures need CUDA")
    if args.device == "cuda" and not args.dry_run and not torch.cuda.is_available():
        raise SystemExit(
            "benchmarks/step/gpu_step.py needs a CUDA GPU; --dry_run prints the --node_of plan without one."
        )
    plan = node_shard_plan(build_model(args.model), args.node_of)
    if args.dry_run:  # no device: the dtype the rule takes on a GPU of compute capability 8.0 or newer
        ns_dtype = NS_DTYPES[args.ns_dtype or "bf16"]
        print("\n".join(describe_plan(args.model, plan, ns_dtype, verbose=True)))
        return
    ns_dtype = rule_ns_dtype(args.device, args.ns_dtype)
    times = node_rank_ms(args, plan, ns_dtype, args.device)
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (a smoke test, not a figure)"
    lines = describe_plan(args.model, plan, ns_dtype)
    lines[0] += f", bf16, {where}"
    default = times["pipeline"] + times["newton-schulz"]
    fwd_bwd = times.get("fwd+bwd")
    if fwd_bwd is not None:
        lines.append(
            f"  forward+backward of {args.batch} x {args.seq} tokens: {fwd_bwd:.1f} ms (the whole model on this "
            f"device, not sharded; FSDP2's gathers not timed)"
        )
    rows = [
        ("adamw (fused) on the shards (a rank of AdamW-FSDP)", times["adamw (fused)"]),
        ("flexdemo sign on the shards", times["flexdemo sign"]),
        ("flexdemo default rule less Newton-Schulz, on the shards", times["pipeline"]),
        ("Newton-Schulz of the whole matrices this rank owns", times["newton-schulz"]),
        (f"flexdemo default rule, one rank of {plan.n} (sum of the two above)", default),
    ]
    if "pipeline, triton" in times:
        rows += [
            ("flexdemo sign on the shards, kernels='triton'", times["flexdemo sign, triton"]),
            ("flexdemo default rule less Newton-Schulz, kernels='triton'", times["pipeline, triton"]),
            (
                f"flexdemo default rule, one rank of {plan.n}, kernels='triton'",
                times["pipeline, triton"] + times["newton-schulz"],
            ),
        ]
    for name, ms in rows:
        share = f"  {ms / fwd_bwd:6.1%} of fwd+bwd" if fwd_bwd else ""
        lines.append(f"  {name:66s} {ms:8.2f} ms{share}")
    if fwd_bwd:
        lines.append(f"  default rule / fwd+bwd: {default / fwd_bwd:.1%} (target: at most 10%)")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="olmo2-1b", choices=["t5-small", "olmo2-1b"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--topk", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--only", nargs="*", help="configurations to run (names as printed); fused AdamW always runs")
    parser.add_argument("--profile", action="store_true", help="one profiled step per FlexDeMo configuration")
    parser.add_argument("--fwd_bwd", action="store_true", help="also time the model's forward and backward")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--node_of", type=int, help="time one rank of a node of N GPUs (see the module doc)")
    parser.add_argument("--dry_run", action="store_true", help="with --node_of: print the plan, time nothing")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: --node_of smoke test only")
    parser.add_argument("--ns_dtype", choices=sorted(NS_DTYPES), help="with --node_of: default, the rule's own choice")
    args = parser.parse_args()
    if args.node_of is not None:
        node_of_main(args)
        return
    if args.dry_run or args.device != "cuda" or args.ns_dtype:
        raise SystemExit("--dry_run, --device and --ns_dtype apply to --node_of N.")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/step/gpu_step.py needs a CUDA GPU; on CPU run benchmarks/step/optimizer_step.py.")

    mesh = None
    if "WORLD_SIZE" in os.environ:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
        mesh = init_device_mesh("cuda", (dist.get_world_size(),), mesh_dim_names=("replicate",))
    replicas = mesh.size() if mesh is not None else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    shapes, vocab = model_shapes(args.model)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    bf16 = dict(generator=g, device=DEVICE, dtype=torch.bfloat16)
    params = [torch.nn.Parameter(torch.randn(s, **bf16) * 0.02) for s in shapes]
    grads = [torch.randn(s, **bf16) * 1e-3 for s in shapes]
    grad_bytes = sum(t.numel() * t.element_size() for t in grads)

    rows = []
    profiles: dict[str, str] = {}
    configs = {
        "adamw (fused)": None,
        "flexdemo demo": {"update": "sign"},
        "flexdemo demo bf16 values": {"value_dtype": "bf16", "update": "sign"},
        "flexdemo demo (default rule)": {},  # orthogonal; embeddings and head take adam, as the Trainer does
        "flexdemo demo, TF32 matmuls": {"update": "sign", "tf32": True},
        "flexdemo default rule, float32 NS": {"ns_dtype": "float32"},
        "flexdemo default rule, top 24 at 2 bits": {"topk": 24, "value_bits": 2, "pack_indices": True},
        "flexdemo demo, triton kernels": {"update": "sign", "kernels": "triton"},
        "flexdemo default rule, triton kernels": {"kernels": "triton"},
        "flexdemo top 24 at 2 bits, triton kernels": {
            "topk": 24,
            "value_bits": 2,
            "pack_indices": True,
            "kernels": "triton",
        },  # fmt: skip
    }
    if args.only:
        configs = {name: kwargs for name, kwargs in configs.items() if kwargs is None or name in args.only}
    for name, kwargs in configs.items():
        if kwargs is None:
            opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
        else:
            tables = [p for p in params if p.shape[0] == vocab]  # the embedding and the head
            # "tf32": not a FlexDeMo setting; torch's global switch, to see what TF32 DCTs would save.
            torch.backends.cuda.matmul.allow_tf32 = kwargs.pop("tf32", False)
            settings = {"topk": args.topk, "chunk": args.chunk} | kwargs
            opt = FlexDeMo(params, lr=1e-4, mesh=mesh, elementwise=tables, **settings)

        def step(opt=opt, adamw=kwargs is None):
            for p, grad in zip(params, grads):  # HSDP's all-reduce writes into the gradients: give it copies
                p.grad = grad.clone() if adamw and replicas > 1 else grad
            if adamw and replicas > 1:
                for p in params:  # HSDP's inter-node gradient all-reduce
                    dist.all_reduce(p.grad, group=mesh.get_group())
            opt.step()

        for p, grad in zip(params, grads):  # the previous configuration's gradients must not count as state
            p.grad = grad
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        step()  # creates the state
        torch.cuda.synchronize()
        state = torch.cuda.memory_allocated() - before
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before - state  # above the model, gradients and state
        seconds = time_steps(step, args.steps, args.repeats)
        profiles[name] = profile_step(step) if args.profile else ""
        if kwargs is None:
            sent = ring_all_reduce_bytes(grad_bytes, replicas) if replicas > 1 else 0
        else:
            sent = opt.total_stats.bytes_sent / (args.steps * (args.repeats + 1) + 2 + args.profile)
        rows.append((name, seconds, sent, state, peak))
        del opt
        torch.cuda.empty_cache()

    phases = phase_functions([grad.float() for grad in grads], args.chunk, args.topk)
    phase_ms = {name: median_ms(fn, args.repeats, torch.cuda.synchronize) for name, fn in phases.items()}
    params.clear(), grads.clear(), phases.clear()  # free the GPU for the model's own pass
    torch.cuda.empty_cache()
    fwd_bwd = forward_backward_ms(args.model, args.batch, args.seq, args.repeats) if args.fwd_bwd else None
    if rank == 0:
        device = torch.cuda.get_device_name()
        size = sum(s.numel() for s in shapes) / 1e6
        print(f"{args.model}: {size:.0f}M parameters, bf16, {replicas} replica(s), {device}")
        adamw = rows[0][1]
        if fwd_bwd is not None:
            print(f"  forward+backward of {args.batch} x {args.seq} tokens: {fwd_bwd:.1f} ms")
        for name, seconds, sent, state, peak in rows:
            ratio = seconds / adamw
            share = f" {seconds * 1e3 / fwd_bwd:5.1%} of fwd+bwd" if fwd_bwd else ""
            print(
                f"  {name:40s} step {seconds * 1e3:8.2f} ms ({ratio:5.2f}x AdamW){share} sent/step {sent / 1e6:8.2f} MB"
                f"   state {state / 2**30:5.2f} GiB, step peak +{peak / 2**30:5.2f} GiB ({peak / max(state, 1):4.0%})"
            )
            if profiles.get(name):
                print(f"      profile: {profiles[name]}")
        print("  DeMo phases (ms):", ", ".join(f"{k} {v:.2f}" for k, v in phase_ms.items()))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
