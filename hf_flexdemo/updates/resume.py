"""A resumed run keeps the update rules its checkpoint was trained with (DiLoCo and SparseLoCo: its inner step).

torch's ``load_state_dict`` restores the saved groups' ``update`` silently, and a rule's state
(adam's second moment) means nothing to another rule: a mismatch is refused, naming what to write.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..removed import removed_reason
from .adam import SECOND_MOMENT, AdamRule

ELEMENTWISE_SIGN = "the sign rule on what update='orthogonal' does not orthogonalize (elementwise_update='sign')"


def check_saved_rules(saved_groups: list[dict[str, Any]], param_groups: list[dict[str, Any]]) -> None:
    """A resumed run keeps the update rule it was trained with: torch would silently restore the saved one."""
    # Checkpoints from before the setting took sign steps.
    saved_rules = [saved.get("update", "sign") for saved in saved_groups]
    if len(saved_groups) != len(param_groups):
        raise ValueError(
            f"FlexDeMo: the checkpoint holds {len(saved_groups)} parameter groups trained with "
            f"update={_rules(saved_rules)}, but this run has {len(param_groups)} with "
            f"update={_rules([g['update'] for g in param_groups])}; update='orthogonal' (the default on "
            "demo, full and none) puts embeddings and heads in groups of their own. Resume with the update the "
            f"checkpoint was trained with{_resume_hint(saved_rules)}, or start a new run in another output_dir."
        )
    for was, group in zip(saved_rules, param_groups):
        if was != group["update"]:
            if "orthogonal" in saved_rules and was == "sign":  # its embeddings and heads took the sign rule
                raise ValueError(_removed_elementwise_sign())
            raise ValueError(
                f"FlexDeMo: the checkpoint trained a group of {len(group['params'])} parameters with "
                f"update={was!r}, but this run sets update={group['update']!r}; its state would not match. "
                f"Resume with update={was!r} (optim_args), or start a new run in another output_dir."
            )


def _removed_elementwise_sign() -> str:
    return (
        f"FlexDeMo: the checkpoint was trained with {ELEMENTWISE_SIGN}, which this version cannot resume. "
        f"elementwise_update was removed: {removed_reason('elementwise_update')} Resume it with that commit's "
        "code, or start a new run in another output_dir."
    )


def check_saved_elementwise_rule(state_dict: dict[str, Any], param_groups: list[dict[str, Any]]) -> None:
    """Norms and biases share the orthogonal groups: their saved state tells which rule moved them (adam now)."""
    saved = [
        state_dict["state"][pid]
        for group, mine in zip(state_dict["param_groups"], param_groups)
        if group.get("update") == "orthogonal"
        for pid, param in zip(group["params"], mine["params"])
        if param.dim() != 2 and state_dict["state"].get(pid)  # matrices keep no element-wise state
    ]
    kept = {key for state in saved for key in state} & set(AdamRule.state_keys)
    if saved and any("step" in state for state in saved) and not kept:
        raise ValueError(_removed_elementwise_sign())


def check_saved_state_keys(keys: Iterable[str], update: str, where: str) -> None:
    """Before a sharded (distributed-checkpoint) resume, from the keys the checkpoint's metadata lists.

    torch's loader asks the checkpoint for the state this run's rules create: a missing adam state
    fails as a raw ``Missing key`` deep in the load, and adam state the run does not ask for is dropped
    silently. Both are refused here, before training, with what to write.
    """
    keys = [key for key in keys if ".state." in key]
    if not keys:  # saved before the first step: no rule's state yet
        return
    saved = any(key.endswith(f".{SECOND_MOMENT}") for key in keys)
    if saved == (update in ("adam", "orthogonal")):  # orthogonal: adam on what it does not orthogonalize
        return
    if update == "orthogonal":  # no adam state: the sign rule beside Newton-Schulz, or update='sign'
        raise ValueError(
            f"FlexDeMo: the checkpoint {where} keeps no adam state: it was trained with update='sign', or with "
            f"{ELEMENTWISE_SIGN}. Resume with update=sign in optim_args if it was the first; the second was removed: "
            f"{removed_reason('elementwise_update')}"
        )
    run = f"update={update!r}"
    if saved:
        was = "the adam rule (update='adam', or 'orthogonal')"
        write = "update=adam, or update=orthogonal (the default: drop update)"
    else:
        was, write = "no adam state (update='sign')", "update=sign"
    raise ValueError(
        f"FlexDeMo: the checkpoint {where} was trained with {was}, but this run sets {run}; its state would not "
        f"match. Resume with {write} in optim_args, as the checkpoint was trained, or start a new run in another "
        "output_dir."
    )


def _rules(rules: list[str]) -> str:
    """``'sign'``, or ``'orthogonal'/'adam'`` for groups of several rules."""
    return "/".join(repr(rule) for rule in dict.fromkeys(rules))


def _resume_hint(saved_rules: list[str]) -> str:
    """What to write for a checkpoint of one rule (those of several name theirs in the message)."""
    return f" (update={saved_rules[0]!r} in optim_args)" if len(set(saved_rules)) == 1 else ""


def check_saved_inner_step(metadata: Mapping[str, Any], update: str, where: str) -> None:
    """Outer-step schemes, before a sharded resume: AdamW's inner step keeps a second moment (``exp_avg_sq``) for
    every tensor, Muon's (``update='orthogonal'``) none for the matrices it orthogonalizes, so the loader would fail
    on the entry one run lacks. ``metadata``: the checkpoint's entries by key, with their sizes."""
    matrices = [
        key.removesuffix(".exp_avg")
        for key, meta in metadata.items()
        if ".state." in key and key.endswith(".exp_avg") and len(getattr(meta, "size", ())) == 2
    ]
    if not matrices:  # saved before the first step, or no matrix
        return
    saved_muon = any(f"{key}.exp_avg_sq" not in metadata for key in matrices)
    if saved_muon == (update == "orthogonal"):
        return
    was = "Muon's inner step on the matrices (update='orthogonal')" if saved_muon else "the inner AdamW (update unset)"
    run = "update='orthogonal'" if update == "orthogonal" else "the inner AdamW (update unset)"
    write = "update=orthogonal" if saved_muon else "no update (drop update=orthogonal)"
    raise ValueError(
        f"FlexDeMo: the checkpoint {where} was trained with {was}, but this run takes {run}; its state would not "
        f"match. Resume with {write} in optim_args, as the checkpoint was trained, or start a new run in another "
        "output_dir."
    )
