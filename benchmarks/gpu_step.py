"""FlexDeMo's optimizer step on a GPU: bf16, NCCL, T5-small and OLMo2-1B shapes, against AdamW.

    # one GPU: the step's compute, phase by phase
    python benchmarks/gpu_step.py --model olmo2-1b
    # one process per GPU, each a replica (NCCL): adds the real exchange and AdamW-HSDP's all-reduce
    torchrun --standalone --nproc-per-node 8 benchmarks/gpu_step.py --model olmo2-1b

Parameters and gradients are bf16 on the GPU (FlexDeMo keeps its momentum in float32).
Times are medians over ``--repeats`` runs of ``--steps`` steps after one warm-up run,
with ``torch.cuda.synchronize()`` around each run. Phases are DeMo's update over the
same shapes (DCT, top-k, error feedback, decode, inverse DCT, signed update), in ms.
``--profile`` adds, per FlexDeMo configuration, one step under ``torch.profiler``: CUDA kernels
launched, the host's time in the step and the GPU's busy time, and the five costliest kernels.
``--fwd_bwd`` times the model's own forward and backward (random weights, bf16, batch
``--batch`` x ``--seq`` tokens), the denominator of "share of a training step".
Refuses to run without CUDA: CPU figures are `optimizer_step.py` and `demo_phases.py`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from demo_phases import median_ms, phase_functions
from torch.distributed.device_mesh import init_device_mesh

from hf_flexdemo import FlexDeMo
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


def forward_backward_ms(name: str, batch: int, seq: int, repeats: int) -> float:
    """Median ms of one forward and backward of the model in bf16 on ``batch`` x ``seq`` random tokens."""
    model = build_model(name, DEVICE).to(torch.bfloat16)
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq), device=DEVICE)
    extra = {"decoder_input_ids": tokens} if model.config.is_encoder_decoder else {}

    def once():
        model(input_ids=tokens, labels=tokens, **extra).loss.backward()
        model.zero_grad(set_to_none=True)

    return median_ms(once, repeats, torch.cuda.synchronize)


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


def time_steps(step, steps: int, repeats: int) -> float:
    for _ in range(steps):
        step()
    times = []
    for _ in range(repeats):
        if dist.is_initialized():
            dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / steps)
    return statistics.median(times)


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
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_step.py needs a CUDA GPU; on CPU run benchmarks/optimizer_step.py.")

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
