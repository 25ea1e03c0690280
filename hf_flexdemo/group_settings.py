"""The hyperparameters a parameter group may hold, the update rules, and the checks of single values.

:mod:`hf_flexdemo.config` checks how the settings combine; the checks here take one value (or one group's
values) and raise ValueError naming the setting, the value and what is allowed.
"""

from __future__ import annotations

import math
from typing import Any

from .scheme_traits import schemes_where, traits_of

UPDATE_RULES = ("sign", "adam", "orthogonal")
"""How the decoded update becomes a parameter step (:mod:`hf_flexdemo.updates`)."""
DEFAULT_UPDATE = "orthogonal"
"""The rule where it applies: it won against AdamW-HSDP on every preset of the quality study (BENCHMARKS.md)."""
ELEMENTWISE_UPDATE = "adam"
"""The rule of what update='orthogonal' does not orthogonalize (norms, biases, embeddings, heads), as Muon's."""

GROUP_KEYS = ("lr", "weight_decay", "decay", "topk", "chunk", "sign", "update", "betas", "eps")
"""Hyperparameters that may differ between parameter groups; the rest hold for the whole optimizer."""

DEFAULT_DECAY = 0.999
"""``decay`` when it is not given (DeMo's)."""


def default_update(scheme: str, sign: bool = True) -> str:
    """The rule ``update=None`` stands for: ``orthogonal`` where a rule applies, else ``sign``.

    ``random`` and ``striding`` send a scattered subset, which no rule but ``sign`` can take; DiLoCo and
    SparseLoCo move parameters by their own outer step and take AdamW's inner step unless ``update='orthogonal'``
    (``sign`` stands for that AdamW here); ``sign=False`` is a variant of the sign rule (the decoded update as it
    is), so it keeps that rule.
    """
    traits = traits_of(scheme)
    if traits.subset or traits.outer_steps or not sign:
        return "sign"
    return DEFAULT_UPDATE


def decay_ignored(decay: Any, scheme: str, where: str = "") -> str:
    """The refusal of ``decay`` (``where``: in a parameter group) on a scheme that would ignore it."""
    return (
        f"FlexDeMo: decay={decay!r}{where} is the momentum decay of the per-step schemes "
        f"{schemes_where('per_step')}; scheme={scheme!r} would ignore it: its inner step's momentum is betas[0] "
        "(--adam_beta1), and outer_momentum is its outer step's momentum (diloco) or its error feedback's decay "
        "(sparseloco). Drop decay, and set betas or outer_momentum (for the whole optimizer) instead."
    )


def validate_group(group: dict[str, Any], scheme: str, elementwise_update: str = "sign") -> None:
    """Check the per-group hyperparameters; raises ValueError naming the setting, value and range.

    ``betas`` and ``eps`` belong to the inner AdamW of DiLoCo and SparseLoCo and to ``update='adam'``: others
    do not use them, so the Trainer's ``--adam_beta2 1.0`` (say) is no error there.
    """
    check_float("lr", group["lr"], low=0.0)
    check_float("weight_decay", group["weight_decay"], low=0.0)
    check_float("decay", group["decay"], low=0.0, high=1.0, high_open=True)
    check_int("chunk", group["chunk"], low=1)
    check_int("topk", group["topk"], low=1, high=group["chunk"] ** 2, why=" (at most chunk * chunk, a full tile)")
    check_bool("sign", group["sign"])
    update = group.get("update", "sign")
    check_choice("update", update, UPDATE_RULES)
    # Outer-step schemes with update='orthogonal': the groups of embeddings and heads take the inner AdamW.
    elementwise_group = traits_of(scheme).outer_steps and update == elementwise_update == "adam"
    if update != "sign" and not elementwise_group:
        _check_update_rule(update, group["sign"], scheme)
    uses_adam = update == "adam" or (update == "orthogonal" and elementwise_update == "adam")
    if not traits_of(scheme).outer_steps and not uses_adam:
        return
    betas = group["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"FlexDeMo: betas={betas!r} is invalid; betas must be a pair (beta1, beta2).")
    for i, beta in enumerate(betas):
        check_float(f"betas[{i}]", beta, low=0.0, high=1.0, high_open=True)
    check_float("eps", group["eps"], low=0.0, low_open=True)


def _check_update_rule(update: str, sign: bool, scheme: str) -> None:
    traits = traits_of(scheme)
    if traits.outer_steps and update != "orthogonal":
        raise ValueError(
            f"FlexDeMo: update={update!r} applies to the per-step schemes {schemes_where('per_step')}, not to "
            f"scheme={scheme!r}, whose inner step is AdamW and whose outer step is its own rule; leave update unset "
            "(inner AdamW), or set update='orthogonal' for Muon's inner step on the matrices."
        )
    if not sign:
        raise ValueError(
            f"FlexDeMo: sign=False applies to update='sign' (it applies the decoded update as it is), not to "
            f"update={update!r}; drop sign=False."
        )
    if traits.subset:
        raise ValueError(
            f"FlexDeMo: update={update!r} needs every entry's update at every replication (orthogonal: whole "
            f"matrices; adam: one bias-corrected second moment), but scheme={scheme!r} sends a scattered subset; use "
            f"scheme='demo' or 'full' with update={update!r}, or update='sign' with {scheme}."
        )


def check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"FlexDeMo: {name}={value!r} is invalid; {name} must be one of {allowed}.")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"FlexDeMo: {name}={value!r} is invalid; {name} must be True or False.")


def check_int(name: str, value: Any, low: int, high: int | None = None, why: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"FlexDeMo: {name}={value!r} is invalid; {name} must be an integer.")
    if value < low or (high is not None and value > high):
        allowed = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"FlexDeMo: {name}={value} is invalid; {name} must be an integer {allowed}{why}.")


def check_float(
    name: str,
    value: Any,
    low: float,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"FlexDeMo: {name}={value!r} is invalid; {name} must be a number.")
    bad_low = value <= low if low_open else value < low
    bad_high = high is not None and (value >= high if high_open else value > high)
    if bad_low or bad_high:
        lo = f"{'(' if low_open else '['}{low}"
        hi = f"{high}{')' if high_open else ']'}" if high is not None else "inf)"
        raise ValueError(f"FlexDeMo: {name}={value} is invalid; {name} must be in {lo}, {hi}.")
