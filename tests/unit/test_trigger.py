"""fl_accel.trigger: merge weights, the "speed" plan, the last round, the round state (pure)."""

from __future__ import annotations

import json

import pytest

from fl_accel.mesh import merge_weights
from fl_accel.trigger import RoundState, last_round, speed_steps


def test_merge_weights_by_tokens_size_and_uniform():
    assert merge_weights("tokens", [3, 1], [2, 2]) == pytest.approx((0.75, 0.25))
    assert merge_weights("tokens", [2, 2], [2, 4]) == pytest.approx((1 / 3, 2 / 3))  # equal steps: the size share
    assert merge_weights("tokens", [4, 1], [2, 4]) == pytest.approx((8 / 12, 4 / 12))
    assert merge_weights("size", [4, 1], [2, 4]) == pytest.approx((1 / 3, 2 / 3))
    assert merge_weights("uniform", [4, 1], [2, 4]) == pytest.approx((0.5, 0.5))
    assert merge_weights("tokens", [0, 5], [2, 2]) == (0.0, 1.0)
    with pytest.raises(ValueError, match="no group trained"):
        merge_weights("tokens", [0, 0], [2, 2])
    with pytest.raises(ValueError, match="group_weighting"):
        merge_weights("steps", [1, 1], [2, 2])
    with pytest.raises(ValueError, match="one entry per group"):
        merge_weights("tokens", [1], [2, 2])


def test_speed_steps_scale_with_step_time():
    assert speed_steps(8, [0.1, 0.2]) == [16, 8]  # 2:1 -> the slow group does H, the fast one 2H
    assert speed_steps(8, [0.3, 0.1, 0.2]) == [8, 24, 12]
    assert speed_steps(8, [0.1, 0.22]) == [18, 8]  # 2.2:1: the arrival misses by 0.4 fast steps of 17.6
    assert speed_steps(1, [100.0, 1.0]) == [1, 100]
    assert speed_steps(8, [0.0, 0.0]) == [8, 8]  # nothing measured yet: H
    assert speed_steps(8, [0.1, 0.0]) == [8, 8]


def test_last_round_lands_on_the_budget():
    n = last_round(20, [8, 4], [2, 2])  # 24 rank-steps per round; 20 left
    assert sum(2 * k for k in n) == pytest.approx(20, abs=2) and n[0] > n[1]
    assert last_round(1, [8, 4], [2, 2]) == [1, 1]  # at least one step each


def test_round_state_closes_plans_and_stops_on_the_budget():
    r = RoundState("speed", 4, (2, 2), position=1)
    r.budget = 20 * 4
    assert r.round_steps == 4  # the first round: H
    r.steps, r.train_s = 4, 2.0
    w = r.close([[4, 0.4, 0.0], [4, 2.0, 1.6]], "tokens")  # group 1 is 5x slower
    assert w == pytest.approx((0.5, 0.5)) and r.group_steps == [4, 4] and r.tokens == 16
    assert r.plan == [20, 4] and r.round_steps == 4 and not r.done  # the slowest does H; 48 rank-steps < 64 left
    assert (r.steps, r.train_s) == (0, 0.0)
    w = r.close([[20, 2.0, 1.6], [4, 2.0, 1.6]], "tokens")
    assert w == pytest.approx((20 / 24, 4 / 24)) and r.tokens == 64 and not r.done
    assert r.plan == [7, 1]  # the last round: 16 rank-steps left, shared 20:4 (2 x 7 + 2 x 1)
    r.close([[7, 0.7, 1.6], [1, 0.5, 1.6]], "tokens")
    assert r.done and r.tokens == 80
    s = r.summary()
    assert s["steps_per_round"] == [[4, 20, 7], [4, 4, 1]] and s["num_rounds"] == 3
    assert 0 <= s["wait_share"][0] <= 1
    again = RoundState("speed", 4, (2, 2), position=0)
    again.load_state_dict(json.loads(json.dumps(r.state_dict())))
    assert {**again.state_dict(), "budget": 80} == r.state_dict()  # the budget is the resumed run's own
    with pytest.raises(ValueError, match="sync_trigger"):
        RoundState("time", 4, (2, 2), position=0, window_s=1.0).load_state_dict(r.state_dict())


def test_round_state_counts_the_timed_steps_the_standalone_rates_divide_by():
    """A step the clock did not time (a run's first, the first after a resume) adds no
    seconds, so per-step times and the standalone rates divide by the timed steps only."""
    r = RoundState("speed", 4, (2, 2), position=0)
    r.close([[4, 0.3, 0.0, 3], [4, 1.5, 0.0, 3]], "tokens")  # the first step of the run: untimed
    assert r.timed_total == [3, 3] and r.seconds_per_step == pytest.approx([0.1, 0.5])
    r.close([[20, 2.0, 0.1, 20], [4, 2.0, 0.0, 4]], "tokens")
    assert r.timed_total == [23, 7] and r.summary()["timed_steps"] == [23, 7]
    again = RoundState("speed", 4, (2, 2), position=0)
    again.load_state_dict(json.loads(json.dumps(r.state_dict())))
    assert again.timed_total == [23, 7]
    old = {k: v for k, v in r.state_dict().items() if k not in ("timed_total", "timed")}  # an older checkpoint
    again.load_state_dict(old)
    assert again.timed_total == again.group_steps == [24, 8]


def test_round_state_of_a_torchft_quorum_rows_by_group_index():
    """torchft: the table has one row per group of the quorum, in the quorum's order, each
    naming its group; the counters are kept by group index, a group missing from the quorum
    counts nothing and the next round is planned from the groups present."""
    r = RoundState("speed", 4, (2, 2, 2), position=2)
    r.budget = 100 * 6
    assert r.vector(0.5)[-1] == 2.0  # this group's index travels with its row
    w = r.close([[8, 0.8, 0.0, 8, 2], [4, 0.8, 0.0, 4, 0]], "tokens")  # group 1 is down; rows in quorum order
    assert w == pytest.approx((2 / 3, 1 / 3))  # per row: group 2 trained 8 steps, group 0 4
    assert r.group_steps == [4, 0, 8] and r.rounds == [[4, 0, 8]] and r.tokens == 24
    assert r.seconds_per_step == pytest.approx([0.2, 0.0, 0.1])
    assert r.plan == [4, 4, 8] and r.round_steps == 8  # from the groups present; group 1 (no measurement): H
    # a failed exchange: only this group's row is filled in (the others' group index is -1)
    w = r.close([[0, 0, 0, 0, -1], [8, 0.8, 0.1, 8, 2], [0, 0, 0, 0, -1]], "tokens")
    assert w == (0.0, 1.0, 0.0) and r.group_steps == [4, 0, 16] and r.tokens == 40
    r.budget = 40 + 24 + 20  # after the next round 20 rank-steps are left: the last round, shared by the two
    r.close([[4, 0.8, 0.0, 4, 0], [8, 0.8, 0.0, 8, 2]], "tokens")  # groups present (group 1: nothing)
    assert not r.done and r.plan[0] < r.plan[2] and sum(2 * n for f, n in enumerate(r.plan) if f != 1) == pytest.approx(20, abs=2)
    for bad in ([[1, 0, 0, 1, 0], [1, 0, 0, 1, 0]], [[1, 0, 0, 1, 3]], [[0, 0, 0, 0, -1]]):
        with pytest.raises(ValueError, match="names groups"):
            r.close(bad, "tokens")


def test_round_state_take_over_of_a_healing_group():
    """A heal loads the live group's round state but keeps this group's index and enters the
    round with no steps of its own (its "tokens" weight is 0)."""
    live = RoundState("speed", 4, (2, 2), position=0)
    live.close([[4, 0.4, 0.0, 4, 0], [4, 0.8, 0.0, 4, 1]], "tokens")
    live.steps, live.train_s, live.timed = 8, 0.8, 8
    healing = RoundState("speed", 4, (2, 2), position=1)
    healing.steps, healing.train_s = 3, 0.6
    healing.take_over(json.loads(json.dumps(live.state_dict())))
    assert healing.position == 1 and healing.plan == live.plan == [8, 4] and healing.round_steps == 4
    assert healing.tokens == live.tokens and healing.group_steps == live.group_steps
    assert (healing.steps, healing.train_s, healing.timed) == (0, 0.0, 0)
    w = healing.close([[8, 0.8, 0.0, 8, 0], healing.vector(0.0)], "tokens")
    assert w == (1.0, 0.0)


def test_time_trigger_by_window_and_progress():
    r = RoundState("time", 8, (2, 4), position=0, window_s=1.5)
    assert r.round_steps is None and not r.time_up()
    r.steps, r.train_s = 3, 1.5
    assert r.time_up()
    assert r.progress_steps() == pytest.approx(3.0)  # 3 own steps extrapolated to every group
    r.close([[3, 1.5, 0.0], [1, 1.6, 0.0]], "tokens")
    assert r.plan is None and r.tokens == 3 * 2 + 1 * 4
    assert r.progress_steps() == pytest.approx(10 / 6)


def test_step_sleep_hook_spec():
    """FL_ACCEL_TEST_STEP_SLEEP (recipes/testing_hooks.py): seconds or x<factor> per group."""
    from recipes.args import RecipeError
    from recipes.testing_hooks import parse_sleep

    assert parse_sleep("0,0.25", 1) == (0.25, False)
    assert parse_sleep("0,x2", 1) == (2.0, True) and parse_sleep("0,x2", 0) == (0.0, False)
    assert parse_sleep("0.5", 3) == (0.0, False)
    for bad in ("fast", "0,-1", "0,x-2"):
        with pytest.raises(RecipeError, match="FL_ACCEL_TEST_STEP_SLEEP"):
            parse_sleep(bad, 0)


def test_merge_weights_drop_the_copies_of_a_heal():
    """Groups healed in a torchft quorum hold their source's values: weight 0, the others share
    1 as if they were all (1/(F - H) exactly under "uniform"); all copies, or no tokens left
    without them: the copies are ignored."""
    assert merge_weights("uniform", None, (1,) * 5, copies=[1, 3]) == (1 / 3, 0.0, 1 / 3, 0.0, 1 / 3)
    assert merge_weights("tokens", [4, 0, 4], [2, 2, 2], copies=[1]) == (0.5, 0.0, 0.5)
    assert merge_weights("size", None, [2, 4], copies=[0]) == (0.0, 1.0)
    assert merge_weights("size", None, [2, 4], copies=[0, 1]) == pytest.approx((1 / 3, 2 / 3))
    assert merge_weights("tokens", [0, 4], [2, 2], copies=[1]) == (0.0, 1.0)
