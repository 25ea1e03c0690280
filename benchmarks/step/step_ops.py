"""Operations per FlexDeMo step on OLMo2's layout, counted on CPU: on a GPU each is a kernel launch.

    # OLMo2-1B's 16 layers at a small width (the count does not depend on the width)
    python benchmarks/step/step_ops.py
    python benchmarks/step/step_ops.py --layers 16 --hidden 128 --configs sign default

A step is profiled with ``torch.profiler`` after two warm-up steps. Counted:

- ``leaf ops``: aten operations with no aten operation beneath them. A ``_foreach_*`` operation
  counts once: on CUDA it is one multi-tensor kernel, while its CPU fallback calls a kernel per
  tensor underneath. So does a batched matrix product (``bmm``, ``baddbmm``): one kernel on CUDA,
  while torch's CPU kernel loops over the batch where the CPU has no fast path for the dtype (bf16
  on a CPU with AVX2 only), so the count does not depend on the CPU;
- ``launches``: operations that run a kernel: not views or other metadata-only operations, and with
  no such operation beneath them (a ``bmm`` whose only children resolve its operands' conjugation);
- ``host syncs``: operations that copy a device value to the host (``item``, ``nonzero``, ...).

The counting functions are what ``tests/test_step_ops.py`` asserts on.
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from hf_flexdemo import FlexDeMo

METADATA_OPS = frozenset(
    {
        "aten::view",
        "aten::_unsafe_view",
        "aten::reshape",
        "aten::as_strided",
        "aten::select",
        "aten::slice",
        "aten::narrow",
        "aten::unsqueeze",
        "aten::squeeze",
        "aten::transpose",
        "aten::t",
        "aten::permute",
        "aten::expand",
        "aten::alias",
        "aten::detach",
        "aten::unbind",
        "aten::split",
        "aten::split_with_sizes",
        "aten::chunk",
        "aten::empty",
        "aten::empty_strided",
        "aten::resize_",
        "aten::lift_fresh",
        "aten::result_type",
        "aten::is_nonzero",
        "aten::mT",
        "aten::view_as",
        "aten::flatten",
        "aten::unflatten",
        "aten::movedim",
        "aten::numpy_T",
        "aten::_reshape_alias",
        "aten::resolve_conj",
        "aten::resolve_neg",
        "aten::to",
    }
)
"""Operations that only make a new view or an uninitialised buffer: no kernel runs on a GPU (a ``to``
that converts does its work in a ``copy_`` beneath it, which counts)."""

ONE_KERNEL_OPS = ("aten::_foreach_", "aten::bmm", "aten::baddbmm")
"""Operations (name prefixes) that are one kernel on a GPU whatever their CPU kernel calls beneath them."""

HOST_SYNC_OPS = frozenset({"aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::equal"})
"""Operations that wait for the device and copy a value to the host."""

CONFIGS: dict[str, dict] = {
    "sign": {"update": "sign"},
    "default": {},  # orthogonal, adam for the rest; the embedding and head take adam (as the Trainer passes them)
    "default top24 2-bit": {"topk": 24, "value_bits": 2, "pack_indices": True},
}


def olmo2_shapes(layers: int, hidden: int, vocab: int = 1024) -> tuple[list[torch.Size], int]:
    """OLMo2's parameter layout (OLMo-2-0425-1B: 16 layers, MLP 4x, untied head) at another width."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    config = Olmo2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=0,
    )
    with torch.device("meta"):
        model = Olmo2ForCausalLM(config)
    return [p.shape for p in model.parameters()], vocab


def step_op_counts(run: Callable[[], None]) -> dict[str, Counter]:
    """The aten operations of one call of ``run``, by name: ``leaf`` and ``launch`` ones (see the module doc).

    A ``launch`` is an operation that is not metadata-only and has no such operation beneath it. A
    ``_foreach_*`` or a batched matrix product (:data:`ONE_KERNEL_OPS`) is one of each.
    """
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    events = [e for e in prof.events() if e.name.startswith("aten::")]

    def under_one_kernel(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith(ONE_KERNEL_OPS):
                return True
            parent = parent.cpu_parent
        return False

    counted = [e for e in events if not under_one_kernel(e)]
    parents = {id(e.cpu_parent) for e in counted if e.cpu_parent is not None}
    working_parents = {id(e.cpu_parent) for e in counted if e.cpu_parent is not None and e.name not in METADATA_OPS}
    leaf: Counter = Counter()
    launch: Counter = Counter()
    for event in counted:
        one_kernel = event.name.startswith(ONE_KERNEL_OPS)
        if one_kernel or id(event) not in parents:
            leaf[event.name] += 1
        if one_kernel or (event.name not in METADATA_OPS and id(event) not in working_parents):
            launch[event.name] += 1
    return {"leaf": leaf, "launch": launch}


def summarize(counts: dict[str, Counter]) -> dict[str, int]:
    return {
        "leaf ops": sum(counts["leaf"].values()),
        "launches": sum(counts["launch"].values()),
        "host syncs": sum(n for name, n in counts["leaf"].items() if name in HOST_SYNC_OPS),
    }


def random_parameters(
    shapes: list[torch.Size], generator: torch.Generator, dtype: torch.dtype = torch.float32
) -> list[torch.nn.Parameter]:
    """Parameters of ``shapes`` in ``dtype``, drawn from ``generator`` (the benchmarks' model, without its modules)."""
    return [torch.nn.Parameter((torch.randn(s, generator=generator) * 0.02).to(dtype)) for s in shapes]


def random_grads(params: list[torch.Tensor], generator: torch.Generator) -> list[torch.Tensor]:
    """Gradients for ``params``, of their dtype, drawn from ``generator``."""
    return [(torch.randn(p.shape, generator=generator) * 1e-3).to(p.dtype) for p in params]


def flexdemo_optimizer(params: list[torch.nn.Parameter], vocab: int, kwargs: dict) -> FlexDeMo:
    """FlexDeMo over OLMo2's ``params`` as the Trainer builds it: the embedding and head element-wise.

    They are the first and last parameters (``elementwise_parameters`` of the model picks those): not every
    tensor of ``vocab`` rows, since at width ``vocab / 4`` the MLP's gate and up projections have as many.
    """
    tables = [params[0], params[-1]]
    assert all(p.shape[0] == vocab for p in tables), [p.shape for p in tables]
    return FlexDeMo(params, lr=1e-3, weight_decay=0.01, elementwise=tables, **kwargs)


def flexdemo_step_counts(shapes: list[torch.Size], vocab: int, kwargs: dict, seed: int = 0) -> dict[str, Counter]:
    """The operations of FlexDeMo's third step (one process) on parameters of ``shapes``."""
    g = torch.Generator().manual_seed(seed)
    params = random_parameters(shapes, g)
    grads = random_grads(params, g)
    opt = flexdemo_optimizer(params, vocab, kwargs)

    def step():
        for p, grad in zip(params, grads):
            p.grad = grad
        opt.step()

    step()
    step()
    return step_op_counts(step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--top", type=int, default=0, help="also list the N most frequent launches")
    args = parser.parse_args()
    shapes, vocab = olmo2_shapes(args.layers, args.hidden)
    print(f"OLMo2 layout: {args.layers} layers, width {args.hidden}, {len(shapes)} tensors, one process")
    for name in args.configs:
        counts = flexdemo_step_counts(shapes, vocab, CONFIGS[name])
        figures = summarize(counts)
        print(f"  {name:22s} " + "   ".join(f"{k} {v:6d}" for k, v in figures.items()))
        for op, n in counts["launch"].most_common(args.top):
            print(f"      {n:6d} {op}")


if __name__ == "__main__":
    main()
