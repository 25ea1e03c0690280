"""A step of OLMo2-1B on 2 nodes of 8 H100s, modelled: the compute of one rank measured on a node, plus the bytes a
node sends at the link's rate, not overlapped. ``time_to_loss.py`` (the short study's presets) and
``long_report.py`` (the long runs) scale their curves' steps with it."""

from __future__ import annotations

RATES = {"100 Mbit/s": 100e6, "1 Gbit/s": 1e9}
FORWARD_BACKWARD_MS = 220.0
"""One rank of a node of 8 H100s, OLMo2-1B, 4 x 2048 tokens (gpu_step.py --node_of 8, 2026-11-27)."""
STEP_MS = {"adamw": 1.58, "flexdemo": 41.19}
"""That rank's optimizer step: fused AdamW on its shards; the default rule (torch path, its Newton-Schulz share)."""


def step_seconds(rule: str, sent: float, rate: float) -> float:
    """A step of OLMo2-1B on one rank of a node of 8 H100s: the forward and backward, ``rule``'s optimizer step
    ('adamw' or 'flexdemo', :data:`STEP_MS`), and the ``sent`` bytes of a node at ``rate`` bit/s, not overlapped."""
    return (FORWARD_BACKWARD_MS + STEP_MS[rule]) / 1e3 + 8 * sent / rate
