"""Settings, schemes and wire presets that were taken out because their own measurements lost.

One table, read by every place a setting can arrive: ``optim_args`` (:func:`hf_flexdemo.config.parse_optim_args`),
keywords (:meth:`hf_flexdemo.config.FlexDeMoConfig.from_keywords`) and a resumed checkpoint's saved settings
(:func:`hf_flexdemo.integrations.resume.check_saved_settings`). Each refusal says why in one line, where the
finding is, and the commit that last had the code, so that a larger study can bring one back. This module imports
nothing of the package.
"""

from __future__ import annotations

from typing import Any

LAST_COMMIT = "17d8727"
"""The commit that last had every piece below unless :data:`LAST_COMMITS` names another."""
LAST_COMMITS = {"shared_indices": "74cba10", "wire=top24_2bit": "a3f78d8"}
"""Pieces taken out later: name (or ``setting=value``) -> the commit that last had them."""
FINDINGS = "BENCHMARKS.md, 'Findings: options taken out'"

REMOVED_SETTINGS: dict[str, tuple[str, str]] = {
    # name -> (why, what to write instead)
    "derived_topk": (
        "sending derived positions beside the top-k was above the top-k alone at every byte count measured",
        "drop derived_topk (DeMo's top-k alone)",
    ),
    "factor_rank": (
        "scheme='lowrank' lost: +16.2% against AdamW-HSDP at 658x fewer bytes than bf16 dense, where the DCT top-k "
        "was +4.6% at 520x",
        "drop factor_rank and use scheme=demo (a wire= preset for fewer bytes)",
    ),
    "topk_block": (
        "picking the top-k in square blocks lost loss everywhere measured",
        "drop topk_block (each coefficient is picked on its own)",
    ),
    "ns_steps": (
        "four Newton-Schulz iterations instead of Muon's five lost on two of three presets: +0.5% on OLMo2, +2.3% "
        "and +3.3% on T5, -0.6% on fine-tuning",
        "drop ns_steps (Muon's five iterations)",
    ),
    "elementwise_update": (
        "its only alternative, 'sign', lost: +2.4% against -0.5% for 'adam' on OLMo2, 3 seeds",
        "drop elementwise_update (what update='orthogonal' does not orthogonalize takes the adam rule; a "
        "parameter group may set its own update='adam' or 'sign')",
    ),
    "shared_indices": (
        "one index set for every replica, summed in an all-reduce, lost: +17.1% against AdamW-HSDP where DeMo's own "
        "top-k ended +6.7% (+9.8% against it; OLMo2 1.6M, 3 seeds), and it needed its own fault-tolerance path",
        "drop shared_indices (each replica sends its own top-k; a wire= preset for fewer bytes)",
    ),
    "decode": (
        "no measurement favoured averaging over all replicas ('mean') over DeMo's average over the senders",
        "drop decode (scheme=demo averages each coefficient over the replicas that sent it)",
    ),
}
"""Settings taken out: name -> (why, in one line; what to write instead)."""

REMOVED_VALUES: dict[tuple[str, str], tuple[str, str]] = {
    ("scheme", "lowrank"): REMOVED_SETTINGS["factor_rank"],
    ("wire", "top144_c128_2bit"): (
        "it matched wire=2bit inside the seeds' spread at 1.03x its bytes",
        "write wire=2bit, or spell its knobs out: topk=144,chunk=128,scale_topk=true,value_bits=2,"
        "pack_indices=true,index_coding=elias_fano",
    ),
    ("wire", "top16_2bit"): (
        "it lost to AdamW-HSDP on two of three presets (+3.3%, +2.6%), where top24_2bit (since removed too) and "
        "top4_1bit covered its "
        "link speeds",
        "write wire=2bit or wire=top4_1bit",
    ),
    ("wire", "top24_2bit"): (
        "over a whole run it ended +4.0% against AdamW-HSDP (OLMo2 263K, 20 tokens per parameter, seed 0, rate "
        "bracketed) where 2bit, at 1.26x its bytes, ended +2.8%; the presets became the frontier of bytes against a "
        "whole run's loss, and its narrow link band (290 to 370 Mbit/s) went to 2bit and top4_1bit",
        "write wire=2bit, or wire=top4_1bit below about 370 Mbit/s, or spell its knobs out: "
        "topk=24,value_bits=2,pack_indices=true,index_coding=elias_fano",
    ),
}
"""Values of a kept setting taken out: (setting, value) -> (why; what to write instead)."""


def _entry(key: str, value: Any) -> tuple[str, str] | None:
    if key in REMOVED_SETTINGS:
        return REMOVED_SETTINGS[key]
    if isinstance(value, str) and (key, value) in REMOVED_VALUES:
        return REMOVED_VALUES[key, value]
    return None


def removed_reason(key: str, value: Any = None) -> str | None:
    """``"<why>. The finding: ...; the code: commit ...."`` if ``key`` (or ``key=value``) was taken out, else
    None."""
    entry = _entry(key, value)
    commit = LAST_COMMITS.get(key if key in REMOVED_SETTINGS else f"{key}={value}", LAST_COMMIT)
    return None if entry is None else f"{entry[0]}. The finding: {FINDINGS}; the code: commit {commit}."


def removed_message(key: str, value: Any = None, where: str = "FlexDeMo") -> str | None:
    """The refusal of ``key`` (or of ``key=value``) if it was taken out, with what to write instead, else None."""
    entry = _entry(key, value)
    if entry is None:
        return None
    what = key if key in REMOVED_SETTINGS else f"{key}={value}"
    return f"{where}: {what} was removed: {removed_reason(key, value)} Instead, {entry[1]}."


def check_not_removed(settings: dict[str, Any], where: str = "FlexDeMo") -> None:
    """Raise ValueError for the first setting of ``settings`` (name -> value) that was taken out."""
    for key, value in settings.items():
        message = removed_message(key, value, where)
        if message is not None:
            raise ValueError(message)
