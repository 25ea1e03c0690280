"""How much of its state a per-tile top-k sends: DeMo's momentum against SparseLoCo's error feedback, each picked
in the parameters' own domain and after each tile's DCT.

Issue 45: SparseLoCo every 4 steps with Muon inside ends 12 points above averaging the same replicas' parameters
every 4 steps (fine-tuning, 1 entry in 128 sent), and only its density moved it. This measures how much of the state
each wire selects from the top-k holds.

One replica fine-tunes the quality study's OLMo2 base model (1.6M parameters) on the fine-tuning preset's text
(Python's pydoc topics; training and evaluation text alike), as one node does in the study: 16 blocks a step drawn
at random, the Trainer's linear schedule with 5% warm-up, Muon's step (momentum 0.9, Nesterov, Newton-Schulz,
``sqrt(max(rows, cols))`` scale) on the 2-D matrices and AdamW on the rest. Beside it, for each 2-D matrix, shadow
states are fed by the same run, as each wire keeps them, and each sends its top ``--topk`` of every ``--chunk`` x
``--chunk`` tile and keeps the rest (values exact, no quantization):

- SparseLoCo's error feedback ``e = 0.9 e + delta`` every ``--inner_steps`` steps, ``delta`` the parameters' change
  since the last time;
- DeMo's momentum ``q = 0.999 q + lr g`` every step, ``g`` the gradient.

Each is kept once as it is (SparseLoCo picks there) and once in DCT coefficients (DeMo picks there). A Gaussian
tensor is the reference for "no structure". The shadows see the Muon run's gradients, not the trajectory DeMo or
SparseLoCo would take. Printed (and with ``--json`` written) as the share of the squared sum the top-k holds when it
is picked, summed over the matrices and the picks::

    .venv/bin/python benchmarks/probes/topk_energy.py \
        --base benchmarks/results/quality/quality_olmo2_ft_beyond_300x/base \
        --json benchmarks/results/probes/topk_energy_top32.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_flexdemo.compression import ChunkPlan, flat_positions, select_topk, to_coefficients
from hf_flexdemo.updates.orthogonal import scaled_newton_schulz

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "training_scripts"))
from offline_data import english_paragraphs  # noqa: E402


class Shadow:
    """One wire's state of one matrix, in the parameters' domain or in DCT coefficients: it sends its top-k of every
    tile and keeps the rest, and counts the energy it sent against the energy it held."""

    def __init__(self, like: torch.Tensor, chunk: int, topk: int, dct: bool):
        self.plan = ChunkPlan.for_shape(like.shape, chunk, topk)
        self.dct = dct
        self.state = torch.zeros(self.plan.rows, self.plan.cols)
        self.sent = self.held = 0.0

    def add(self, tensor: torch.Tensor, decay: float, scale: float = 1.0) -> None:
        x = tensor.detach().to(torch.float32).reshape(self.plan.rows, self.plan.cols)
        self.state.mul_(decay).add_(to_coefficients(x, self.plan) if self.dct else x, alpha=scale)

    def send(self) -> None:
        indices, values = select_topk(self.state, self.plan)
        self.sent += float(values.square().sum())
        self.held += float(self.state.square().sum())
        self.state.view(-1)[flat_positions(indices, self.plan)] = 0.0


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
    parser.add_argument("--json", type=Path, help="also write the shares here")
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
    wires = ("SparseLoCo's error feedback", "DeMo's momentum", "a Gaussian tensor")
    shadows = {
        (wire, dct): [Shadow(p, args.chunk, args.topk, dct) for p in matrices]
        for wire in wires
        for dct in (False, True)
    }
    warmup = max(args.steps // 20, 1)
    for step in range(args.steps):  # the Trainer's linear schedule: step i at i / warmup, then down to 0
        lr = args.lr * (step / warmup if step < warmup else (args.steps - step) / (args.steps - warmup))
        for group in adamw.param_groups:
            group["lr"] = lr
        batch = data[torch.randint(len(data), (args.batch,))]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        outer = (step + 1) % args.inner_steps == 0
        with torch.no_grad():
            for i, (p, m) in enumerate(zip(matrices, momenta, strict=True)):
                for dct in (False, True):
                    demo = shadows[wires[1], dct][i]
                    demo.add(p.grad, decay=0.999, scale=lr)
                    demo.send()
                m.lerp_(p.grad, 1 - beta)
                p.sub_(scaled_newton_schulz(p.grad.lerp(m, beta)), alpha=lr)
                if outer:
                    for dct in (False, True):
                        sparseloco, noise = shadows[wires[0], dct][i], shadows[wires[2], dct][i]
                        sparseloco.add(anchors[i] - p, decay=0.9)
                        sparseloco.send()
                        noise.add(torch.randn_like(p), decay=0.0)
                        noise.send()
                    anchors[i].copy_(p)
        adamw.step()
        model.zero_grad(set_to_none=True)
        if outer:
            print(f"step {step + 1}: loss {loss.item():.4f}", flush=True)
    shares = {
        wire: {domain: sum(s.sent for s in shadows[wire, dct]) / sum(s.held for s in shadows[wire, dct])
               for domain, dct in (("parameters", False), ("dct", True))}
        for wire in wires
    }  # fmt: skip
    print(f"\nshare of the energy in the top {args.topk} of every {args.chunk} x {args.chunk} tile when it is picked "
          f"({len(matrices)} matrices, {args.steps} steps, outer steps every {args.inner_steps}):")  # fmt: skip
    print("| state | parameters' domain | DCT |\n| --- | ---: | ---: |")
    for wire, share in shares.items():
        print(f"| {wire} | {share['parameters']:.1%} | {share['dct']:.1%} |")
    if args.json:
        args.json.write_text(json.dumps({"settings": vars(args) | {"base": str(args.base), "json": None},
                                         "shares": shares}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
