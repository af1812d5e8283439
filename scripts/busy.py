"""Say, before a long job, whether other processes keep the machine busy and what its expected time assumes.

    python -m scripts.busy --job "the test suite" --expect "roughly 7 to 15 minutes on 2 CPU cores"

scripts/test.sh and scripts/quickstart.sh run it first. It measures the share of all CPUs
that other processes keep busy over ``--seconds`` (default 2) with the meter the recipe
records in ``all_results.json`` (:class:`recipes.host_load.HostLoad`, psutil), and prints one
line: a warning above :data:`scripts.compare.BACKGROUND_LIMIT` (5% of all CPUs, the limit
above which ``scripts.compare`` flags a run's tokens/s as not its own), else that the machine
is idle; either way the line says that the expected time assumes idle cores. Exit status 0
(it warns, it never refuses), 2 with one ``error:`` line for bad arguments.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

from scripts.cli import fail
from scripts.compare import BACKGROUND_LIMIT


def report(share: float | None, cpus: int | None, seconds: float, *, job: str, expect: str,
           prefix: str = "") -> str:
    """The line :func:`main` prints.

    Args:
        share: the share of all CPUs other processes kept busy (``HostLoad.background_cpu_share``,
            in [0, 1]); None when it could not be measured (no psutil).
        cpus: the machine's CPUs (``HostLoad.cpus``), or None.
        seconds: how long it was measured (s).
        job: what is about to run ("the test suite").
        expect: its expected time on idle cores ("roughly 7 to 15 minutes on 2 CPU cores").
        prefix: put in front of the line ("[test] ").
    """
    if share is None:
        return (f"{prefix}note: could not measure the machine's load (psutil is missing); expected time of {job}: "
                f"{expect} when nothing else runs")
    busy = f"other processes keep {100 * share:.0f}% of the {cpus} CPUs busy (measured over {seconds:.0f} s)"
    if share > BACKGROUND_LIMIT:
        return (f"{prefix}warning: {busy}: {job} will take longer than {expect}, a time that assumes idle cores, "
                f"and the timings it measures are not its own")
    return f"{prefix}{busy}: expected time of {job}: {expect} (a time that assumes idle cores)"


def measure(seconds: float) -> tuple[float | None, int | None]:
    """``(background_cpu_share, cpus)`` of the machine over ``seconds`` s (this process
    excluded), or ``(None, None)`` without psutil."""
    try:
        from recipes.host_load import HostLoad

        meter = HostLoad().start()
    except ModuleNotFoundError:
        return None, None
    time.sleep(seconds)
    figures = meter.stop()
    return figures["background_cpu_share"], figures["cpus"]


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns 0 (bad arguments: ``SystemExit(2)`` with one ``error:`` line)."""
    p = argparse.ArgumentParser(prog="python -m scripts.busy", description=__doc__.split("\n\n")[0])
    p.error = fail
    p.add_argument("--job", required=True, help="what is about to run, e.g. 'the test suite'")
    p.add_argument("--expect", required=True, help="its expected time on idle cores")
    p.add_argument("--seconds", type=float, default=2.0, help="how long to measure (default: %(default)s)")
    p.add_argument("--prefix", default="", help="put in front of the line, e.g. '[test] '")
    a = p.parse_args(argv)
    if not 0 < a.seconds <= 60:
        fail(f"--seconds must be in (0, 60], got {a.seconds:g}")
    share, cpus = measure(a.seconds)
    print(report(share, cpus, a.seconds, job=a.job, expect=a.expect, prefix=a.prefix), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
