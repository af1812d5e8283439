"""Unequal federation groups (``FLConfig.group_sizes``): layout checks, exact numerics,
bytes, checkpoints, data sharding and the recipe, on 6 (and 4) gloo processes.

The main layout is ``group_sizes=[2, 4]``, ``hsdp_shard_size`` S=2, H=3 on 6 ranks:
group 0 = ranks 0-1 (R_0 = 1 replica), group 1 = ranks 2-5 (R_1 = 2 replicas); the shard
is exchanged in C = R_min = 1 chunk, by replica 0 of each group, and replica 1 of group 1
receives it by a broadcast inside its group.

Launches (each costs ~10-15 s of start-up on a 2-core box, so scenarios are batched):

* ``six``: the launched bad-config check, then 3 training scenarios (size weights with
  global data; uniform weights with group data; AdamW + DiLoCo outer step, saving at
  steps 3 and 4);
* ``resumed`` (6 fresh processes): load the step-4 checkpoint into [4, 2] (must fail),
  resume from steps 4 and 3 in [2, 4] (must be bitwise the same run);
* ``four`` (4 processes): the equal layout [2, 2] with the same S, for the bytes
  comparison, and a load of the [2, 4] checkpoint (must fail);
* the recipe through ``accelerate launch`` (3 real processes, groups of 1 and 2), and the CPU launch
  files as Accelerate reads them.
"""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

from _launch import REPO_ROOT, WORKERS, free_port, launch_env, run_torchrun, write_json
from fl_accel import FLConfig
from scripts.launch import run as run_cmd
from fl_accel.mesh import DP_REPLICATE, DP_SHARD, FL, FLLayout
from workers._scenario import validated
from recipes.run_folder import read_metrics

sys.path.insert(0, str(WORKERS))
import unequal_worker as W  # noqa: E402  (the model and data the workers use)

WORKER = WORKERS / "unequal_worker.py"
WORLD = 6
H, STEPS, LR_SGD = 3, 7, 1.0
UNEQUAL = {"algorithm": "fl_hsdp", "group_sizes": [2, 4], "hsdp_shard_size": 2, "sync_every": H}
TOL = 1e-6
SPARSE = {**UNEQUAL, "sync_dtype": "sparse", "error_feedback": True}
SPEED_PLAN = [[3, 1], [1, 2]]  # steps of group 0 (2 ranks) and group 1 (4 ranks) per round; budget 3 x 6 = 18 rank-steps: 2 rounds
MEASURED: dict[str, float] = {}  # figures printed at the end of the module (pytest -s)


def _sc(name, fl, optimizer="sgd", lr=LR_SGD, **extra):
    return {"name": name, "fl": fl, "optimizer": optimizer, "lr": lr, "steps": STEPS, **extra}


BAD_CONFIGS = [  # (case, FLConfig kwargs, what the message must contain)
    ("sizes_do_not_sum_to_world", {"algorithm": "fl_hsdp", "group_sizes": [2, 2], "hsdp_shard_size": 2},
     ["FLConfig.group_sizes", "world size is 6"]),
    ("size_not_divisible_by_S", {"algorithm": "fl_hsdp", "group_sizes": [2, 4], "hsdp_shard_size": 4},
     ["FLConfig.hsdp_shard_size=4", "[2]"]),
    ("fl_fsdp_unequal", {"algorithm": "fl_fsdp", "group_sizes": [2, 4]},
     ["FLConfig.group_sizes", "algorithm='fl_hsdp'", "hsdp_shard_size", "S=2"]),
    ("num_groups_disagrees", {**UNEQUAL, "num_groups": 3}, ["FLConfig.num_groups=3", "group_sizes=[2, 4]"]),
    ("S_missing", {"algorithm": "fl_hsdp", "group_sizes": [2, 4]}, ["FLConfig.hsdp_shard_size"]),
]


class Records:
    """Per-rank records of one launch, by scenario name."""

    def __init__(self, out, world, result):
        self.out, self.world, self.result = out, world, result

    def __call__(self, name: str) -> list[dict]:
        return [torch.load(self.out / name / f"rank{k}.pt", weights_only=False) for k in range(self.world)]


def _launch(world, out, spec, timeout=300) -> Records:
    res = run_torchrun(world, WORKER, write_json(out / "spec.json", spec), out, timeout=timeout)
    assert res.returncode == 0, res.tail()
    MEASURED[f"launch {out.name} ({world} proc) s"] = res.seconds
    return Records(out, world, res)


@pytest.fixture(scope="module")
def six(tmp_path_factory):
    out = tmp_path_factory.mktemp("six")
    spec = {"bad_configs": [{"name": n, "fl": fl} for n, fl, _ in BAD_CONFIGS], "scenarios": [
        _sc("size", UNEQUAL),
        _sc("uniform", {**UNEQUAL, "group_weighting": "uniform", "data_sharding": "group"}),
        _sc("ckpt", {**UNEQUAL, "outer_optimizer": "nesterov"}, "adamw", 1e-2, save_at=[3, 4],
            save_dir=str(out / "ckpt_dir")),
        _sc("sparse", SPARSE),
        _sc("speed_plan", {**UNEQUAL, "sync_trigger": "speed", "outer_optimizer": "nesterov"}, steps=3,
            plan=SPEED_PLAN),
    ]}
    return _launch(WORLD, out, spec)


@pytest.fixture(scope="module")
def resumed(six, tmp_path_factory):
    out = tmp_path_factory.mktemp("resumed")
    ckpt = six.out / "ckpt_dir"
    spec = {"scenarios": [
        _sc("into_4_2", {**UNEQUAL, "group_sizes": [4, 2], "outer_optimizer": "nesterov"}, "adamw", 1e-2,
            load=str(ckpt / "step_4"), expect_load_error=True),
        _sc("resume_4", {**UNEQUAL, "outer_optimizer": "nesterov"}, "adamw", 1e-2, load=str(ckpt / "step_4")),
        _sc("resume_3", {**UNEQUAL, "outer_optimizer": "nesterov"}, "adamw", 1e-2, load=str(ckpt / "step_3")),
    ]}
    return _launch(WORLD, out, spec)


@pytest.fixture(scope="module")
def four(six, tmp_path_factory):
    out = tmp_path_factory.mktemp("four")
    equal = {**UNEQUAL, "group_sizes": [2, 2]}
    spec = {"scenarios": [
        _sc("into_2_2", {**equal, "outer_optimizer": "nesterov"}, "adamw", 1e-2,
            load=str(six.out / "ckpt_dir" / "step_4"), expect_load_error=True),
        _sc("equal", equal),
    ]}
    return _launch(4, out, spec)


# ====================================================================== helpers
def by_coord(recs) -> dict[tuple[int, int, int], dict]:
    return {tuple(rec["coords"]): rec for rec in recs}


def full_params(recs, key, f: int, r: int, S: int = 2) -> list[torch.Tensor]:
    """Full parameters of group f / replica r from its S dim-0 shards (FSDP2 shards dim 0
    like torch.chunk and ``to_local()`` is unpadded), at ``key``: a step number, "init"
    or "final"."""
    coords = by_coord(recs)
    shards = [coords[(f, r, s)] for s in range(S)]
    pick = (lambda rec: rec["steps"][key]) if isinstance(key, int) else (lambda rec: rec[key])
    return [torch.cat(parts, dim=0) for parts in zip(*(pick(rec) for rec in shards))]


def max_diff(a, b) -> float:
    assert len(a) == len(b)
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))


def group_batches(recs, layout: FLLayout) -> list[list[list[torch.Tensor]]]:
    """[f][t] -> the token batches of group f's ranks at step t, in rank order."""
    tokens = W.token_table()
    out = []
    for f in range(layout.num_groups):
        ranks = layout.group_ranks(f)
        out.append([[tokens[recs[k]["index_batches"][t]] for k in ranks] for t in range(STEPS)])
    return out


def simulate(batches, weights, average, sync_all=None) -> dict:
    """The exact single-process reference: group f trains on the mean loss of its own
    ranks' batches (one SGD step, lr LR_SGD, no momentum); after every H-th step and at
    the end (``end_training``) every group becomes ``average(thetas)`` (parameter by
    parameter), or ``sync_all(models, final)`` does the sync (``final``: end_training's)."""
    models = []
    for _ in batches:
        torch.manual_seed(0)
        models.append(W.build_model())
    opts = [torch.optim.SGD(m.parameters(), lr=LR_SGD, momentum=0.0) for m in models]

    def params(m):
        return [p.detach().clone() for p in m.parameters()]

    def sync(final=False):
        if sync_all is not None:
            return sync_all(models, final)
        with torch.no_grad():
            for ps in zip(*(m.parameters() for m in models)):
                mean = average([p.detach() for p in ps])
                for p in ps:
                    p.copy_(mean)

    hist = {"init": [params(m) for m in models], "names": [n for n, _ in models[0].named_parameters()]}
    for t in range(STEPS):
        for m, opt, b in zip(models, opts, batches):
            loss = sum(m(input_ids=x, labels=x).loss for x in b[t]) / len(b[t])
            loss.backward()
            opt.step()
            opt.zero_grad()
        if (t + 1) % H == 0:
            sync()
        hist[t + 1] = [params(m) for m in models]
    sync(final=True)  # end_training: step 7 left the groups apart
    hist["final"] = [params(m) for m in models]
    return hist


LAYOUT = FLLayout((2, 4), 2, "fl_hsdp")


# ====================================================================== 3. bad layouts, no processes
@pytest.mark.parametrize("case,fl,needles", BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
def test_bad_layout_raises_naming_the_field(case, fl, needles):
    """FLConfig (construction) or its layout check for 6 ranks raises ValueError whose
    message names the field (and, for fl_fsdp, suggests fl_hsdp with an S)."""
    with pytest.raises(ValueError) as info:
        validated(FLConfig(**fl), WORLD)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def test_layout_arithmetic_of_2_4():
    """Coordinates, axis groups, chunk count and weights of [2, 4] with S=2; a good
    config validates on 6 ranks and builds this layout."""
    cfg = validated(FLConfig(**UNEQUAL), WORLD)
    assert FLLayout.from_config(cfg, WORLD) == LAYOUT
    assert [LAYOUT.coords(k) for k in range(6)] == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert [LAYOUT.replicas_of(f) for f in (0, 1)] == [1, 2] and LAYOUT.min_replicas == 1
    assert LAYOUT.axis_groups(DP_SHARD) == [(0, 1), (2, 3), (4, 5)]
    assert LAYOUT.axis_groups(DP_REPLICATE) == [(0,), (1,), (2, 4), (3, 5)]
    assert LAYOUT.axis_groups(FL) == [(0, 2), (1, 3)]  # replica 0 of each group; ranks 4, 5 take no part
    assert LAYOUT.axis_ranks(FL, 4) == LAYOUT.axis_ranks(FL, 5) == ()
    assert LAYOUT.weights("size") == pytest.approx((2 / 6, 4 / 6))
    assert LAYOUT.weights("uniform") == (0.5, 0.5)
    assert LAYOUT.sizes_label() == "G2_4" and LAYOUT.describe(3) == "fl_hsdp F=2 G=[2, 4] R=[1, 2] S=2 H=3"
    with pytest.raises(ValueError, match="group_size"):
        LAYOUT.group_size  # noqa: B018  (not defined for unequal groups)
    # groups of 2 and 3 replicas: 2 chunks, owned by replicas 0 and 1 of each group
    big = FLLayout((4, 6), 2, "fl_hsdp")
    assert big.min_replicas == 2 and big.axis_groups(FL) == [(0, 4), (1, 5), (2, 6), (3, 7)]


# ====================================================================== 3. bad layouts, launched
@pytest.mark.parametrize("case,fl,needles", BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
def test_bad_layout_raises_on_every_rank_before_any_collective(six, case, fl, needles):
    """In a 6-process launch, FLAccelerator(FLConfig(...)) raises ValueError naming the
    field on every rank, and torch.distributed is still uninitialized afterwards (the
    bad cases run before anything else in that launch): no rank can hang in a collective."""
    for k in range(WORLD):
        rec = json.loads((six.out / "bad" / case / f"rank{k}.json").read_text())
        assert rec["type"] == "ValueError" and all(n in rec["message"] for n in needles), rec
        assert rec["dist_initialized"] is False, rec


# ====================================================================== 1. exact numerics
@pytest.mark.parametrize("scenario,weighting", [("size", "size"), ("uniform", "uniform")])
def test_unequal_groups_equal_exact_simulation_at_every_step(six, scenario, weighting):
    """Every rank's parameters equal a single-process simulation after every step (after
    the hook, so after the syncs at steps 3 and 6) and after end_training's final sync:
    group f trains on the mean loss of its ranks' batches; a sync makes every group
    (2 theta_0 + 4 theta_1) / 6 ("size") or (theta_0 + theta_1) / 2 ("uniform").
    Replicas of group 1 are bitwise identical at every step. Not vacuous: just before a
    sync the groups differ by far more than the tolerance, and the weighted mean differs
    from the other weighting's mean by more than the tolerance."""
    recs = six(scenario)
    if weighting == "size":
        average = lambda ts: (2 * ts[0] + 4 * ts[1]) / 6  # noqa: E731
    else:
        average = lambda ts: (ts[0] + ts[1]) / 2  # noqa: E731
    sim = simulate(group_batches(recs, LAYOUT), LAYOUT.weights(weighting), average)
    assert recs[0]["names"] == sim["names"]
    worst = 0.0
    for key in ["init", *range(1, STEPS + 1), "final"]:
        for f in (0, 1):
            for r in range(LAYOUT.replicas_of(f)):
                got = full_params(recs, key, f, r)
                d = max_diff(got, sim[key][f])
                assert d <= TOL, (scenario, key, f, r, d)
                worst = max(worst, d)
        coords = by_coord(recs)
        pick = (lambda rec: rec["steps"][key]) if isinstance(key, int) else (lambda rec: rec[key])
        for s in range(2):
            assert all(torch.equal(a, b) for a, b in zip(pick(coords[(1, 0, s)]), pick(coords[(1, 1, s)]))), key
    MEASURED[f"max |fl_accel - simulation| ({scenario})"] = worst
    # not vacuous: the groups are apart before a sync, equal right after it
    apart = max_diff(full_params(recs, 5, 0, 0), full_params(recs, 5, 1, 0))
    assert apart > 1e3 * TOL, apart
    MEASURED[f"group 0 vs 1 before the sync at step 6 ({scenario})"] = apart
    assert max_diff(full_params(recs, 6, 0, 0), full_params(recs, 6, 1, 0)) == 0.0
    # ... and the weighting matters: the other rule's mean is more than TOL away
    other = (lambda ts: (ts[0] + ts[1]) / 2) if weighting == "size" else (lambda ts: (2 * ts[0] + 4 * ts[1]) / 6)
    pre = [full_params(recs, 5, f, 0) for f in (0, 1)]
    assert max_diff(full_params(recs, 3, 0, 0), sim[3][0]) <= TOL
    assert max(max_diff([other([a, b])], [average([a, b])]) for a, b in zip(*pre)) > 1e2 * TOL


def test_unequal_groups_sparse_equals_simulation(six):
    """sync_dtype "sparse" + error feedback on [2, 4] (weights 1/3, 2/3; replica 0 of each
    group sends, replica 1 of group 1 receives its chunk by a broadcast): every rank equals
    a single-process simulation (top-k, 2-bit codes, decayed error feedback and the weighted
    mean over the senders of tests/dist/test_streaming_sync.py; at the end the exact fp32 sync of
    pseudo-gradient + residual) after every step and at the end (<= 1e-6), the groups are
    identical after each sync, and the uniform weights (1/2, 1/2) miss it."""
    from test_streaming_sync import sparse_mean

    recs = six("sparse")
    cfg = FLConfig(**SPARSE)

    def run(weights):
        state = {}

        def sync_all(models, final):
            thetas = [list(m.parameters()) for m in models]
            state.setdefault("anchor", [p.detach().clone() for p in W_init])
            state.setdefault("residual", [[torch.zeros_like(p) for p in W_init] for _ in models])
            idx = list(range(len(W_init)))
            with torch.no_grad():
                if final and cfg.final_sync == "exact":
                    res, beta = state["residual"], cfg.residual_decay
                    mean = [sum(w * (state["anchor"][i] - th[i] + beta * res[g][i])
                                for g, (w, th) in enumerate(zip(weights, thetas))) for i in idx]
                    for r in res:
                        for t in r:
                            t.zero_()
                else:
                    mean = sparse_mean(state["anchor"], thetas, state["residual"], idx, cfg, 2, list(weights))
                for i in idx:
                    state["anchor"][i] = state["anchor"][i] - mean[i]
                    for th in thetas:
                        th[i].copy_(state["anchor"][i])

        return simulate(group_batches(recs, LAYOUT), weights, None, sync_all)

    torch.manual_seed(0)
    W_init = [p.detach().clone() for p in W.build_model().parameters()]
    sim = run(LAYOUT.weights("size"))
    worst = 0.0
    for key in ["init", *range(1, STEPS + 1), "final"]:
        for f in (0, 1):
            for r in range(LAYOUT.replicas_of(f)):
                worst = max(worst, max_diff(full_params(recs, key, f, r), sim[key][f]))
    MEASURED["max |fl_accel - sparse simulation| ([2, 4])"] = worst
    assert worst <= TOL, worst
    assert max_diff(full_params(recs, 6, 0, 0), full_params(recs, 6, 1, 0)) == 0.0
    uniform = run((0.5, 0.5))
    miss = max(max_diff(full_params(recs, k, 0, 0), uniform[k][0]) for k in range(1, STEPS + 1))
    assert miss > 1e-3, miss


# ====================================================================== 2. bytes
def _sync_fl_bytes(rec, step):
    prev = rec["comm"][step - 1]["fl"] if step > 1 else 0
    return rec["comm"][step]["fl"] - prev


def test_fl_bytes_at_a_sync_equal_the_equal_layout_and_cost_model(six, four):
    """Bytes on the "fl" axis per rank at a sync (from acc.comm_stats inside meter_comm):

    * replica 0 of each group sends 2 (F-1)/F x 4 bytes x its local shard (C = R_min = 1
      chunk), only at sync steps (3, 6 and end_training); ranks 4, 5 (replica 1 of group
      1) send nothing on "fl", ever, and receive the shard by one broadcast over
      "dp_replicate" ((R-1)/R x 4 n bytes);
    * "the equal-size layout with the same S" is F groups of the smallest size, [2, 2]
      (R = R_min = 1, the same chunking): the unequal layout's figure is at most, and in
      fact exactly, that layout's for the same shard coordinate, measured on 4 processes;
    * fl_accel.planning.cost.estimate of [2, 4] predicts the busiest rank's figure (shard 0)
      to the byte (the meter floors each call to whole bytes)."""
    from fl_accel.planning.cost import estimate
    from fl_accel.planning.units import units_from_module

    recs, equal = by_coord(six("size")), by_coord(four("equal"))
    world_flags = 13  # 2 (N-1)/N x 4 bytes x F flags, the non-finite check, on "world"
    for (f, r, s), rec in recs.items():
        n = sum(t.numel() for t in rec["init"])
        for step in range(1, STEPS + 1):
            expected = 4 * n if step % H == 0 and r == 0 else 0
            assert _sync_fl_bytes(rec, step) == expected, (f, r, s, step)
            if step % H == 0:
                assert rec["comm"][step]["world"] - rec["comm"][step - 1]["world"] == world_flags
        final = rec["final_comm"]["fl"] - rec["comm"][STEPS]["fl"]
        assert final == (4 * n if r == 0 else 0), (f, r, s)
        if f == 1:  # the broadcast of the whole shard from replica 0 inside group 1, per sync
            rep = rec["comm"][H]["dp_replicate"] - rec["comm"][H - 1]["dp_replicate"]
            grad_allreduce = rec["comm"][H - 1]["dp_replicate"] - rec["comm"][H - 2]["dp_replicate"]
            assert rep - grad_allreduce == 4 * n // 2, (f, r, s, rep, grad_allreduce)
        if r == 0:
            eq = equal[(f, 0, s)]
            assert sum(t.numel() for t in eq["init"]) == n
            assert _sync_fl_bytes(rec, H) <= _sync_fl_bytes(eq, H)
            assert _sync_fl_bytes(rec, H) == _sync_fl_bytes(eq, H)
    with torch.device("meta"):
        torch.manual_seed(0)
        units = units_from_module(W.build_model())
    model = estimate(LAYOUT, units, sync_every=H).sync_by_axis()
    busiest = max(_sync_fl_bytes(rec, H) for rec in recs.values())
    assert abs(model[FL] - busiest) <= 1, (model[FL], busiest)
    for name, layout in (("2_2", FLLayout((2, 2), 2, "fl_hsdp")), ("4_4", FLLayout((4, 4), 2, "fl_hsdp"))):
        MEASURED[f"cost model fl bytes/rank/sync [{name}]"] = estimate(layout, units, sync_every=H).sync_by_axis()[FL]
    MEASURED["measured fl bytes/rank/sync [2_4] (busiest)"] = busiest
    MEASURED["measured fl bytes/rank/sync [2_2] (busiest)"] = max(_sync_fl_bytes(r, H) for r in equal.values())
    MEASURED["cost model fl bytes/rank/sync [2_4]"] = model[FL]


# ====================================================================== 4. checkpoints
def test_checkpoint_refuses_another_layout(resumed, four):
    """A [2, 4] checkpoint loaded into [4, 2] (same world and S) and into [2, 2] (4
    processes) raises fl_accel's CheckpointError on every rank, naming the differing
    group sizes (and world size), before training starts."""
    for recs, theirs in ((resumed("into_4_2"), "[4, 2]"), (four("into_2_2"), "[2, 2]")):
        for rec in recs:
            err = rec["load_error"]
            assert err and err.startswith("CheckpointError") and "different setup" in err, err
            assert f"group_sizes=[2, 4] vs {theirs}" in err, err
            assert not rec["steps"], "training ran after a refused load"
    assert "world_size=6 vs 4" in four("into_2_2")[0]["load_error"]


@pytest.mark.parametrize("k", [4, 3], ids=["mid_round", "at_sync_boundary"])
def test_checkpoint_resumes_bitwise_into_the_same_layout(six, resumed, k):
    """AdamW inner, DiLoCo outer (anchor and momentum are state too), [2, 4]: loading
    step_k in fresh processes restores every rank's shards bitwise, and steps k+1..7 plus
    the final sync are bitwise those of the uninterrupted run. At step 4 (mid-round) the
    groups differ, so each group's own state must have come back."""
    full, again = six("ckpt"), resumed(f"resume_{k}")
    for a, b in zip(full, again):
        assert a["coords"] == b["coords"] and b["start"] == k and b["load_error"] is None
        assert a["index_batches"] == b["index_batches"]
        assert all(torch.equal(x, y) for x, y in zip(a["steps"][k], b["loaded"]))
        for key in [*range(k + 1, STEPS + 1)]:
            assert all(torch.equal(x, y) for x, y in zip(a["steps"][key], b["steps"][key])), (a["coords"], key)
        assert all(torch.equal(x, y) for x, y in zip(a["final"], b["final"]))
    if k == 4:
        assert max_diff(full_params(full, 4, 0, 0), full_params(full, 4, 1, 0)) > 1e-4


# ====================================================================== 5. data sharding
def _index_sets(recs):
    return [[i for batch in rec["index_batches"] for i in batch] for rec in recs]


def test_global_data_sharding_gives_six_disjoint_slices(six):
    """data_sharding="global": the 6 ranks' samples (one epoch of the prepared loader)
    are pairwise disjoint and together the whole dataset, 96 / 6 = 16 each."""
    sets = _index_sets(six("size"))
    assert all(len(s) == len(set(s)) == W.DATASET // WORLD for s in sets)
    assert sorted(i for s in sets for i in s) == list(range(W.DATASET))


def test_group_data_sharding_splits_the_whole_dataset_inside_each_group(six):
    """data_sharding="group": each group's ranks split the whole dataset among
    themselves (disjoint, complete): 96 / 2 = 48 samples per rank in group 0, 96 / 4 = 24
    in group 1; and each group shuffles in its own order (the loader shuffles, with
    Accelerate's default DataLoaderConfiguration): the first batch of group-local rank 0
    differs between the groups."""
    recs = six("uniform")
    sets = _index_sets(recs)
    for f in (0, 1):
        ranks = LAYOUT.group_ranks(f)
        assert all(len(sets[k]) == len(set(sets[k])) == W.DATASET // len(ranks) for k in ranks)
        assert sorted(i for k in ranks for i in sets[k]) == list(range(W.DATASET))
    first = [recs[LAYOUT.group_offset(f)]["index_batches"][0] for f in (0, 1)]
    assert first[0] != first[1], first


# ====================================================================== 6. the recipe
RECIPE = REPO_ROOT / "recipes" / "pretrain.py"
@pytest.fixture(scope="module")
def data_cache(default_corpus_cache):
    return default_corpus_cache  # filled before the launches (tests/conftest.py)


UNEQUAL_YAML = REPO_ROOT / "recipes" / "configs" / "cpu_fl_hsdp_unequal.yaml"


def test_unequal_recipe_yaml_parses_to_the_2_4_layout():
    """recipes/configs/cpu_fl_hsdp_unequal.yaml parses (recipe argument parser, no
    environment) into fl_hsdp, group_sizes [2, 4], S=2, and validates on 6 ranks."""
    from recipes.args import parse_args

    fl = parse_args(["--config", str(UNEQUAL_YAML)], environ={"WORLD_SIZE": str(WORLD)}).fl
    assert (fl.algorithm, fl.group_sizes, fl.hsdp_shard_size, fl.group_weighting) == ("fl_hsdp", [2, 4], 2, "size")
    assert FLLayout.from_config(validated(fl, WORLD), WORLD) == LAYOUT


@pytest.mark.parametrize("name,processes", [("cpu_4proc", 4), ("cpu_6proc", 6), ("cpu_8proc", 8)])
def test_cpu_accelerate_configs_are_fsdp2_launches_of_their_process_count(name, processes):
    """Accelerate's own reader (``load_config_from_file``, what ``accelerate launch
    --config_file`` reads) takes each CPU launch file as one machine of ``processes``
    processes under FSDP2."""
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(REPO_ROOT / "accelerate_configs" / f"{name}.yaml"))
    assert (cfg.num_processes, cfg.num_machines, cfg.distributed_type.value) == (processes, 1, "FSDP"), cfg
    assert str(cfg.fsdp_config["fsdp_version"]) == "2" and cfg.mixed_precision == "no", cfg.fsdp_config


def test_accelerate_launch_trains_unequal_groups_on_three_processes(tmp_path, data_cache):
    """``accelerate launch --config_file accelerate_configs/cpu_4proc.yaml --num_processes 3
    recipes/pretrain.py --algorithm fl_hsdp --group_sizes 1,2 --hsdp_shard_size 1
    --sync_every 3`` (4 steps) on this CPU-only machine runs 3 processes, not one, in that
    layout: the results say world size 3, groups [1, 2] of one shard, run name
    ``fl_hsdp-F2-G1_2-S1-H3``; 4 steps logged, a finite perplexity below the vocabulary, and
    rank 0 (group 0) sent "fl" bytes at 2 syncs (step 3, final). 3 processes, not the 6 of
    cpu_6proc.yaml: each real process imports torch, transformers and fl_accel (about 7
    CPU-s); the 6-rank layout of recipes/configs/cpu_fl_hsdp_unequal.yaml is checked above,
    and trained on 6 ranks by the tests of sections 1-5."""
    out = str(tmp_path / "run")
    argv = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(REPO_ROOT / "accelerate_configs" / "cpu_4proc.yaml"), "--num_processes", "3", "--main_process_port",
            str(free_port()), str(RECIPE), "--algorithm", "fl_hsdp", "--group_sizes", "1,2", "--hsdp_shard_size", "1",
            "--model", "tiny",
            "--max_steps", "4", "--sync_every", "3", "--seq_len", "64", "--micro_batch_size", "2",
            "--max_eval_blocks", "48", "--log_every", "1", "--report_to", "none", "--save_final_model", "false",
            "--output_dir", out, "--cache_dir", data_cache]
    res = run_cmd(argv, timeout=600, env=launch_env(), cwd=REPO_ROOT)
    assert res.returncode == 0, res.tail()
    MEASURED["recipe accelerate launch s"] = res.seconds
    results = json.loads(open(os.path.join(out, "all_results.json"), encoding="utf-8").read())
    assert results["run_name"] == "fl_hsdp-F2-G1_2-S1-H3", results["run_name"]
    assert results["world_size"] == 3 and results["group_sizes"] == [1, 2] and results["shards"] == 1, results
    assert results["steps"] == 4 and math.isfinite(results["eval_perplexity"])
    assert 1.0 < results["eval_perplexity"] < results["vocab_size"]
    assert results["comm"]["fl"]["calls"] == 2 and results["comm"]["fl"]["bytes"] > 0, results["comm"]
    lines = read_metrics(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in lines if "train/loss" in r] == [1, 2, 3, 4]


@pytest.fixture(scope="module", autouse=True)
def print_measured():
    """Prints what this module's tests measured (run with -s), after its last test: not a test
    of its own (it asserts nothing)."""
    yield
    for k, v in MEASURED.items():
        print(f"[unequal] {k}: {v:.4g}" if isinstance(v, float) else f"[unequal] {k}: {v}")


def test_unequal_sizes_and_speeds_equal_exact_simulation(six):
    """sync_trigger "speed" on [2, 4] (FL+HSDP, S=2: group 1 has 2 replicas and sends 1/R of
    the shard per replica) with the plan [[3, 1], [1, 2]] and nesterov: the merge weights are
    the tokens' shares, G_f n_f / sum (2*3 : 4*1 = 0.6 : 0.4, then 2*1 : 4*2 = 0.2 : 0.8), and
    every rank of every replica equals the single-process simulation after each of its steps."""
    recs = six("speed_plan")
    batches = group_batches(recs, LAYOUT)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(W.build_model())
    opts = [torch.optim.SGD(m.parameters(), lr=LR_SGD, momentum=0.0) for m in models]
    anchor = [torch.nn.Parameter(p.detach().clone()) for p in models[0].parameters()]
    outer = torch.optim.SGD(anchor, lr=0.7, momentum=0.9, nesterov=True)
    steps, want = [0, 0], {}
    for n in SPEED_PLAN:
        for f, m in enumerate(models):
            for _ in range(n[f]):
                b = batches[f][steps[f]]
                (sum(m(input_ids=x, labels=x).loss for x in b) / len(b)).backward()
                opts[f].step()
                opts[f].zero_grad()
                steps[f] += 1
                want[(f, steps[f])] = [p.detach().clone() for p in m.parameters()]
        tok = [LAYOUT.group_size_of(f) * n[f] for f in range(2)]
        w = [t / sum(tok) for t in tok]
        for rec in recs:
            end = steps[rec["coords"][0]]
            assert rec["weights"][end] == pytest.approx(w, abs=1e-12), (end, rec["weights"][end], w)
        with torch.no_grad():
            for a, ps in zip(anchor, zip(*(m.parameters() for m in models))):
                a.grad = a.detach() - sum(wf * p.detach() for wf, p in zip(w, ps))
            outer.step()
            outer.zero_grad()
            for a, ps in zip(anchor, zip(*(m.parameters() for m in models))):
                for p in ps:
                    p.copy_(a)
        for f in range(2):
            want[(f, steps[f])] = [p.detach().clone() for p in models[f].parameters()]
    for (f, t), params in want.items():
        for r in range(LAYOUT.replicas_of(f)):
            assert max_diff(full_params(recs, t, f, r), params) <= TOL, (f, t, r)
