"""FlexDeMo for Hugging Face Accelerate and Transformers.

Importing the package registers ``optim="flexdemo"`` with the Trainer and makes
Accelerate's FSDP2 preparation FlexDeMo-aware (see :mod:`hf_flexdemo.integrations`).
"""

from .config import FlexDeMoConfig
from .integrations import install
from .integrations.callback import FlexDeMoCallback, ReplicaDriftError
from .optim import FlexDeMo
from .wire import CommStats

install()

__all__ = ["CommStats", "FlexDeMo", "FlexDeMoCallback", "FlexDeMoConfig", "ReplicaDriftError", "install"]
__version__ = "0.1.0"
