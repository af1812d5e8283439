"""Log records whose world figures wait for the next point where the federation groups meet.

Between syncs, federation groups must not wait for each other (issue 40). A log record's
figures are sums over the world's ranks: the train loss averaged over every rank, each
rank's memory, sync wait and traffic (:meth:`recipes.metrics.Meter.train_snapshot`), and an
evaluation's token NLL and token count (:func:`recipes.metrics.eval_totals`). Summed at
each log step, they made every group wait there for the slowest one, between syncs.

With several federation groups in the launch's world, :class:`SyncLog` keeps each record's
part of this rank (taken at its step, without a collective) and sums the parts over the
world at the next point where every group meets anyway:

* a sync event: :meth:`SyncLog.pre_sync` is the first pre-sync hook
  (``accelerator.register_pre_sync_hook``), so the sums are part of the sync; the first of
  them is where a fast group waits for the slow one, and it runs inside
  ``accelerator.federation.arriving()``: counted as the sync's arrival wait
  (``sync_arrival_share_by_group``), as the sync's own first world collective would be;
* a checkpoint (itself a world event: every group's state at one step), before it is
  written, so ``metrics.jsonl`` holds every record up to the checkpoint;
* the end of the run, before the final evaluation.

Each record is summed by its own all-reduce of the same tensor an immediate log reduces, so
every logged value equals the immediate log's bitwise. Records are written (metrics.jsonl,
W&B, the printed evaluation line) when summed, in the order they were made; the progress
bar says which steps wait and for what (:func:`wait_text`). A crash loses the records
still waiting (at most a round's); a resume from a checkpoint has every record up to it.

One federation group (fsdp, hsdp, F=1) and the torchft mode (each group its own launch: its
world is the group) have nothing to decouple: records are summed and written at once.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable


def _all_reduce(part):
    import torch.distributed as dist

    dist.all_reduce(part)  # counted in the "world" bucket of comm_stats
    return part


@dataclass
class Waiting:
    """A record waiting for its sum: its ``step``, this rank's ``part`` (a tensor, summed in
    place) and ``write(summed)``, which builds and writes the record."""

    step: int
    part: Any
    write: Callable[[Any], None]


class SyncLog:
    """The records of a run, summed over the world now (``deferred`` False) or at the next
    :meth:`flush` (a sync, a checkpoint, the end).

    Args:
        deferred: keep records until :meth:`flush`; False: sum and write each at once.
        progress: a tqdm bar whose postfix shows the last figures and what waits (or None).
        until: ``until(step)`` -> what a record of ``step`` waits for, in words
            (:func:`wait_text`), e.g. "the sync at step 16".
        reduce: sums a part over the world in place and returns it (default: a world
            all-reduce; tests pass a fake).
    """

    def __init__(self, deferred: bool, progress=None, until: Callable[[int], str] | None = None,
                 reduce: Callable[[Any], Any] | None = None):
        self.deferred = deferred
        self.progress, self.until = progress, until
        self.reduce = reduce or _all_reduce
        self.waiting: list[Waiting] = []
        self.shown = ""

    def add(self, step: int, part, write: Callable[[Any], None]) -> None:
        """A record of ``step``: ``write(part summed over the world)`` now or at the next :meth:`flush`.
        Every rank adds the same records in the same order (the sums are collectives)."""
        if not self.deferred:
            write(self.reduce(part))
            return
        self.waiting.append(Waiting(step, part, write))
        self._show()

    def flush(self, arriving: Callable[[], Any] | None = None) -> int:
        """Sum every waiting record over the world (one all-reduce each, in order; the first
        inside ``arriving()`` when given), then write them in order. Returns how many.
        Collective when any waits (every rank holds the same records)."""
        waiting, self.waiting = self.waiting, []
        for i, w in enumerate(waiting):
            with arriving() if i == 0 and arriving is not None else contextlib.nullcontext():
                w.part = self.reduce(w.part)
        for w in waiting:
            w.write(w.part)
        if waiting:
            self._show()
        return len(waiting)

    def pre_sync(self, federation, full: bool) -> None:
        """The pre-sync hook's work (``accelerator.register_pre_sync_hook``, called with
        ``accelerator.federation``): :meth:`flush`, the first sum timed as the wait for the
        other groups (``federation.arriving``)."""
        self.flush(arriving=federation.arriving)

    def show(self, figures: str) -> None:
        """``figures`` (e.g. "loss=3.210, 1,234 tokens/s over the last 5 steps") are the last written record's: on the bar."""
        self.shown = figures
        self._show()

    def status(self) -> str:
        """The bar's postfix: the last figures, then which steps wait and for what, e.g.
        "loss=3.210, 1,234 tokens/s over the last 5 steps; steps 9-11 wait for the sync at step 12"."""
        text = self.shown
        if self.waiting:
            steps = sorted({w.step for w in self.waiting})
            which = f"step {steps[0]} waits" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]} wait"
            until = self.until(steps[-1]) if self.until is not None else "the next sync"
            text += ("; " if text else "") + f"{which} for {until}"
        return text

    def _show(self) -> None:
        if self.progress is not None:
            self.progress.set_postfix_str(self.status())


def wait_text(schedule, step: int, max_steps: int, checkpoint_every: int = 0, rounds: bool = False) -> str:
    """What a record of ``step`` (made after that optimizer step) waits for, in words: "the
    sync at step N" (the next sync event: ``schedule``, a :class:`fl_accel.schedule.SyncSchedule`,
    counts the steps of the round; the last step's sync at ``max_steps``), "the checkpoint at
    step N" when a checkpoint (every ``checkpoint_every`` steps, none at the last step) comes
    first, "the end of the run" after the last step, "the next sync" under a ``sync_trigger``
    other than "steps" (``rounds``: its length is decided as it goes)."""
    if rounds:
        return "the next sync"
    if step >= max_steps:
        return "the end of the run"
    nxt = min(step + schedule.round_length - schedule.local_step, max_steps)  # local_step 0: a sync just ended
    if checkpoint_every:
        ckpt = -(-step // checkpoint_every) * checkpoint_every
        if ckpt < min(nxt, max_steps):
            return f"the checkpoint at step {ckpt}"
    return f"the sync at step {nxt}"
