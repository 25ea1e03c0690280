"""The FlexDeMo optimizer."""

from .flexdemo import FlexDeMo, unwrap_flexdemo

__all__ = ["FlexDeMo", "unwrap_flexdemo"]
