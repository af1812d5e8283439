"""The federated synchronization, checked on real gloo processes.

Every scenario below is a real ``torchrun`` launch of tests/workers/sync_worker.py:
4 processes (FL+FSDP: 2 groups x 2 shards) or 8 (FL+HSDP: 2 groups x 2 replicas x 2
shards), a tiny ``transformers.LlamaForCausalLM`` trained through ``FLAccelerator(cpu=True)``
and ``accelerator.prepare(model, optimizer, loader)``, i.e. the same FSDP2 code path
as on GPUs. The worker saves each rank's local parameter shards (at init, after each
micro-batch, right before and right after each sync, at the end), the comm_stats and
synchronizer counters after each micro-batch, and the batches it read; the tests
below assert on those files. Scenarios are batched: one launch for all 4-process
scenarios, one for the 8-process ones, one for all invalid configurations.

The same path without processes (the collective faked): tests/unit/test_sync_fake.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from _launch import WORKERS, run_torchrun, write_json

WORKER = WORKERS / "sync_worker.py"
LAUNCH_TIMEOUT = 600  # seconds; a hang fails the test instead of blocking the suite


# ====================================================================== launches
MODEL_LR = {"adamw": 1e-3, "sgd": 0.5}


def _sc(name, fl, optimizer="adamw", micro_batches=7, **extra):
    return {"name": name, "fl": fl, "optimizer": optimizer, "lr": MODEL_LR[optimizer],
            "micro_batches": micro_batches, **extra}


FL_FSDP = {"algorithm": "fl_fsdp", "num_groups": 2}
FL_HSDP = {"algorithm": "fl_hsdp", "num_groups": 2, "hsdp_shard_size": 2}

FOUR_PROC = [  # world 4
    _sc("fl_avg", {**FL_FSDP, "sync_every": 3}, snap_steps=True),
    _sc("fl_nesterov_as_avg", {**FL_FSDP, "sync_every": 3, "outer_optimizer": "nesterov",
                               "outer_lr": 1.0, "outer_momentum": 0.0}, snap_steps=True),
    _sc("fl_diloco", {**FL_FSDP, "sync_every": 3, "outer_optimizer": "nesterov",
                      "outer_lr": 0.7, "outer_momentum": 0.9}),
    _sc("fsdp_sgd", {"algorithm": "fsdp"}, "sgd", 5),
    _sc("fl_fsdp_sgd", {**FL_FSDP, "sync_every": 1}, "sgd", 5),
    _sc("fl_fsdp_one_group_sgd", {**FL_FSDP, "num_groups": 1, "sync_every": 1}, "sgd", 5),
    _sc("fl_grad_accum", {**FL_FSDP, "sync_every": 2}, micro_batches=20, grad_accum=4),
]
EIGHT_PROC = [  # world 8
    _sc("hsdp_sgd", {"algorithm": "hsdp", "hsdp_shard_size": 2}, "sgd", 5),
    _sc("fl_hsdp_sgd", {**FL_HSDP, "sync_every": 1}, "sgd", 5),
    _sc("fl_hsdp_avg", {**FL_HSDP, "sync_every": 3}, snap_steps=True),
]


class Results:
    """Per-rank records of one launch, by scenario name."""

    def __init__(self, out: Path, world: int):
        self.out, self.world = out, world

    def __call__(self, name: str) -> list[dict]:
        recs = [torch.load(self.out / name / f"rank{r}.pt", weights_only=True) for r in range(self.world)]
        for r, rec in enumerate(recs):
            assert rec["rank"] == r and rec["world"] == self.world
        return recs


def _launch_scenarios(scenarios, world, out: Path) -> Results:
    spec = write_json(out / "spec.json", {"scenarios": scenarios})
    res = run_torchrun(world, WORKER, spec, out, timeout=LAUNCH_TIMEOUT)
    assert res.returncode == 0, res.tail()
    print(f"\n[{world}-process launch of {len(scenarios)} scenarios: {res.seconds:.1f} s]")
    return Results(out, world)


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> Results:
    return _launch_scenarios(FOUR_PROC, 4, tmp_path_factory.mktemp("four"))


@pytest.fixture(scope="module")
def eight(tmp_path_factory) -> Results:
    return _launch_scenarios(EIGHT_PROC, 8, tmp_path_factory.mktemp("eight"))


# ---------------------------------------------------------------------- helpers
def by_coord(recs) -> dict[tuple[int, int, int], dict]:
    return {tuple(rec["coords"]): rec for rec in recs}


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))


def full_params(recs, pick, f: int = 0, r: int = 0) -> list[torch.Tensor]:
    """Full parameters of group f / replica r, rebuilt from the S dim-0 shards in shard order
    (FSDP2 shards dim 0 like torch.chunk; to_local() is unpadded)."""
    coords = by_coord(recs)
    S = recs[0]["layout"][2]
    shards = [pick(coords[(f, r, s)]) for s in range(S)]
    return [torch.cat([sh[i] for sh in shards], dim=0) for i in range(len(shards[0]))]


def fl_delta(rec, i: int, key: str = "calls", axis: str = "fl", op: str | None = None) -> int:
    """Increase of a comm counter during micro-batch i (1-based); i = len(steps)+1 is end_training."""
    def value(comm):
        return comm[axis]["by_op"].get(op, 0) if op else comm[axis][key]
    steps = rec["steps"]
    now = value(rec["final_comm"] if i == len(steps) + 1 else steps[i - 1]["comm"])
    before = value(steps[i - 2]["comm"]) if i >= 2 else 0
    return now - before


def shard_bytes(rec) -> int:
    """M: this rank's local shard volume in fp32 bytes (all parameters are fp32 here)."""
    assert all(t.dtype == torch.float32 for t in rec["init"])
    return 4 * sum(t.numel() for t in rec["init"])


def check_post_sync_is_group_mean(recs, F, R, S, tol=1e-6) -> float:
    """Right after every sync all groups are identical and equal the fp64 mean of the
    pre-sync shards over the F groups; returns the worst error. Also checks that the
    groups really differed before each sync (else the check would be vacuous)."""
    coords = by_coord(recs)
    n_sync = len(recs[0]["pre_sync"])
    worst = 0.0
    for k in range(n_sync):
        for r in range(R):
            for s in range(S):
                pre = [coords[(f, r, s)]["pre_sync"][k] for f in range(F)]
                post = [coords[(f, r, s)]["post_sync"][k] for f in range(F)]
                assert max_diff(pre[0], pre[1]) > 1e-4, f"sync {k}: groups were already equal before the sync"
                mean = [torch.stack([p[i].double() for p in pre]).mean(0) for i in range(len(pre[0]))]
                for f in range(F):
                    assert all(torch.equal(a, b) for a, b in zip(post[f], post[0])), f"sync {k}: group {f} != group 0"
                    err = max_diff(post[f], mean)
                    worst = max(worst, err)
                    assert err <= tol, f"sync {k} coord {(f, r, s)}: post-sync deviates from the mean by {err}"
    return worst


# ====================================================================== a. sync semantics
def test_groups_diverge_between_syncs_and_equal_the_mean_right_after(four):
    """FL+FSDP 2x2, AdamW, H=3, 7 steps, different data per group: syncs at steps 3 and 6
    and at end_training (the 7th); between syncs the groups' shards differ, right after
    each sync they are identical and equal the fp32 mean of the pre-sync shards (1e-6)."""
    recs = four("fl_avg")
    coords = by_coord(recs)
    for rec in recs:
        assert rec["layout"] == [2, 1, 2] and rec["num_groups"] == 2 and rec["is_fsdp2"]
        assert rec["sync_global_step"] == [3, 6, 7] and rec["final_num_syncs"] == 3
    for i in range(1, 8):
        for s in range(2):
            d = max_diff(coords[(0, 0, s)]["snaps"][i - 1], coords[(1, 0, s)]["snaps"][i - 1])
            if i in (3, 6):
                assert d == 0.0, f"step {i} (a sync): groups differ by {d}"
            else:
                assert d > 1e-4, f"step {i} (between syncs): groups should differ, max diff {d}"
    worst = check_post_sync_is_group_mean(recs, 2, 1, 2)
    print(f"[fl_avg: max |post-sync - mean(pre-sync)| = {worst:.2e}]")
    for rec in recs:  # the last snapshot is the end-of-training sync
        assert max_diff(rec["final"], rec["post_sync"][-1]) == 0.0
        assert max_diff(rec["snaps"][2], rec["post_sync"][0]) == 0.0


def test_sync_keeps_dtensors_in_place(four):
    """A sync writes the local shards in place: same DTensor placements, global shape,
    stride, local shape and storage pointer before and after every sync."""
    for rec in four("fl_avg"):
        assert rec["sync_meta"], "no sync recorded"
        for pre, post in rec["sync_meta"]:
            assert pre == post
            assert all(m["type"] == "DTensor" and m["placements"] == "(Shard(dim=0),)" for m in post)
        assert rec["meta"] == rec["sync_meta"][0][0]


def test_groups_read_disjoint_global_data(four):
    """Global data sharding: every rank of the world reads different rows, so the two
    groups train on different data (the premise of the divergence checks)."""
    recs = four("fl_avg")
    rows = [tuple(row) for rec in recs for st in rec["steps"] for row in st["batch"]]
    assert len(rows) == 4 * 7 * 2 and len(set(rows)) == len(rows)


# ====================================================================== b. traffic
def test_no_fl_collective_between_syncs_and_sync_bytes_match_shard(four):
    """comm_stats["fl"]: zero calls on steps without a sync; one all-reduce per sync (the
    model fits one bucket) moving 2(F-1)/F * M bytes, M = this rank's fp32 shard bytes
    (the 255-row embeddings shard 128/127, so M differs between shard coordinates).
    The sync's non-finite check all-reduces F floats over the whole world; the world's
    rank set is no mesh axis here (F=2, G=2), so the meter does not count it on "fl"."""
    F = 2
    recs = four("fl_avg")
    for rec in recs:
        M = shard_bytes(rec)
        assert rec["sync_global_step"] == [3, 6, 7]
        for i in range(1, len(rec["steps"]) + 2):  # micro-batches 1..7, then 8 = end_training
            calls, nbytes = fl_delta(rec, i), fl_delta(rec, i, "bytes")
            if i in (3, 6, 8):
                assert (calls, nbytes) == (1, 2 * (F - 1) * M // F) == (1, M), f"rank {rec['rank']} step {i}"
            else:
                assert (calls, nbytes) == (0, 0), f"rank {rec['rank']}: fl traffic at step {i} without a sync"
        for i in range(1, len(rec["steps"]) + 1):  # the meter is live: FSDP traffic every step
            assert fl_delta(rec, i, axis="dp_shard") > 0
        assert rec["final_comm"]["dp_replicate"]["calls"] == 0
    m = {tuple(rec["coords"]): shard_bytes(rec) for rec in recs}
    assert m[(0, 0, 0)] == m[(1, 0, 0)] != m[(0, 0, 1)] == m[(1, 0, 1)]


# ====================================================================== c. parity
def test_fl_fsdp_h1_sgd_equals_fsdp_over_the_world(four):
    """SGD (no momentum), H=1, avg: FedAvg of 2 groups' steps = one step on the mean of the
    2 group-mean gradients = FSDP over all 4 ranks, since every rank reads the same
    micro-batch in both runs. Full parameters after 5 steps agree within 1e-5."""
    base, fl = four("fsdp_sgd"), four("fl_fsdp_sgd")
    for rb, rf in zip(base, fl):
        assert [st["batch"] for st in rb["steps"]] == [st["batch"] for st in rf["steps"]]
        assert rf["final_num_syncs"] == 5
    want = full_params(base, lambda rec: rec["final"])
    moved = max_diff(want, full_params(base, lambda rec: rec["init"]))
    assert moved > 1e-2, f"training barely moved the parameters ({moved}); the parity check would be vacuous"
    for f in range(2):
        d = max_diff(full_params(fl, lambda rec: rec["final"], f=f), want)
        print(f"[FL+FSDP group {f} vs FSDP: max abs diff {d:.2e} (parameters moved {moved:.2e})]")
        assert d <= 1e-5


def test_nesterov_outer_lr1_momentum0_equals_avg(four):
    """outer_optimizer="nesterov" with outer_lr=1, outer_momentum=0 reproduces "avg" at every
    step (3 syncs, AdamW inside) within 1e-6."""
    avg, nes = four("fl_avg"), four("fl_nesterov_as_avg")
    worst = 0.0
    for ra, rn in zip(avg, nes):
        assert rn["sync_global_step"] == ra["sync_global_step"] == [3, 6, 7]
        for sa, sn in zip(ra["snaps"] + [ra["final"]], rn["snaps"] + [rn["final"]]):
            worst = max(worst, max_diff(sa, sn))
    print(f"[nesterov(lr=1, m=0) vs avg: max abs diff {worst:.2e}]")
    assert worst <= 1e-6


def test_nesterov_outer_step_follows_diloco(four):
    """DiLoCo outer step (lr 0.7, momentum 0.9, Nesterov): with anchor a (init, then the last
    sync's result) and group mean m, delta = a - m, buf = 0.9 buf + delta (buf = delta at
    first), a <- a - 0.7 (delta + 0.9 buf); every group ends each sync at the new a."""
    recs = four("fl_diloco")
    coords = by_coord(recs)
    worst = 0.0
    for s in range(2):
        anchor = [t.double() for t in coords[(0, 0, s)]["init"]]
        buf = None
        for k in range(len(recs[0]["pre_sync"])):
            pre = [coords[(f, 0, s)]["pre_sync"][k] for f in range(2)]
            mean = [(a.double() + b.double()) / 2 for a, b in zip(*pre)]
            delta = [a - m for a, m in zip(anchor, mean)]
            buf = delta if buf is None else [0.9 * b + d for b, d in zip(buf, delta)]
            anchor = [a - 0.7 * (d + 0.9 * b) for a, d, b in zip(anchor, delta, buf)]
            for f in range(2):
                post = coords[(f, 0, s)]["post_sync"][k]
                worst = max(worst, max_diff(post, anchor))
            assert max_diff(anchor, mean) > 1e-4  # the outer step is not just the mean
    print(f"[DiLoCo outer step: max abs diff to the reference recursion {worst:.2e}]")
    assert worst <= 1e-6


def test_one_group_is_bitwise_identical_to_fsdp(four):
    """fl_fsdp with num_groups=1 is a strict no-op on top of FSDP: same (1,1,4) layout,
    no synchronizer hook, no fl traffic, and bitwise-identical parameters and losses."""
    base, one = four("fsdp_sgd"), four("fl_fsdp_one_group_sgd")
    for rb, ro in zip(base, one):
        assert ro["layout"] == rb["layout"] == [1, 1, 4]
        assert ro["final_num_syncs"] == 0 and ro["pre_sync"] == []
        assert ro["final_comm"]["fl"]["calls"] == 0
        assert [st["loss"] for st in ro["steps"]] == [st["loss"] for st in rb["steps"]]
        assert all(torch.equal(a, b) for a, b in zip(ro["final"], rb["final"]))


# ====================================================================== d. accumulation
def test_grad_accumulation_4_with_h2_syncs_after_exactly_8_micro_batches(four):
    """gradient_accumulation_steps=4, H=2, 20 micro-batches: an optimizer step every 4th
    micro-batch, a sync after micro-batches 8 and 16 (never mid-accumulation), and the
    end-of-training sync for the pending 5th step. FSDP2's gradient reduce-scatter runs
    only on the micro-batch that steps (Accelerate's no_sync on FSDP2 is in effect)."""
    for rec in four("fl_grad_accum"):
        assert rec["is_fsdp2"]
        for st in rec["steps"]:
            i = st["micro_batch"]
            assert st["sync_gradients"] == (i % 4 == 0), i
            assert st["global_step"] == i // 4, i
            assert st["num_syncs"] == i // 8, i
            assert st["comm"]["fl"]["calls"] == i // 8, i
            rs = fl_delta(rec, i, axis="dp_shard", op="reduce_scatter")
            assert (rs > 0) == (i % 4 == 0), f"micro-batch {i}: reduce-scatter bytes {rs}"
        assert rec["sync_global_step"] == [2, 4, 5] and rec["final_num_syncs"] == 3


# ====================================================================== e. FL+HSDP
def test_fl_hsdp_replicas_identical_groups_diverge_and_sync_to_mean(eight):
    """FL+HSDP 2 groups x 2 replicas x 2 shards, AdamW, H=3: after every step the two
    replicas of a group hold bitwise-identical shards; the groups differ between syncs;
    after each sync all 4 copies equal the mean of the groups' pre-sync shards (1e-6)."""
    recs = eight("fl_hsdp_avg")
    coords = by_coord(recs)
    for rec in recs:
        assert rec["layout"] == [2, 2, 2] and rec["sync_global_step"] == [3, 6, 7]
    for i in range(7):
        for f in range(2):
            for s in range(2):
                assert max_diff(coords[(f, 0, s)]["snaps"][i], coords[(f, 1, s)]["snaps"][i]) == 0.0, (i, f, s)
        d = max_diff(coords[(0, 0, 0)]["snaps"][i], coords[(1, 0, 0)]["snaps"][i])
        assert (d == 0.0) if i + 1 in (3, 6) else (d > 1e-4), f"step {i + 1}: group diff {d}"
    worst = check_post_sync_is_group_mean(recs, 2, 2, 2)
    print(f"[fl_hsdp_avg: max |post-sync - mean(pre-sync)| = {worst:.2e}]")


def test_fl_hsdp_inter_group_bytes_are_one_rth_of_the_shard(eight):
    """Each replica carries 1/R of its shard across groups: per sync, fl bytes per rank =
    2(F-1)/F * M/R (half the FL+FSDP-style 2(F-1)/F * M for R=2), then the replicas
    all-gather the chunks on dp_replicate ((R-1)/R * M). No fl traffic between syncs."""
    F, R = 2, 2
    for rec in eight("fl_hsdp_avg"):
        M = shard_bytes(rec)
        assert M % (4 * R) == 0
        fsdp_style = 2 * (F - 1) * M // F
        assert rec["sync_global_step"] == [3, 6, 7]
        for i in range(1, len(rec["steps"]) + 2):  # micro-batches 1..7, then 8 = end_training
            calls, nbytes = fl_delta(rec, i), fl_delta(rec, i, "bytes")
            if i in (3, 6, 8):
                assert calls == 1 and nbytes == 2 * (F - 1) * (M // R) // F
                assert nbytes * R == fsdp_style
                assert fl_delta(rec, i, axis="dp_replicate", op="all_gather") == (R - 1) * M // R
            else:
                assert (calls, nbytes) == (0, 0), f"fl traffic at step {i} without a sync"
                assert fl_delta(rec, i, axis="dp_replicate", op="all_gather") == 0


def test_fl_hsdp_h1_sgd_equals_hsdp_over_the_world(eight):
    """SGD, H=1, avg: FL+HSDP (2x2x2) equals HSDP over all 8 ranks (4 replicas x 2 shards)
    after 5 steps within 1e-5."""
    base, fl = eight("hsdp_sgd"), eight("fl_hsdp_sgd")
    assert base[0]["layout"] == [1, 4, 2] and fl[0]["layout"] == [2, 2, 2]
    for rb, rf in zip(base, fl):
        assert [st["batch"] for st in rb["steps"]] == [st["batch"] for st in rf["steps"]]
    want = full_params(base, lambda rec: rec["final"])
    moved = max_diff(want, full_params(base, lambda rec: rec["init"]))
    assert moved > 1e-2
    for f in range(2):
        for r in range(2):
            d = max_diff(full_params(fl, lambda rec: rec["final"], f=f, r=r), want)
            print(f"[FL+HSDP group {f} replica {r} vs HSDP: max abs diff {d:.2e}]")
            assert d <= 1e-5


# ====================================================================== f. bad configurations
BAD_CONFIGS = [  # (case, FLConfig fields, or None: read from FL_ACCEL_* in the launch env; field to name)
    ("world_not_divisible", {"algorithm": "fl_fsdp", "num_groups": 3}, "num_groups"),
    ("shard_not_dividing_group", {"algorithm": "fl_hsdp", "num_groups": 2, "hsdp_shard_size": 3}, "hsdp_shard_size"),
    ("sync_every_zero", {"sync_every": 0}, "sync_every"),
    ("sync_every_zero_from_env", None, "sync_every"),  # FLAccelerator() -> FLConfig.from_env()
    ("unknown_algorithm", {"algorithm": "fedprox"}, "algorithm"),
    ("unknown_outer_optimizer", {"outer_optimizer": "adam"}, "outer_optimizer"),
]
BAD_WORLD = 4


@pytest.fixture(scope="module")
def bad_launch(tmp_path_factory):
    """One 4-process launch in which every rank tries every invalid configuration in turn
    (an explicit FLConfig never reads FL_ACCEL_*, so the env only feeds the env case);
    the last case's ValueError is left uncaught."""
    out = tmp_path_factory.mktemp("bad")
    cases = [{"name": name} | ({"fl": fl} if fl is not None else {}) for name, fl, _ in BAD_CONFIGS]
    spec = write_json(out / "spec.json", {"mode": "bad_configs", "cases": cases})
    res = run_torchrun(BAD_WORLD, WORKER, spec, out, timeout=180, env={"FL_ACCEL_SYNC_EVERY": "0"})
    print(f"\n[bad-config launch: {res.seconds:.1f} s, rc={res.returncode}]")
    return out, res


def test_bad_config_launch_fails_fast(bad_launch):
    """The launch whose workers raise exits non-zero on its own, far below the 120 s
    collective timeout that a rank stuck in a collective would wait for."""
    _, res = bad_launch
    assert not res.timed_out and res.returncode not in (0, None), res.tail()
    assert res.seconds < 110, f"launch took {res.seconds:.0f} s"  # a rank stuck in a collective would wait 120 s
    assert f"ValueError: FLConfig.{BAD_CONFIGS[-1][2]}" in res.stderr  # the uncaught one's traceback


@pytest.mark.parametrize("case,fl,field", BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
def test_bad_config_raises_on_every_rank_before_any_collective(bad_launch, case, fl, field):
    """Every rank raises ValueError naming the field, in the constructor, before
    torch.distributed is initialized (so before any collective: nobody can hang), and
    says so on its stderr."""
    out, res = bad_launch
    for rank in range(BAD_WORLD):
        path = out / case / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} recorded nothing for {case}\n{res.tail()}"
        rec = json.loads(path.read_text())
        assert rec["type"] == "ValueError" and field in rec["message"], rec
        assert rec["dist_initialized"] is False, rec
        assert rec["seconds"] < 10.0, rec  # pure Python validation; generous for a loaded machine
        assert re.search(rf"\[rank {rank}\] {case}: ValueError: .*{field}", res.stderr), res.tail()
