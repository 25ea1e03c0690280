"""``optim_args`` (``"topk=32,sign=false,betas=0.9:0.95"``): settings written as text, read as typed values.

:func:`hf_flexdemo.config.parse_optim_args` reads FlexDeMo's with it, handing over the fields of
:class:`~hf_flexdemo.config.FlexDeMoConfig` (this module imports nothing of the config, which imports it). A key
that is no setting is refused with the closest one, a removed one with why it was taken out
(:mod:`hf_flexdemo.removed`); the checks of the values themselves are the config's.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

from .removed import removed_message


def parse_settings(text: str | None, fields: Mapping[str, dataclasses.Field], own_keys: tuple[str, ...]) -> dict:
    """``"topk=32,sign=false,betas=0.9:0.95"`` -> typed values of ``fields`` (name -> dataclass field); unknown keys
    are an error, which lists ``own_keys``."""
    values: dict[str, Any] = {}
    if not text:
        return values
    if ";" in text:
        raise ValueError(
            f"FlexDeMo optim_args={text!r}: settings are separated by commas, not semicolons; "
            f"write {text.replace(';', ',')!r}."
        )
    known = dict(fields)
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
            raise ValueError(_unknown_key_message(key, raw, tuple(known), own_keys))
        if key in given:
            raise ValueError(
                f"FlexDeMo optim_args: {key} is given twice ({key}={given[key]} and {key}={raw}); keep the one you "
                "mean."
            )
        given[key] = raw
        values[key] = _parse_value(key, raw, _typed_default(known[key]))
    return values


def _unknown_key_message(key: str, raw: str, names: tuple[str, ...], own_keys: tuple[str, ...]) -> str:
    """Lists FlexDeMo's own keys only: the shared ones are refused in optim_args (the Trainer has flags)."""
    close = difflib.get_close_matches(key, names, n=1)
    hint = f" (did you mean {close[0]!r}? write {close[0]}={raw})" if close else ""
    return (
        f"FlexDeMo optim_args: unknown key {key!r}{hint}. The keys are {sorted(own_keys)}; lr, weight_decay, betas "
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
