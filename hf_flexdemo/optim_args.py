"""``optim_args`` (``"topk=32,sign=false,betas=0.9:0.95"``): FlexDeMo's settings as the Trainer passes them, as
typed values.

A key that is no setting is refused with the closest one, a removed one with why it was taken out
(:mod:`hf_flexdemo.removed`). The checks of the values themselves are :class:`hf_flexdemo.config.FlexDeMoConfig`'s.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from .config import SHARED_KEYS, WIRE_PRESETS, FlexDeMoConfig, preset_knobs
from .removed import removed_message

OWN_KEYS = tuple(name for name in FlexDeMoConfig.field_names() if name not in SHARED_KEYS)
"""``optim_args`` keys that only FlexDeMo reads: with another ``optim`` they would be ignored."""


def parse_optim_args(text: str | None) -> dict[str, Any]:
    """``"topk=32,sign=false,betas=0.9:0.95"`` -> typed values; unknown keys are an error."""
    values: dict[str, Any] = {}
    if not text:
        return values
    if ";" in text:
        raise ValueError(
            f"FlexDeMo optim_args={text!r}: settings are separated by commas, not semicolons; "
            f"write {text.replace(';', ',')!r}."
        )
    known = {f.name: f for f in dataclasses.fields(FlexDeMoConfig)}
    given: dict[str, str] = {}  # key -> its text as written
    for written in text.split(","):
        if len(written.split()) > 1 and written.count("=") > 1:  # "chunk=64 topk=32": a space for a comma
            raise ValueError(
                f"FlexDeMo optim_args={text!r}: settings are separated by commas; {written.strip()!r} reads as one "
                f"setting. Write {','.join(written.split())!r}."
            )
        item = "".join(written.split())
        if not item:
            continue
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"FlexDeMo optim_args: {item!r} is not of the form key=value.")
        removed = removed_message(key, raw, where="FlexDeMo optim_args")
        if removed is not None:
            raise ValueError(removed)
        if key not in known:
            raise ValueError(_unknown_key_message(key, raw))
        if key in given:
            raise ValueError(
                f"FlexDeMo optim_args: {key} is given twice ({key}={given[key]} and {key}={raw}); keep the one you "
                "mean."
            )
        given[key] = raw
        values[key] = _parse_value(key, raw, _typed_default(known[key]))
    check_knobs_beside_wire(values, "FlexDeMo optim_args")
    return values


def check_knobs_beside_wire(given: dict[str, Any], where: str) -> None:
    """A knob given beside ``wire`` must be the preset's, even at its default: given, it was meant."""
    wire = given.get("wire")
    preset = WIRE_PRESETS.get(wire, {})
    for key, value in given.items():
        if key in preset and value != preset[key]:
            raise ValueError(
                f"{where}: wire={wire!r} sets {key}={preset[key]}, but {key}={value} is given too; drop {key} to use "
                f"the preset, or drop wire and set {preset_knobs(wire)} yourself."
            )


def _unknown_key_message(key: str, raw: str) -> str:
    """Lists FlexDeMo's own keys only: the shared ones are refused in optim_args (the Trainer has flags)."""
    close = difflib.get_close_matches(key, FlexDeMoConfig.field_names(), n=1)
    hint = f" (did you mean {close[0]!r}? write {close[0]}={raw})" if close else ""
    return (
        f"FlexDeMo optim_args: unknown key {key!r}{hint}. The keys are {sorted(OWN_KEYS)}; lr, weight_decay, betas "
        "and eps come from --learning_rate, --weight_decay, --adam_beta1/2 and --adam_epsilon."
    )


def _typed_default(spec: dataclasses.Field) -> Any:
    """The field's default, or for one that defaults to ``None`` ("not given") a value of its annotated type."""
    if spec.default is not None:
        return spec.default
    annotation = str(spec.type)
    for kind in (bool, int, float):
        if annotation.startswith(f"{kind.__name__} |"):
            return kind()
    return None


def _parse_value(key: str, raw: str, default: Any) -> Any:
    try:
        if isinstance(default, bool):
            if raw.lower() in ("true", "1", "yes"):
                return True
            if raw.lower() in ("false", "0", "no"):
                return False
            raise ValueError
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return _parse_float(raw)
        if isinstance(default, tuple):
            return tuple(_parse_float(x) for x in raw.split(":"))
    except ZeroDivisionError:
        raise ValueError(f"FlexDeMo optim_args: {key}={raw!r} divides by zero; write a fraction like 1/128.") from None
    except ValueError:
        kind = "a pair like 0.9:0.999" if isinstance(default, tuple) else type(default).__name__
        raise ValueError(f"FlexDeMo optim_args: {key}={raw!r} is not {kind}.") from None
    return raw


def _parse_float(raw: str) -> float:
    if "/" in raw:  # allow rate=1/128
        num, den = raw.split("/")
        return float(num) / float(den)
    return float(raw)
