"""The FlexDeMo optimizer."""

from .flexdemo import FlexDeMo

__all__ = ["FlexDeMo"]
