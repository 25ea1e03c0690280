"""Wrapping a method of a library class, for the few hooks the libraries do not offer."""

from __future__ import annotations

import functools
from collections.abc import Callable


def wrap_method(owner: type, name: str, wrapper: Callable) -> None:
    """Replace ``owner.name`` by ``wrapper(original, self, *args, **kwargs)``."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        return wrapper(original, self, *args, **kwargs)

    setattr(owner, name, method)
