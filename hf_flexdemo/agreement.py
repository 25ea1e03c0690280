"""What every replica must share (settings, group hyperparameters, shapes), and the check that it does.

Replicas that differ in a setting that shapes the wire (``topk``, ``value_bits``, ``index_coding``...)
send buffers of different sizes, so the first collective hangs or fails far from the cause; replicas
that differ in ``lr`` or ``decay`` apply different steps and drift apart silently. On the first step,
before any exchange, the replicas compare one digest of their description, and only if the digests
differ do they exchange the descriptions, to name each difference.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist

from .config import GROUP_KEYS
from .topology import ReplicaTopology, gather_int64

LOCAL_SETTINGS = ("ft_timeout", "quorum_timeout", "replay_steps", "stall_wait")
"""Each node's own: they change nothing the others compute."""


def group_settings(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each parameter group's hyperparameters (a scheduler's ``lr`` included), tensors as plain numbers."""
    return [
        {key: group[key].tolist() if isinstance(group[key], torch.Tensor) else group[key] for key in GROUP_KEYS}
        for group in param_groups
    ]


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}, "c": [{"d": 2}]}`` -> ``{"a.b": 1, "c.0.d": 2}``, so that a difference is named to the
    setting."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        elif isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
            flat.update(flatten({str(i): item for i, item in enumerate(value)}, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def differences(ours: dict[str, Any], theirs: dict[str, Any], we: str, they: str) -> list[str]:
    """``"key: <they> has X, <we> Y"`` for each flattened entry that differs."""
    ours, theirs = flatten(ours), flatten(theirs)
    return [
        f"{key}: {they} has {_short(theirs.get(key))}, {we} {_short(ours.get(key))}"
        for key in sorted(set(ours) | set(theirs))
        if ours.get(key) != theirs.get(key)
    ]


def _short(value: Any, limit: int = 200) -> str:
    """``repr(value)``, cut in the middle if long (a large model's list of shapes)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit // 2]} ... {text[-limit // 2 :]}"


def digest(description: dict[str, Any]) -> int:
    """A signed 64-bit hash of the description's flattened entries (the same on every process for equal ones)."""
    text = repr(sorted((key, repr(value)) for key, value in flatten(description).items()))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


def check_replicas_agree(description: dict[str, Any], topology: ReplicaTopology) -> None:
    """Raise ``ValueError`` on every process of the replicate group if its replicas' descriptions differ.

    A collective: every replica calls it, before its first exchange.
    """
    if len(set(gather_int64(digest(description), topology))) == 1:
        return
    descriptions: list[Any] = [None] * topology.size
    dist.all_gather_object(descriptions, description, group=topology.group)
    found = [
        f"  {line}"
        for replica, theirs in enumerate(descriptions[1:], start=1)
        for line in differences(descriptions[0], theirs, "node 0", f"node {replica}")
    ]
    raise ValueError(
        "FlexDeMo: the nodes were launched with different settings, so they would send buffers of different "
        "sizes or apply different steps. Launch every node with the same optimizer settings (the same "
        "--optim_args, learning rate and schedule) and the same model. Differences:\n" + "\n".join(found)
    )
