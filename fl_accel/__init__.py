"""fl_accel: federated sharded data parallelism (FL+FSDP, FL+HSDP) on Hugging Face Accelerate.

Implements Mittone & Aldinucci, "Accelerating Sharded Data Parallelism at Scale with
Federated Learning", Euro-Par 2026, arXiv 2609.20359, plus fragments with a sync delay,
compressed exchange and unequal federation groups.

``import fl_accel`` is light (config and layout arithmetic); ``FLAccelerator`` imports
Accelerate on first use.
"""

from importlib.metadata import PackageNotFoundError, version as _version

__version__ = "0.2.0"

# The internals fl_accel relies on (listed in fl_accel/accelerator.py and fl_accel/fsdp.py)
# were read in these releases; others may move them.
SUPPORTED = {"torch": ("2.13",), "accelerate": ("1.15",)}


def _check_versions() -> None:
    problems = []
    for package, prefixes in SUPPORTED.items():
        try:
            found = _version(package)
        except PackageNotFoundError:
            problems.append(f"{package} is not installed")
            continue
        if not found.split("+")[0].startswith(prefixes):
            problems.append(f"{package} {found} is installed, fl_accel needs {package} {' or '.join(prefixes)}.x")
    if problems:
        raise ImportError("fl_accel relies on internals of specific releases: " + "; ".join(problems)
                          + ". Install them with `pip install -r requirements.txt` (torch==2.13.0, accelerate==1.15.0).")


_check_versions()

from .config import FLConfig  # noqa: E402
from .mesh import AXES, FLLayout  # noqa: E402

__all__ = ["FLConfig", "FLAccelerator", "FLLayout", "AXES", "__version__"]


def __getattr__(name):  # FLAccelerator imports Accelerate on first use
    if name == "FLAccelerator":
        from .accelerator import FLAccelerator

        return FLAccelerator
    raise AttributeError(name)
