"""Run ``recipes/pretrain.py`` in this process and record its peak memory when it ends.

Used by ``bench/memory_validation.py`` (the memory model's CPU validation). Launched like
the recipe: ``torchrun --nproc_per_node 4 bench/memory_probe.py <recipe flags>``. Each
rank writes ``<output_dir>/memory_probe/rank<R>.json`` after the recipe returns:

- ``peak_host_mb``: peak resident memory of the whole run, ``ru_maxrss`` / 1024 (MiB;
  Linux reports KiB);
- ``peak_host_mb_after_prepare``: ``ru_maxrss`` when the recipe read it right after
  ``prepare`` (the recipe's own figure is the max over ranks);
- ``live_mb_after_prepare`` and ``peak_live_mb``: bytes in use in glibc malloc
  (``mallinfo2``: ``uordblks + hblkhd``, MiB) when the recipe read its after-prepare
  figure, and their peak from then on, sampled every 5 ms by a thread; null where
  ``mallinfo2`` is missing (glibc < 2.33, not glibc). The sampled peak can miss an
  allocation shorter than the period.

Live bytes are what an accelerator allocator's ``max_memory_allocated`` counts; resident
memory adds what malloc keeps after a free (see bench/README.md, "Memory model").
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import sys
import threading
import time


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _live_reader():
    """A function returning glibc malloc's bytes in use in MiB, or None without mallinfo2."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2

    def live() -> float:
        m = fn()
        return (m.uordblks + m.hblkhd) / 2**20

    return live


def _output_dir(argv: list[str]) -> str:
    for i, token in enumerate(argv):
        if token == "--output_dir" and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith("--output_dir="):
            return token.split("=", 1)[1]
    raise SystemExit("bench/memory_probe.py needs --output_dir")


def main(argv: list[str]) -> int:
    import recipes.metrics as metrics
    from recipes.pretrain import cli

    out = os.path.join(_output_dir(argv), "memory_probe")
    live = _live_reader()
    state = {"after_prepare_rss": None, "after_prepare_live": None, "peak_live": 0.0}
    if live is not None:
        def sample() -> None:
            while True:
                state["peak_live"] = max(state["peak_live"], live())
                time.sleep(0.005)

        threading.Thread(target=sample, daemon=True).start()
    recipe_peak = metrics.peak_host_mb

    def peak_host_mb() -> float:  # the recipe calls it once, right after prepare
        value = recipe_peak()
        if state["after_prepare_rss"] is None:
            state["after_prepare_rss"] = value
            if live is not None:
                state["after_prepare_live"] = live()
                state["peak_live"] = state["after_prepare_live"]
        return value

    metrics.peak_host_mb = peak_host_mb  # recipes/pretrain.py imports it from recipes.metrics in main()
    rc = cli(argv)
    rank = int(os.environ.get("RANK", "0"))
    os.makedirs(out, exist_ok=True)
    record = {"rank": rank, "returncode": rc,
              "peak_host_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
              "peak_host_mb_after_prepare": state["after_prepare_rss"],
              "live_mb_after_prepare": state["after_prepare_live"],
              "peak_live_mb": state["peak_live"] if live is not None else None}
    with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as fh:
        json.dump(record, fh)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
