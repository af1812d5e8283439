"""Federation groups of unequal speed (``FLConfig.sync_trigger`` "speed"/"time"): exact
numerics with an injected per-round plan, the real triggers with a slowed group, and a
resume after a round, on 4 gloo processes (FL+FSDP, 2 groups x 2 ranks).

Launches: ``four`` (the plan scenarios with ``avg`` and ``nesterov``, the "speed" and
"time" triggers with group 1 slowed by a documented sleep per step, a checkpoint after
round 1) and ``resumed`` (the "avg" plan resumed from that checkpoint).
"""

from __future__ import annotations

import sys

import pytest
import torch

from _launch import WORKERS, run_torchrun, write_json
from fl_accel.mesh import FLLayout

sys.path.insert(0, str(WORKERS))
import unequal_worker as U  # noqa: E402  (the model and data the workers use)

WORKER = WORKERS / "speed_worker.py"
WORLD, TOL = 4, 1e-6
LAYOUT = FLLayout((2, 2), 2, "fl_fsdp")
PLAN = [[3, 1], [2, 4], [1, 3]]  # steps of group 0 and group 1 per round
MAX_STEPS = 7  # budget: 7 x 4 rank-steps = 28 = 2 x (4 + 6 + 4)
SPEED = {"algorithm": "fl_fsdp", "num_groups": 2, "sync_every": 4, "sync_trigger": "speed"}


BAD_CONFIGS = [  # (case, FLConfig kwargs, what the message must name)
    ("window_zero", {**SPEED, "sync_trigger": "time", "sync_window_s": 0.0}, ["FLConfig.sync_window_s"]),
    ("no_groups", {**SPEED, "algorithm": "fsdp"}, ["FLConfig.sync_trigger", "'fsdp'"]),
    ("fragments", {**SPEED, "num_fragments": 2}, ["FLConfig.num_fragments=2", "sync_trigger='speed'"]),
]


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    out = tmp_path_factory.mktemp("speed")
    spec = {"bad_configs": [{"name": n, "fl": fl} for n, fl, _ in BAD_CONFIGS], "scenarios": [
        {"name": "avg", "fl": SPEED, "max_steps": MAX_STEPS, "plan": PLAN, "save_after_round": 1,
         "save_dir": str(out / "ckpt" / "round_1")},
        {"name": "nesterov", "fl": {**SPEED, "outer_optimizer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.9},
         "max_steps": MAX_STEPS, "plan": PLAN},
        {"name": "int8_nesterov", "fl": {**SPEED, "sync_dtype": "int8", "error_feedback": True,
                                         "outer_optimizer": "nesterov"}, "max_steps": MAX_STEPS, "plan": PLAN},
        {"name": "speed_slowed", "fl": SPEED, "max_steps": 24, "plan": None, "slow_factor": [0.0, 2.0]},
        # a window of a few fast steps whatever the machine's load, so that the budget takes >= 2 rounds
        {"name": "time_slowed", "fl": {**SPEED, "sync_trigger": "time", "sync_window_s": 0.6}, "max_steps": 24,
         "plan": None, "slow_factor": [0.0, 2.0]},
        {"name": "barrier_slowed", "fl": {**SPEED, "sync_trigger": "steps"}, "max_steps": 8, "plan": None,
         "slow_factor": [0.0, 2.0]},
    ]}
    res = run_torchrun(WORLD, WORKER, write_json(out / "spec.json", spec), out, timeout=400)
    assert res.returncode == 0, res.tail()
    return out


@pytest.fixture(scope="module")
def resumed(four, tmp_path_factory):
    out = tmp_path_factory.mktemp("speed_resumed")
    spec = {"scenarios": [{"name": "avg_resumed", "fl": SPEED, "max_steps": MAX_STEPS, "plan": PLAN,
                           "load": str(four / "ckpt" / "round_1")}]}
    res = run_torchrun(WORLD, WORKER, write_json(out / "spec.json", spec), out, timeout=300)
    assert res.returncode == 0, res.tail()
    return out


def records(out, name) -> list[dict]:
    return [torch.load(out / name / f"rank{k}.pt", weights_only=False) for k in range(WORLD)]


def full(recs, key, f: int) -> list[torch.Tensor]:
    """Group f's full parameters (its 2 dim-0 shards) at its own step ``key`` (or "init"/"final")."""
    shards = [next(r for r in recs if r["coords"] == [f, 0, s]) for s in range(2)]
    pick = (lambda r: r["steps"][key]) if isinstance(key, int) else (lambda r: r[key])
    return [torch.cat(parts, dim=0) for parts in zip(*(pick(r) for r in shards))]


def max_diff(a, b) -> float:
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))


def simulate(recs, plan, outer=None) -> dict:
    """The exact single-process reference: in round k group f takes ``plan[k][f]`` SGD steps
    (lr 1) on the mean loss of its ranks' batches, in its own order; then every group becomes
    the mean weighted by tokens, w_f = 2 n_f / sum_g 2 n_g ("avg"), or the outer Nesterov step
    on the anchor with g = anchor - that mean (``outer``: (lr, momentum)). Returns
    ``{(f, t): params}`` after group f's own step t, and the weights per round."""
    tokens = U.token_table()
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(U.build_model())
    opts = [torch.optim.SGD(m.parameters(), lr=1.0, momentum=0.0) for m in models]
    anchor = [p.detach().clone() for p in models[0].parameters()]
    outer_opt = None
    if outer is not None:
        anchor = [torch.nn.Parameter(a) for a in anchor]
        outer_opt = torch.optim.SGD(anchor, lr=outer[0], momentum=outer[1], nesterov=True)
    steps, hist, weights = [0, 0], {}, []
    for n in plan:
        for f, m in enumerate(models):
            ranks = LAYOUT.group_ranks(f)
            for _ in range(n[f]):
                t = steps[f]
                batch = [tokens[recs[k]["index_batches"][t % len(recs[k]["index_batches"])]] for k in ranks]
                loss = sum(m(input_ids=x, labels=x).loss for x in batch) / len(batch)
                loss.backward()
                opts[f].step()
                opts[f].zero_grad()
                steps[f] += 1
                hist[(f, steps[f])] = [p.detach().clone() for p in m.parameters()]
        w = [2 * n[f] / sum(2 * k for k in n) for f in range(2)]
        weights.append(w)
        with torch.no_grad():
            for i, ps in enumerate(zip(*(m.parameters() for m in models))):
                mean = sum(wf * p.detach() for wf, p in zip(w, ps))
                if outer_opt is not None:
                    anchor[i].grad = anchor[i].detach() - mean
                    mean = None
                for p in ps:
                    if mean is not None:
                        p.copy_(mean)
            if outer_opt is not None:
                outer_opt.step()
                outer_opt.zero_grad()
                for i, ps in enumerate(zip(*(m.parameters() for m in models))):
                    for p in ps:
                        p.copy_(anchor[i])
        for f in range(2):
            hist[(f, steps[f])] = [p.detach().clone() for p in models[f].parameters()]
    return {"hist": hist, "weights": weights}


@pytest.mark.parametrize("scenario,outer", [("avg", None), ("nesterov", (0.7, 0.9))])
def test_rounds_of_unequal_length_equal_exact_simulation_at_every_step(four, scenario, outer):
    """With the per-round plan [[3, 1], [2, 4], [1, 3]] injected (sync_trigger "speed",
    ``_scenario.inject_round_plan``), every rank's parameters equal the single-process simulation after
    every one of its own steps (after the hook: after the sync at a round's last step), the
    merge weights are the tokens' shares (3/4, 1/4; 1/3, 2/3; 1/4, 3/4), and the run stops
    after the round that reaches the budget of 7 steps x 4 ranks. Not vacuous: the groups
    differ before a sync by far more than the tolerance, and uniform weights would give a
    mean farther than the tolerance from the token-weighted one."""
    recs = records(four, scenario)
    sim = simulate(recs, PLAN, outer)
    own_steps = [sum(n[f] for n in PLAN) for f in range(2)]
    for rec in recs:
        f = rec["coords"][0]
        assert sorted(rec["steps"]) == list(range(1, own_steps[f] + 1)), (scenario, f, sorted(rec["steps"]))
        ends = sorted(rec["weights"])
        assert ends == [sum(n[f] for n in PLAN[:k + 1]) for k in range(len(PLAN))], ends
        for k, t in enumerate(ends):
            assert rec["weights"][t] == pytest.approx(sim["weights"][k], abs=1e-12), (k, rec["weights"][t])
        assert rec["rounds"]["steps_per_round"] == [[n[g] for n in PLAN] for g in range(2)]
        assert rec["rounds"]["num_rounds"] == 3 and rec["federation_step"] == MAX_STEPS
    worst = 0.0
    for f in range(2):
        for t in range(1, own_steps[f] + 1):
            d = max_diff(full(recs, t, f), sim["hist"][(f, t)])
            assert d <= TOL, (scenario, f, t, d)
            worst = max(worst, d)
        assert max_diff(full(recs, "final", f), sim["hist"][(f, own_steps[f])]) <= TOL
    # not vacuous: before the first sync the groups are apart ...
    assert max_diff(full(recs, 1, 0), full(recs, 1, 1)) > 1e3 * TOL
    # ... and after each sync they are equal
    assert max_diff(full(recs, 3, 0), full(recs, 1, 1)) == 0.0
    assert max_diff(full(recs, 5, 0), full(recs, 5, 1)) == 0.0


def test_token_weights_are_not_the_uniform_mean(four):
    """The merge in round 1 (3 steps against 1) differs from the uniform mean by more than the
    tolerance: the weights checked above decide the result."""
    recs = records(four, "avg")
    tokens = U.token_table()
    thetas = []
    for f, n in enumerate(PLAN[0]):
        torch.manual_seed(0)
        m = U.build_model()
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        for t in range(n):
            batch = [tokens[recs[k]["index_batches"][t]] for k in LAYOUT.group_ranks(f)]
            (sum(m(input_ids=x, labels=x).loss for x in batch) / len(batch)).backward()
            opt.step()
            opt.zero_grad()
        thetas.append([p.detach() for p in m.parameters()])
    weighted = [0.75 * a + 0.25 * b for a, b in zip(*thetas)]
    uniform = [0.5 * a + 0.5 * b for a, b in zip(*thetas)]
    assert max_diff(full(recs, 3, 0), weighted) <= TOL
    assert max_diff(weighted, uniform) > 1e2 * TOL


def test_resume_after_a_round_continues_exactly(four, resumed):
    """A checkpoint after round 1 (group steps 3 and 1) resumes into the same run: every later
    step of every rank is bitwise the uninterrupted run's, and the round summary matches."""
    base, again = records(four, "avg"), records(resumed, "avg_resumed")
    for b, a in zip(base, again):
        assert a["start"] == [3, 1][b["coords"][0]]
        assert sorted(a["steps"]) == [t for t in sorted(b["steps"]) if t > a["start"]]
        for t in a["steps"]:
            assert all(torch.equal(x, y) for x, y in zip(a["steps"][t], b["steps"][t])), t
        assert all(torch.equal(x, y) for x, y in zip(a["final"], b["final"]))
        assert a["rounds"]["steps_per_round"] == b["rounds"]["steps_per_round"]


@pytest.mark.parametrize("scenario", ["speed_slowed", "time_slowed"])
def test_slowed_group_does_fewer_steps_and_groups_stay_synced(four, scenario):
    """Group 1 sleeps twice each step's own time after it, 3x slower under any load (the
    documented test hook of the worker; the bench slows groups with a CPU quota instead). Under "speed" the fast group's H_f after the first
    round rises above the slow group's H=4; under "time" (0.6 s windows) it does fewer steps per
    round. Every round ends with the groups equal, and the run ends on the token budget."""
    recs = records(four, scenario)
    rounds = recs[0]["rounds"]
    fast, slow = rounds["steps_per_round"]
    assert all(r["rounds"]["steps_per_round"] == rounds["steps_per_round"] for r in recs)
    assert rounds["num_rounds"] >= 2, rounds
    n = rounds["num_rounds"]
    if scenario == "speed_slowed":  # after the first round (H each) every round, the budget's last one included,
        later = range(1, n)  # follows the measured rates
    else:
        later = range(1, n - 1) if n > 2 else range(0, 1)
    assert sum(slow[k] for k in later) < sum(fast[k] for k in later), rounds  # summed: one round may be noisy
    if scenario == "speed_slowed":
        assert fast[0] == slow[0] == 4  # the first round: H for every group
        assert all(slow[k] == 4 for k in range(1, n - 1)), rounds  # then the slow group does H, the fast one more
    assert all(0 <= w < 1 for w in rounds["wait_share"]), rounds
    if scenario == "time_slowed":  # the fast group waits at most about one slow step per 0.6 s window
        # (measured in the run's own step times, not in seconds: a loaded machine stretches steps)
        slow_step_s = rounds["train_s"][1] / rounds["timed_steps"][1]
        assert rounds["wait_s"][0] <= 2 * n * slow_step_s + 0.05 * n, (rounds, slow_step_s)
        assert rounds["wait_s"][0] > rounds["wait_s"][1], rounds  # the fast group is the one that waits
    for r in recs:  # the wait for the others to arrive is part of the time in syncs
        assert 0 < r["arrival_s"] <= r["sync_s"] + 1e-9, r["arrival_s"]
    assert rounds["rank_steps"] == pytest.approx(24 * WORLD, abs=2 * 2), rounds
    for rec in recs:
        ends = sorted(rec["weights"])
        assert len(ends) == rounds["num_rounds"]
    g0 = [r for r in recs if r["coords"][0] == 0][0]
    g1 = [r for r in recs if r["coords"][0] == 1][0]
    for e0, e1 in zip(sorted(g0["weights"]), sorted(g1["weights"])):
        assert all(torch.equal(a, b) for a, b in zip(g0["steps"][e0], g1["steps"][e1])), (e0, e1)


def test_arrival_wait_is_what_the_fast_group_loses_at_a_barrier(four):
    """``sync_trigger="steps"`` with group 1 three times slower (the sleep hook): every sync's
    first world collective is where the fast group waits for the slow one, so the fast group's
    ranks spend most of their loop there (2 of every 3 seconds, less the exchange) and the
    slow group's hardly any; both are part of the time in syncs."""
    recs = records(four, "barrier_slowed")
    assert recs[0]["rounds"] is None  # the barrier: no rounds
    share = {r["coords"][0]: r["arrival_s"] / r["loop_s"] for r in recs}
    fast = [r["arrival_s"] / r["loop_s"] for r in recs if r["coords"][0] == 0]
    slow = [r["arrival_s"] / r["loop_s"] for r in recs if r["coords"][0] == 1]
    assert min(fast) > 0.3 and max(slow) < 0.5 * min(fast), share
    assert all(0 < r["arrival_s"] <= r["sync_s"] + 1e-9 for r in recs)


@pytest.mark.parametrize("case,fl,needles", BAD_CONFIGS)
def test_bad_trigger_settings_raise_on_every_rank_before_any_collective(four, case, fl, needles):
    """A window of 0 s, a trigger with an algorithm that has no groups, and fragments with a
    trigger raise ValueError naming the field on all 4 ranks, with no process group created."""
    import json

    for k in range(WORLD):
        rec = json.loads((four / "bad" / case / f"rank{k}.json").read_text())
        assert rec["type"] == "ValueError" and all(n in rec["message"] for n in needles), rec
        assert rec["dist_initialized"] is False, rec


def test_compressed_exchange_with_rounds_of_unequal_length(four):
    """int8 + error feedback + nesterov on the same plan: the merge weights are the tokens'
    shares, the groups are equal after every sync (the decoded mean is the same everywhere),
    and after end_training's exact final sync (residuals included) as well."""
    recs = records(four, "int8_nesterov")
    for rec in recs:
        ends = sorted(rec["weights"])
        got = [w for t in ends for w in rec["weights"][t]]
        assert got == pytest.approx([0.75, 0.25, 1 / 3, 2 / 3, 0.25, 0.75])
    for t0, t1 in ((3, 1), (5, 5), (6, 8)):  # the rounds' last steps of group 0 and group 1
        assert max_diff(full(recs, t0, 0), full(recs, t1, 1)) == 0.0, (t0, t1)
    assert max_diff(full(recs, "final", 0), full(recs, "final", 1)) == 0.0
    assert max_diff(full(recs, 2, 0), full(recs, 1, 1)) > 1e3 * TOL  # apart mid-round
