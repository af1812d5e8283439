"""Named speeds of the links inside a node, for the cost model's ``intra_node_bw``.

Bytes per second per direction per GPU (GB = 1e9 bytes), each with where the figure comes
from. A datasheet's NVLink and PCIe figures are bidirectional totals; the cost model takes
half of them (:func:`fl_accel.planning.cost.predict_step_time` divides bytes sent by a
bandwidth per direction). They are peaks: NCCL reaches about 80-90% of them on large
messages, less on small ones.

:data:`DEFAULT_INTRA_NODE_LINK` is the paper's node (4 x A100 with NVLink 3); ``python -m
scripts.cost_model`` uses it unless ``--intra-node-link`` or ``--intra-node-gbs`` says
otherwise, and prints which it used.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """A link preset: ``bytes_per_s`` per direction per GPU, and its ``source``."""

    name: str
    bytes_per_s: float
    source: str

    def describe(self) -> str:
        """``nvlink: 300 GB/s per direction (source)``."""
        return f"{self.name}: {self.bytes_per_s / 1e9:g} GB/s per direction ({self.source})"


INTRA_NODE_LINKS = {link.name: link for link in (
    Link("nvlink", 300e9, "A100 SXM, NVLink 3: 600 GB/s bidirectional, NVIDIA A100 datasheet; the paper's nodes"),
    Link("nvlink-h100", 450e9, "H100 SXM, NVLink 4: 900 GB/s bidirectional, NVIDIA H100 datasheet"),
    Link("pcie", 32e9, "PCIe 4.0 x16: 64 GB/s bidirectional, NVIDIA A100 PCIe datasheet"),
    Link("pcie5", 64e9, "PCIe 5.0 x16: 128 GB/s bidirectional, NVIDIA H100 PCIe datasheet"),
    Link("loopback", 1.2e9, "gloo all_reduce over loopback, 2 CPU processes, 64 MB: 1.2 GB/s bus bandwidth, "
                            "measured on this project's 2-core test machine (0.75 GB/s with 4 processes)"),
)}
"""The presets by name."""

DEFAULT_INTRA_NODE_LINK = "nvlink"
"""The preset used when none is named: the paper's cluster has 4 A100 per node on NVLink 3."""


def intra_node_link(name: str) -> Link:
    """The preset ``name`` (a key of :data:`INTRA_NODE_LINKS`).

    Raises:
        ValueError: an unknown name (the message lists the presets).
    """
    try:
        return INTRA_NODE_LINKS[name]
    except KeyError:
        raise ValueError(f"unknown intra-node link {name!r}: one of {', '.join(INTRA_NODE_LINKS)}") from None
