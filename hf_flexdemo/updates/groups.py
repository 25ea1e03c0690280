"""Which parameters the orthogonal rule leaves to the element-wise rule, and the groups that say so."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

HEAD_NAMES = ("lm_head", "classifier", "score")
"""Attributes under which models keep their output head (transformers' conventions)."""


def elementwise_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Embedding tables and output heads: matrices that orthogonalizing would hurt (the element-wise rule's).

    An embedding row moves only when its token occurs, and a head's rows are per class: neither
    is a linear map whose singular values mean anything (Muon leaves them to an element-wise rule).
    """
    heads = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    output = getattr(model, "get_output_embeddings", lambda: None)()
    heads += [output] if isinstance(output, torch.nn.Module) else []
    heads += [getattr(model, name) for name in HEAD_NAMES if isinstance(getattr(model, name, None), torch.nn.Linear)]
    unique = {id(p): p for module in heads for p in module.parameters()}
    return list(unique.values())


def with_elementwise_groups(params, elementwise: Iterable[torch.Tensor], update: str = "sign") -> list[dict[str, Any]]:
    """Parameter groups with the ``elementwise`` parameters moved to groups of their own with rule ``update``."""
    groups = list(params)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    marked = {id(p) for p in elementwise}
    if not marked:
        return groups
    split = []
    for group in groups:
        params = list(group["params"])
        split.append({**group, "params": [p for p in params if id(p) not in marked]})
        split.append({**group, "params": [p for p in params if id(p) in marked], "update": update})
    return [group for group in split if group["params"]]
