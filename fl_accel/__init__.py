"""fl_accel: federated sharded data parallelism (FL+FSDP, FL+HSDP) on Hugging Face Accelerate.

Implements Mittone & Aldinucci, "Accelerating Sharded Data Parallelism at Scale with
Federated Learning", Euro-Par 2026, arXiv 2609.20359, plus fragments with a sync delay,
compressed exchange and unequal federation groups.

``import fl_accel`` is light (config and layout arithmetic); ``FLAccelerator`` imports
Accelerate on first use, ``FLTrainer`` (``transformers.Trainer`` on FLAccelerator) transformers.
"""

from .compat import check_versions

__version__ = "0.2.0"

check_versions()  # a warning outside the tested torch/accelerate range (fl_accel/compat.py), not an error

from . import errors  # noqa: E402

errors.install()  # under torchrun/accelerate launch: a refused input ends as one line, torchrun's root cause

from .config import FLConfig  # noqa: E402
from .mesh import AXES, FLLayout  # noqa: E402

__all__ = ["FLConfig", "FLAccelerator", "FLTrainer", "FLLayout", "AXES", "__version__"]


def __getattr__(name):  # FLAccelerator imports Accelerate on first use, FLTrainer transformers too
    if name == "FLAccelerator":
        from .accelerator import FLAccelerator

        return FLAccelerator
    if name == "FLTrainer":
        from .trainer import FLTrainer

        return FLTrainer
    raise AttributeError(name)
