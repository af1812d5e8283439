"""recipes/sync_log.py with a fake world sum: when records are summed and written, in which
order, what the progress bar says, and what a record waits for (issue 40 item 1). The
launched recipe (tests/recipe/test_recipe_sync_log.py) checks the same end to end with the
comm meter."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch

from fl_accel.schedule import SyncSchedule
from recipes.sync_log import SyncLog, wait_text


class FakeWorld:
    """Sums a part by adding 10 (as if 10 came from the other ranks) and counts the calls;
    ``arrivals`` counts the sums made inside ``arriving()``."""

    def __init__(self):
        self.calls, self.arrivals, self._inside = 0, 0, False

    def reduce(self, part):
        self.calls += 1
        self.arrivals += self._inside
        return part + 10

    @contextlib.contextmanager
    def arriving(self):
        self._inside = True
        try:
            yield
        finally:
            self._inside = False


class Bar:
    def __init__(self):
        self.postfix = []

    def set_postfix_str(self, text):
        self.postfix.append(text)


def test_one_group_writes_each_record_at_once():
    world, written = FakeWorld(), []
    log = SyncLog(deferred=False, reduce=world.reduce)
    log.add(1, torch.tensor([1.0]), lambda s: written.append(("train", 1, s.item())))
    assert written == [("train", 1, 11.0)] and world.calls == 1 and log.waiting == []


def test_records_wait_for_the_flush_and_are_written_in_order():
    """Nothing is summed or written between syncs; the flush sums each record once (the first
    inside ``arriving``: the wait for the other groups) and then writes them in the order
    they were made; a flush with nothing waiting makes no collective."""
    world, written, bar = FakeWorld(), [], Bar()
    log = SyncLog(deferred=True, progress=bar, reduce=world.reduce,
                  until=lambda step: f"the sync at step {4 * (step // 4 + 1)}")
    for step in (1, 2, 3):
        log.add(step, torch.tensor([float(step)]), lambda s, step=step: written.append(("train", step, s.item())))
    log.add(3, torch.tensor([0.5]), lambda s: written.append(("eval", 3, s.item())))
    assert written == [] and world.calls == 0
    assert bar.postfix[-1] == "steps 1-3 wait for the sync at step 4"
    synchronizer = SimpleNamespace(arriving=world.arriving)
    log.pre_sync(synchronizer, True)
    assert written == [("train", 1, 11.0), ("train", 2, 12.0), ("train", 3, 13.0), ("eval", 3, 10.5)]
    assert world.calls == 4 and world.arrivals == 1 and log.waiting == []
    log.show("loss=3.000, tok_s=10")
    log.add(5, torch.tensor([5.0]), lambda s: written.append(("train", 5, s.item())))
    assert bar.postfix[-1] == "loss=3.000, tok_s=10; step 5 waits for the sync at step 8"
    assert log.flush() == 1 and world.calls == 5
    assert log.flush() == 0 and world.calls == 5  # nothing waits: no collective
    assert bar.postfix[-1] == "loss=3.000, tok_s=10"


def test_wait_text_names_the_next_sync_checkpoint_or_the_end():
    """H=4 over 12 steps: a record of step 5 waits for the sync at step 8, one of step 8 (made
    after that step's sync) for the sync at 12; a checkpoint at step 6 comes first; the last
    step's record waits for the end; fragments (P=2) sync every 2 steps; under a trigger
    other than "steps" the next sync has no step number yet."""
    schedule = SyncSchedule(sync_every=4)
    for _ in range(5):
        schedule.step()
        if schedule.local_step == 4:
            schedule.synced()
    assert wait_text(schedule, 5, 12) == "the sync at step 8"
    assert wait_text(schedule, 5, 12, checkpoint_every=6) == "the checkpoint at step 6"
    assert wait_text(schedule, 5, 12, checkpoint_every=8) == "the sync at step 8"  # the sync comes first
    assert wait_text(schedule, 5, 6) == "the sync at step 6"  # the last step's sync
    for _ in range(3):
        schedule.step()
    schedule.synced()
    assert wait_text(schedule, 8, 12) == "the sync at step 12"
    assert wait_text(schedule, 12, 12) == "the end of the run"
    assert wait_text(schedule, 5, 12, rounds=True) == "the next sync"
    fragments = SyncSchedule(sync_every=4, num_fragments=2)
    fragments.step()
    assert wait_text(fragments, 1, 12) == "the sync at step 2"
