"""How much of a tensor's energy a per-tile top-k keeps: the momentum DeMo's wire sends, against the pseudo-gradient
SparseLoCo's sends, each in the parameters' own domain and in the DCT's.

Issue 45: SparseLoCo every 4 steps with Muon inside ends 12 points above averaging the same replicas' parameters
every 4 steps (fine-tuning, 1 in 128 entries sent), and only density moved it. The reading to check: a pseudo-gradient
made of orthogonalized steps spreads its energy over the entries, so a top-k keeps little of it, while the momentum
before orthogonalizing keeps more in few coefficients.

One replica fine-tunes the quality study's OLMo2 base model (1.6M parameters) on the fine-tuning preset's text
(Python's pydoc topics), as one node does in the study: 16 blocks a step, the Trainer's linear schedule with 5%
warm-up, Muon's step (momentum ``betas[0]``, Nesterov, Newton-Schulz, ``sqrt(max(rows, cols))`` scale) on the 2-D
matrices, AdamW on the rest. Every ``--inner_steps`` steps it measures each matrix's pseudo-gradient (its change
over those steps) and its Muon momentum; for each, the share of the squared sum that the top ``--topk`` of every
``--chunk`` x ``--chunk`` tile holds, taken directly (SparseLoCo's selection) and after each tile's DCT (DeMo's).
A Gaussian tensor is the reference for "no structure". Printed as the energy-weighted share over all matrices and
measurements::

    .venv/bin/python benchmarks/probes/topk_energy.py \
        --base benchmarks/results/quality/quality_olmo2_ft_issue45/base
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_flexdemo.compression import ChunkPlan, select_topk, to_coefficients
from hf_flexdemo.updates.orthogonal import scaled_newton_schulz

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "training_scripts"))
from offline_data import english_paragraphs  # noqa: E402


def kept_share(tensor: torch.Tensor, chunk: int, topk: int, dct: bool) -> tuple[float, float]:
    """(energy the per-tile top-k keeps, all the energy) of a 2-D ``tensor``."""
    plan = ChunkPlan.for_shape(tensor.shape, chunk, topk)
    x = tensor.detach().to(torch.float32).reshape(plan.rows, plan.cols)
    coefficients = to_coefficients(x, plan) if dct else x
    _, values = select_topk(coefficients, plan)
    return float(values.square().sum()), float(coefficients.square().sum())


def blocks(tokenizer, block_size: int) -> torch.Tensor:
    """The offline text as one stream of ``block_size``-token rows."""
    ids = [t for text in english_paragraphs() for t in tokenizer(text)["input_ids"]]
    usable = len(ids) // block_size * block_size
    return torch.tensor(ids[:usable]).view(-1, block_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="a saved OLMo2 model and its tokenizer")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--inner_steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1.6e-2, help="the outer steps' best rate on fine-tuning")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--topk", type=int, default=32)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.base)
    data = blocks(AutoTokenizer.from_pretrained(args.base), args.block_size)
    matrices = [p for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n and "lm_head" not in n]
    others = [p for p in model.parameters() if all(p is not m for m in matrices)]
    adamw = torch.optim.AdamW(others, lr=args.lr, weight_decay=0.0)
    momenta = [torch.zeros_like(p) for p in matrices]
    beta = 0.9  # Muon's momentum, betas[0] of the quality study's runs
    anchors = [p.detach().clone() for p in matrices]
    totals = {name: [0.0, 0.0] for name in ("pseudo-gradient", "momentum", "gaussian")}
    totals_dct = {name: [0.0, 0.0] for name in totals}
    warmup = max(args.steps // 20, 1)
    for step in range(1, args.steps + 1):
        lr = args.lr * min(step / warmup, (args.steps - step + 1) / (args.steps - warmup + 1))
        for group in adamw.param_groups:
            group["lr"] = lr
        batch = data[torch.randint(len(data), (args.batch,))]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        with torch.no_grad():
            for p, m in zip(matrices, momenta, strict=True):
                m.lerp_(p.grad, 1 - beta)
                p.sub_(scaled_newton_schulz(p.grad.lerp(m, beta)), alpha=lr)
        adamw.step()
        model.zero_grad(set_to_none=True)
        if step % args.inner_steps:
            continue
        for p, m, anchor in zip(matrices, momenta, anchors, strict=True):
            samples = {"pseudo-gradient": anchor - p.detach(), "momentum": m, "gaussian": torch.randn_like(m)}
            for name, tensor in samples.items():
                for table, dct in ((totals, False), (totals_dct, True)):
                    kept, whole = kept_share(tensor, args.chunk, args.topk, dct)
                    table[name][0] += kept
                    table[name][1] += whole
            anchor.copy_(p.detach())
        print(f"step {step}: loss {loss.item():.4f}", flush=True)
    print(f"\nshare of the energy in the top {args.topk} of every {args.chunk} x {args.chunk} tile "
          f"({len(matrices)} matrices, every {args.inner_steps} steps of {args.steps}):")  # fmt: skip
    print("| tensor | parameters' domain | DCT |\n| --- | ---: | ---: |")
    for name in totals:
        direct, dct = (table[name][0] / table[name][1] for table in (totals, totals_dct))
        print(f"| {name} | {direct:.1%} | {dct:.1%} |")


if __name__ == "__main__":
    main()
