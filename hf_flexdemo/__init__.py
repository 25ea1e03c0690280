"""FlexDeMo for Hugging Face Accelerate and Transformers.

Importing the package imports the optimizer core only (torch, no transformers, Accelerate,
datasets or wandb). The integrations (``optim="flexdemo"`` for the Trainer, the Accelerate
plugin) install themselves when transformers or Accelerate is imported in the same process
(see :mod:`hf_flexdemo.integrations`).
"""

from .config import FlexDeMoConfig
from .integrations import activate_on_import, install
from .optim import FlexDeMo
from .updates import elementwise_parameters
from .wire import CommStats

activate_on_import()

__all__ = [
    "CommStats",
    "FlexDeMo",
    "FlexDeMoCallback",
    "FlexDeMoConfig",
    "ReplicaDriftError",
    "elementwise_parameters",
    "install",
]
__version__ = "0.1.0"

_FROM_CALLBACK = ("FlexDeMoCallback", "ReplicaDriftError")


def __getattr__(name: str):
    if name in _FROM_CALLBACK:  # needs transformers: imported on first use only
        from .integrations import callback

        return getattr(callback, name)
    raise AttributeError(f"module 'hf_flexdemo' has no attribute {name!r}")
