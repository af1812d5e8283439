"""The end-of-run wait of the torchft mode (fl_accel/ft_ends.py ``finish``), its control flow
against a scripted transport: which quorum ends the wait, and what ``together`` says. The same
path with real groups, a Lighthouse and heals: tests/ft/test_ft_faults.py (the double faults).

* a quorum in which a group heals from the end state restarts the wait: the healed group holds
  the final model and comes to the end quorum next, seconds later on a loaded machine (a group
  that gave up just then made every group report the federation apart: a busy-machine failure);
* every group at the end with different models is not ``together``, and waiting longer
  changes nothing;
* a complete exchange is believed even if this group's wait on it then reported an error.
"""

from __future__ import annotations

import types

import pytest
import torch

from fl_accel import ft_ends


class Clock:
    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        return self.now

    def sleep(self, s):
        self.now += s


class ScriptEnded(BaseException):
    """More quorums asked than scripted (a BaseException: ``finish`` retries on Exception)."""


class ScriptedTransport:
    """Group 0 of F at the end; ``quorums``: (seconds the quorum takes, groups in it, groups
    behind, the other groups' checksums {group: checksum} its exchange brings)."""

    def __init__(self, clock, quorums, num_groups=3, rejoin_timeout_s=10.0, own=5.0, error_after_exchange=False):
        self.clock, self.quorums, self.num_groups, self.rejoin_timeout_s = clock, list(quorums), num_groups, \
            rejoin_timeout_s
        self.group_index, self.device, self.behind, self.round, self.own = 0, torch.device("cpu"), 0, None, own
        self.error, self.error_after_exchange, self.asked = None, error_after_exchange, 0
        self.manager = types.SimpleNamespace(errored=lambda: self.error)

    def begin(self):
        if not self.quorums:
            raise ScriptEnded(f"quorum {self.asked + 1} asked; {self.asked} scripted")
        seconds, num, behind, self.others = self.quorums.pop(0)
        self.clock.now += seconds
        self.asked += 1
        self.behind, self.error = behind, None
        self.round = types.SimpleNamespace(num_groups=num, position=0)
        return self.round

    def control_all_reduce(self, table):
        for pos, (g, c) in enumerate(sorted(self.others.items()), start=1):
            table[pos] = torch.tensor([g + 1.0, c], dtype=torch.float64)
        if self.error_after_exchange:
            self.error = RuntimeError("Connection closed by peer")

    def should_commit(self):
        self.round = None
        return False


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(ft_ends, "time", types.SimpleNamespace(monotonic=c.monotonic, sleep=c.sleep))
    # a world of one rank: the group's own reductions are the identity
    monkeypatch.setattr(ft_ends, "dist", types.SimpleNamespace(all_reduce=lambda *a, **k: None,
                                                               ReduceOp=torch.distributed.ReduceOp))
    return c


ALONE = (1.0, 1, 0, {})


def test_a_heal_from_the_end_state_restarts_the_wait(clock):
    # 8 s alone, a quorum in which groups 1 and 2 heal from this group's final model, then 6 s
    # before they reach the end quorum: 14 s after this group's arrival, past the first 10
    quorums = [ALONE] * 8 + [(0.5, 3, 2, {})] + [ALONE] * 6 + [(0.5, 3, 0, {1: 5.0, 2: 5.0})]
    t = ScriptedTransport(clock, quorums)
    end = ft_ends.finish(t, lambda: t.own, poll_s=0.0)
    assert end["together"] and end["groups"] == [0, 1, 2] and t.quorums == [], end
    assert end["waited_s"] == pytest.approx(15.0)


def test_without_a_heal_the_wait_ends_after_rejoin_timeout(clock):
    t = ScriptedTransport(clock, [ALONE] * 30)
    end = ft_ends.finish(t, lambda: t.own, poll_s=0.0)
    assert not end["together"] and end["groups"] == [0] and end["waited_s"] == pytest.approx(10.0), end


def test_heals_restart_the_wait_a_bounded_number_of_times(clock):
    heal = (0.5, 2, 1, {})  # a group that heals at every quorum and never arrives
    t = ScriptedTransport(clock, [heal] * 200)
    end = ft_ends.finish(t, lambda: t.own, poll_s=0.0)
    assert not end["together"] and end["waited_s"] <= 10.0 * 3 + 0.5, end  # F - 1 = 2 restarts at most


def test_groups_at_the_end_with_different_models_are_not_together(clock):
    t = ScriptedTransport(clock, [(0.5, 3, 0, {1: 5.0, 2: 5.001})] + [ALONE] * 30)
    end = ft_ends.finish(t, lambda: t.own, poll_s=0.0)
    assert not end["together"] and t.asked == 1, end  # all there: waiting longer changes nothing
    assert end["checksums"] == {0: 5.0, 1: 5.0, 2: 5.001}


def test_a_complete_exchange_counts_even_if_the_wait_on_it_then_failed(clock):
    t = ScriptedTransport(clock, [(0.5, 3, 0, {1: 5.0, 2: 5.0})], error_after_exchange=True)
    end = ft_ends.finish(t, lambda: t.own, poll_s=0.0)
    assert end["together"] and end["groups"] == [0, 1, 2], end


def test_an_incomplete_exchange_is_asked_again(clock):
    t = ScriptedTransport(clock, [(0.5, 3, 0, {1: 5.0})] + [(0.5, 3, 0, {1: 5.0, 2: 5.0})])
    end = ft_ends.finish(t, lambda: t.own, poll_s=0.0)
    assert end["together"] and t.asked == 2, end
