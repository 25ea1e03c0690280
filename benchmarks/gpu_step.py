"""FlexDeMo's optimizer step on a GPU: bf16, NCCL, T5-small and OLMo2-1B shapes, against AdamW.

    # one GPU: the step's compute, phase by phase
    python benchmarks/gpu_step.py --model olmo2-1b
    # one process per GPU, each a replica (NCCL): adds the real exchange and AdamW-HSDP's all-reduce
    torchrun --standalone --nproc-per-node 8 benchmarks/gpu_step.py --model olmo2-1b

Parameters and gradients are bf16 on the GPU (FlexDeMo keeps its momentum in float32).
Times are medians over ``--repeats`` runs of ``--steps`` steps after one warm-up run,
with ``torch.cuda.synchronize()`` around each run. Phases are DeMo's update over the
same shapes (DCT, top-k, error feedback, decode, inverse DCT, signed update), in ms.
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


def model_shapes(name: str) -> tuple[list[torch.Size], int]:
    """Parameter shapes of the named model, built on the meta device (no weights, no download), and its vocabulary."""
    from transformers import Olmo2Config, Olmo2ForCausalLM, T5Config, T5ForConditionalGeneration

    with torch.device("meta"):
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
    return [p.shape for p in model.parameters()], model.config.vocab_size


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
    g = torch.Generator(device="cuda").manual_seed(0)
    bf16 = dict(generator=g, device="cuda", dtype=torch.bfloat16)
    params = [torch.nn.Parameter(torch.randn(s, **bf16) * 0.02) for s in shapes]
    grads = [torch.randn(s, **bf16) * 1e-3 for s in shapes]
    grad_bytes = sum(t.numel() * t.element_size() for t in grads)

    rows = []
    configs = {
        "adamw (fused)": None,
        "flexdemo demo": {"update": "sign"},
        "flexdemo demo bf16 values": {"value_dtype": "bf16", "update": "sign"},
        "flexdemo demo (default rule)": {},  # orthogonal; embeddings and head take adam, as the Trainer does
        "flexdemo default rule, float32 NS": {"ns_dtype": "float32"},
        "flexdemo default rule, top 24 at 2 bits": {"topk": 24, "value_bits": 2, "pack_indices": True},
    }
    for name, kwargs in configs.items():
        if kwargs is None:
            opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
        else:
            tables = [p for p in params if p.shape[0] == vocab]  # the embedding and the head
            opt = FlexDeMo(params, lr=1e-4, topk=args.topk, chunk=args.chunk, mesh=mesh, elementwise=tables, **kwargs)

        def step(opt=opt, adamw=kwargs is None):
            for p, grad in zip(params, grads):
                p.grad = grad.clone() if adamw else grad
            if adamw and replicas > 1:
                for p in params:  # HSDP's inter-node gradient all-reduce
                    dist.all_reduce(p.grad, group=mesh.get_group())
            opt.step()

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
        if kwargs is None:
            sent = ring_all_reduce_bytes(grad_bytes, replicas) if replicas > 1 else 0
        else:
            sent = opt.total_stats.bytes_sent / (args.steps * (args.repeats + 1) + 2)
        rows.append((name, seconds, sent, state, peak))
        del opt
        torch.cuda.empty_cache()

    phases = phase_functions([grad.float() for grad in grads], args.chunk, args.topk)
    phase_ms = {name: median_ms(fn, args.repeats, torch.cuda.synchronize) for name, fn in phases.items()}
    if rank == 0:
        device = torch.cuda.get_device_name()
        size = sum(s.numel() for s in shapes) / 1e6
        print(f"{args.model}: {size:.0f}M parameters, bf16, {replicas} replica(s), {device}")
        adamw = rows[0][1]
        for name, seconds, sent, state, peak in rows:
            ratio = seconds / adamw
            print(
                f"  {name:40s} step {seconds * 1e3:8.2f} ms ({ratio:5.2f}x AdamW)   sent/step {sent / 1e6:9.2f} MB"
                f"   state {state / 2**30:5.2f} GiB, step peak +{peak / 2**30:5.2f} GiB ({peak / max(state, 1):4.0%})"
            )
        print("  DeMo phases (ms):", ", ".join(f"{k} {v:.2f}" for k, v in phase_ms.items()))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
