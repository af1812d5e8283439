"""fl_accel: federated sharded data parallelism (FL+FSDP, FL+HSDP) on Hugging Face Accelerate.

Implements Mittone & Aldinucci, "Accelerating Sharded Data Parallelism at Scale with
Federated Learning", Euro-Par 2026, arXiv 2609.20359.
"""

from .config import FLConfig
from .mesh import AXES, FLLayout

__all__ = ["FLConfig", "FLAccelerator", "FLLayout", "AXES", "__version__"]
__version__ = "0.1.0"


def __getattr__(name):
    # Import the Accelerate-dependent part lazily: config and mesh arithmetic stay
    # importable (and fast) without initialising torch.distributed machinery.
    if name == "FLAccelerator":
        from .accelerator import FLAccelerator

        return FLAccelerator
    raise AttributeError(name)
