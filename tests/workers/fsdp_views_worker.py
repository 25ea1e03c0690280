"""Gradients of models whose FSDP2 blocks return view tensors, against the same model unwrapped.

Launched by tests/test_fsdp_views.py with `accelerate launch` (1 node x 2 processes); argv[1] is
the folder for result_rank<N>.json. Each case runs one forward and backward on the same batch
on every rank (FSDP's average over the node is then the one-batch gradient) and records the
largest difference from the unwrapped model's gradients, and torch's view-tensor warnings.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.nn as nn
from accelerate import Accelerator
from torch.distributed.tensor import DTensor
from transformers import T5Config, T5ForConditionalGeneration

from hf_flexdemo import FlexDeMo

VIEW_WARNING = "returned a view tensor"


class ViewBlock(nn.Module):
    """Returns a view of its output, as T5's first block returns its position bias."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x).unsqueeze(0)


class InPlaceAfterBlocks(nn.Module):
    """Adds to each block's output in place (``out += y``): the op that loses FSDP2's hook on a view."""

    _no_split_modules = ["ViewBlock"]

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(ViewBlock() for _ in range(3))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        for block in self.blocks:
            h = block(x)
            h += 1.0
            x = torch.tanh(h.squeeze(0))
        return self.head(x).pow(2).mean()


def t5_case():
    config = T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    batch = dict(input_ids=torch.randint(2, 64, (4, 12), generator=g), labels=torch.randint(2, 64, (4, 7), generator=g))
    return T5ForConditionalGeneration(config), lambda model: model(**batch).loss


def in_place_case():
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(2))
    return InPlaceAfterBlocks(), lambda model: model(x)


def gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is not None:
            out[name] = grad.full_tensor() if isinstance(grad, DTensor) else grad
    return out


def run_case(accelerator: Accelerator, build) -> dict:
    torch.manual_seed(0)
    model, loss_of = build()
    reference = copy.deepcopy(model)
    loss_of(reference).backward()
    expected = gradients(reference)
    result = {"error": None, "max_diff": None, "compared": 0, "view_warnings": 0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model, _ = accelerator.prepare(model, FlexDeMo(model.parameters(), lr=0.0))
            loss_of(model).backward()
            got = gradients(model)
            result["missing"] = sorted(set(expected) - set(got))
            diffs = [(got[n] - expected[n]).abs().max().item() for n in expected if n in got]
            result["compared"], result["max_diff"] = len(diffs), max(diffs)
        except Exception as error:  # before clone_view_outputs, backward could fail here
            result["error"] = f"{type(error).__name__}: {error}"
    result["view_warnings"] = sum(VIEW_WARNING in str(w.message) for w in caught)
    accelerator.state.fsdp_plugin.transformer_cls_names_to_wrap = None  # the next model's blocks are its own
    return result


def main() -> None:
    out = Path(sys.argv[1])
    accelerator = Accelerator()
    results = {"t5": run_case(accelerator, t5_case), "in_place": run_case(accelerator, in_place_case)}
    (out / f"result_rank{os.environ['RANK']}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
