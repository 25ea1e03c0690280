"""Hugging Face integrations: the Accelerate plugin and the Trainer glue."""

from __future__ import annotations


def install() -> None:
    """Make Accelerate and the Trainer FlexDeMo-aware (idempotent; ``import hf_flexdemo`` calls it)."""
    from . import accelerate_plugin, trainer

    accelerate_plugin.install()
    trainer.install()
