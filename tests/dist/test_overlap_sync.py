"""Overlap mode (issue 46 item 2) and the synchronous warm-up (item 3), step by step on real
gloo processes against a single-process simulation written from docs/streaming_and_compression.md.

The spec: an event every H/P optimizer steps, fragment (event number mod P) round-robin; the
exchange of an event launches tau steps before it (0 <= tau <= H, so several fragments may
be in flight), a launch that would fall at or before the schedule's start is skipped (that
event applies nothing); at an event the fragment whose exchange completes is applied first,
then a launch due at the same step is made. ``delayed_local_steps``: "discard", theta <-
global + alpha (theta_now - global); "keep", theta <- global + (theta_now - theta_launch).
``end_training`` applies every exchange in flight in launch order with that rule, then the
exact full sync. ``sync_warmup_steps`` K: before each of the first K optimizer steps the
gradients are averaged across groups (one data-parallel job), the anchor is retaken at step
K and events count from K.

Launches (4 processes = FL+FSDP 2 groups x 2 shards, the tiny Llama of
tests/workers/stream_worker.py, inner SGD, fixed per-rank batches):

1. ``four``: the invalid settings (every rank, before any collective), every scenario of
   :data:`SCENARIOS`, then the runs resumed from their mid-exchange checkpoints (a fresh
   FLAccelerator, model, optimizer and synchronizer, loaded from disk: the same launch saves
   the ~10 s of a second one);
2. ``rounds``: tests/workers/speed_worker.py with ``sync_trigger`` "time" and tau = H (rounds
   overlap), and "speed" with an injected per-round plan for the exact comparison.

:func:`simulate` is the reference: each group's full parameters in one model, a group's inner
step SGD on the mean of its ranks' losses (the gradient FSDP computes), int8 quantized exactly
as :class:`fl_accel.codecs.Quantized` does (the two stages, sub-chunk by sub-chunk, with error
feedback), so every scenario is compared after every step and after ``end_training`` within 1e-6.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from _launch import WORKERS, run_torchrun, write_json
from fl_accel import FLConfig
from fl_accel.codecs import Quantized
from fl_accel.wire import collectives, padding
from test_streaming_sync import (F, LR, TOL, Results, _assert_same_run, _flat, _launch, group_batches, group_loss,
                                 max_diff, tiny_llama, trajectory)

FL2 = {"algorithm": "fl_fsdp", "num_groups": F}
NESTEROV = {"outer_optimizer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.9}
KEEP = {"delayed_local_steps": "keep"}
P1_KEEP = {**FL2, "sync_every": 3, "sync_delay": 3, **KEEP}  # round k's exchange runs during round k+1
P2_KEEP = {**FL2, "sync_every": 4, "num_fragments": 2, "sync_delay": 4, **KEEP, **NESTEROV}  # two in flight
INT8_KEEP = {**FL2, "sync_every": 6, "num_fragments": 2, "sync_delay": 3, "sync_dtype": "int8", "error_feedback": True,
             "sync_collectives": "all_to_all", **KEEP}  # launched at the previous event; all-gather a step later
INT8_GATHER_KEEP = {**INT8_KEEP, "sync_collectives": "auto"}  # F = 2: one all-gather at the launch
DISCARD_LONG = {**FL2, "sync_every": 6, "num_fragments": 2, "sync_delay": 4, "fragment_update_alpha": 0.5,
                **NESTEROV}  # Streaming DiLoCo's rule with tau > H/P
WARMUP = {**FL2, "sync_every": 3, "sync_warmup_steps": 3, **NESTEROV}


def _sc(name, fl, steps, momentum=0.9, **extra):
    return {"name": name, "fl": fl, "steps": steps, "lr": LR, "momentum": momentum, **extra}


SCENARIOS = [
    _sc("keep_p1_avg", P1_KEEP, 10, momentum=0.0),
    _sc("keep_p1_nesterov", {**P1_KEEP, **NESTEROV}, 10),
    _sc("keep_p2", P2_KEEP, 11),
    _sc("keep_p2_int8_ef", INT8_KEEP, 11),
    _sc("keep_p2_int8_gather", INT8_GATHER_KEEP, 11),
    _sc("discard_long", DISCARD_LONG, 11, momentum=0.0),
    _sc("warmup", WARMUP, 10),
    # saved mid-exchange: P=1 at step 7 (launched at 6), P=2 at step 7 (two in flight), int8 at step 3 (the
    # all-to-all of fragment 1 launched, its all-gather due at step 4); then resumed in the same launch
    _sc("keep_p1_nesterov_saved", {**P1_KEEP, **NESTEROV}, 10, save_at=[7]),
    _sc("keep_p2_saved", P2_KEEP, 11, save_at=[7]),
    _sc("keep_p2_int8_ef_saved", INT8_KEEP, 11, save_at=[3]),
    _sc("keep_p2_int8_gather_saved", INT8_GATHER_KEEP, 11, save_at=[3]),
    _sc("keep_p1_nesterov_from7", {**P1_KEEP, **NESTEROV}, 10, resume=["keep_p1_nesterov_saved", 7]),
    _sc("keep_p2_from7", P2_KEEP, 11, resume=["keep_p2_saved", 7]),
    _sc("keep_p2_int8_ef_from3", INT8_KEEP, 11, resume=["keep_p2_int8_ef_saved", 3]),
    _sc("keep_p2_int8_gather_from3", INT8_GATHER_KEEP, 11, resume=["keep_p2_int8_gather_saved", 3]),
]
BY_NAME = {sc["name"]: sc for sc in SCENARIOS}

# (case, FLConfig fields, the fields the message must name)
BAD_CASES = [
    ("keep_with_alpha", {**KEEP, "sync_delay": 2, "fragment_update_alpha": 0.5},
     ["FLConfig.fragment_update_alpha", "delayed_local_steps"]),
    ("tau_above_h", {"sync_every": 4, "sync_delay": 5}, ["FLConfig.sync_delay"]),
    ("discard_tau_h", {"sync_every": 4, "sync_delay": 4}, ["FLConfig.sync_delay", "delayed_local_steps"]),
    ("unknown_rule", {"delayed_local_steps": "mix"}, ["FLConfig.delayed_local_steps"]),
    ("time_tau_between", {**KEEP, "sync_trigger": "time", "sync_window_s": 1.0, "sync_every": 4, "sync_delay": 2},
     ["FLConfig.sync_delay", "sync_trigger"]),
    ("speed_p2", {**KEEP, "sync_trigger": "speed", "sync_every": 4, "num_fragments": 2, "sync_delay": 4},
     ["FLConfig.num_fragments", "sync_trigger"]),
    ("warmup_negative", {"sync_warmup_steps": -1}, ["FLConfig.sync_warmup_steps"]),
    ("warmup_with_time", {"sync_trigger": "time", "sync_window_s": 1.0, "sync_warmup_steps": 2},
     ["FLConfig.sync_warmup_steps", "sync_trigger"]),
    ("keep_torchft", {**KEEP, "sync_delay": 1, "fault_tolerance": "torchft", "group_index": 0},
     ["FLConfig.delayed_local_steps", "torchft"]),
]


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> Results:
    out = tmp_path_factory.mktemp("overlap")
    cases = [{"name": n, "fl": fl} for n, fl, _ in BAD_CASES]
    _launch(out, 4, {"bad_cases": cases, "scenarios": SCENARIOS}, "overlap")
    return Results(out, 4)


# ====================================================================== the simulation
def int8_mean(anchor, thetas, residual, idx, shards: int = 2, gather: bool = False) -> list[torch.Tensor]:
    """The int8 exchange of parameters ``idx`` as fl_accel.codecs.Quantized runs it, with error
    feedback: rank (g, s) packs its dim-0 shards (torch.chunk) of (anchor - theta_g) + residual,
    padded to F x 256 values; row c of its quantized buffer goes to group c, which dequantizes
    the F rows it received, sums them weighted (1/F) in fp32 and re-quantizes; the F sums are
    gathered and dequantized. The residual becomes what the first quantization dropped. ``gather``
    (``sync_collectives`` "all_gather"): every group's whole quantized buffer is gathered, and each
    rank sums the F dequantized buffers weighted in fp32, group by group from zero (one rounding)."""
    codec, w = Quantized("int8"), torch.tensor([1.0 / F] * F, dtype=torch.float32).unsqueeze(1)
    means = [[] for _ in idx]
    for s in range(shards):
        deq = []
        for g in range(F):
            parts = [(anchor[i] - thetas[g][i].detach().float()).chunk(shards)[s] + residual[g][i].chunk(shards)[s]
                     for i in idx]
            flat = _flat(parts, padding("int8", F, 1))
            d = codec.dequantize(codec.quantize(flat, F))
            dropped, offset = flat - d.view(-1), 0
            for i, part in zip(idx, parts):
                residual[g][i].chunk(shards)[s].copy_(dropped[offset:offset + part.numel()].view_as(part))
                offset += part.numel()
            deq.append(d)
        if gather:
            mean, offset = torch.zeros_like(deq[0].view(-1)), 0
            for g in range(F):
                mean.add_(deq[g].view(-1), alpha=1.0 / F)
        else:
            sums = [codec.quantize((torch.stack([deq[g][c] for g in range(F)]) * w).sum(dim=0), 1) for c in range(F)]
            mean, offset = codec.dequantize(torch.cat(sums)).view(-1), 0
        for j, i in enumerate(idx):
            n = anchor[i].chunk(shards)[s].numel()
            means[j].append(mean[offset:offset + n].view_as(anchor[i].chunk(shards)[s]))
            offset += n
    return [torch.cat(m, dim=0) for m in means]


def simulate(batches, fl: dict, fragments, steps: int, lr: float = LR, momentum: float = 0.0, *,
             retake_anchor: bool = True):
    """The spec in one process; ``batches[g][step]``: group g's micro-batches. Returns
    ``[step][group] -> full parameters`` after every optimizer step, then after end_training.
    Written op for op as the library computes (so that it agrees to rounding over many steps):
    "fp32" averages the parameters (SUM / F), a compressed exchange the pseudo-gradients; the
    outer Nesterov step is torch's SGD on the anchor; alpha mixes with ``torch.lerp``.
    ``retake_anchor`` False: the warm-up without its anchor (a variant the run must miss)."""
    cfg = FLConfig(**fl)
    models = [tiny_llama() for _ in range(F)]
    opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum) for m in models]
    thetas = [[p for _, p in m.named_parameters()] for m in models]
    n = len(thetas[0])
    H, P, tau, K = cfg.sync_every, cfg.num_fragments, cfg.sync_delay, cfg.sync_warmup_steps
    period, keep, alpha = H // P, cfg.delayed_local_steps == "keep" and tau > 0, cfg.fragment_update_alpha
    state = {}

    def reset():
        anchor = [torch.nn.Parameter(p.detach().clone()) for p in thetas[0]]
        outer = [torch.optim.SGD([a], lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=True) for a in anchor]
        state.update(anchor=anchor, outer=outer, residual=[[torch.zeros_like(p) for p in thetas[0]] for _ in range(F)])

    reset()

    def exchange(idx, final=False):
        """``(compressed, means)``: the mean of what each group sends for parameters ``idx``."""
        anchor, residual = state["anchor"], state["residual"]
        if cfg.sync_dtype == "int8" and not final:
            gather = collectives(cfg.sync_collectives, F) == "all_gather"
            return True, int8_mean([a.detach() for a in anchor], thetas, residual, idx, gather=gather)
        if cfg.sync_dtype == "fp32":
            return False, [sum(th[i].detach() for th in thetas) / F for i in idx]
        out = [sum(anchor[i].detach() - th[i].detach() + residual[g][i] for g, th in enumerate(thetas)) / F
               for i in idx]
        for r in residual:
            for t in r:
                t.zero_()
        return True, out

    @torch.no_grad()
    def apply(idx, sent, launched=None, mix=0.0):
        compressed, means = sent
        anchor = state["anchor"]
        for j, (i, m) in enumerate(zip(idx, means)):
            if cfg.outer_optimizer == "nesterov":
                anchor[i].grad = m.clone() if compressed else anchor[i].detach() - m
                state["outer"][i].step()
                anchor[i].grad = None
            elif compressed:
                anchor[i].sub_(m)
            else:
                anchor[i].copy_(m)
            new = anchor[i].detach()
            for g, th in enumerate(thetas):
                if launched is not None:
                    th[i].copy_((th[i] - launched[g][j]) + new)
                elif mix:
                    th[i].copy_(torch.lerp(new, th[i], mix))
                else:
                    th[i].copy_(new)

    history, flight = [], {}  # flight: event number -> (fragment, means, parameters at launch), launch order
    for step in range(1, steps + 1):
        for g in range(F):
            opts[g].zero_grad()
            group_loss(models[g], batches[g][step - 1]).backward()
        if step <= K:  # the warm-up: one data-parallel job (the mean of the groups' gradients)
            for ps in zip(*thetas):
                mean = sum(p.grad for p in ps) / F
                for p in ps:
                    p.grad.copy_(mean)
        for g in range(F):
            opts[g].step()
        if step == K and retake_anchor:
            reset()
        s = step - K
        if s > 0 and s % period == 0:
            e = s // period
            if e in flight:
                k, sent, launched = flight.pop(e)
                apply(fragments[k], sent, launched, alpha)
            elif not tau:
                k = (e - 1) % P
                apply(fragments[k], exchange(fragments[k]), None, alpha)
        if s > 0 and tau and (s + tau) % period == 0:
            e = (s + tau) // period
            k = (e - 1) % P
            launched = [[th[i].detach().clone() for i in fragments[k]] for th in thetas] if keep else None
            flight[e] = (k, exchange(fragments[k]), launched)
        history.append([[t.detach().clone() for t in th] for th in thetas])
    for e in sorted(flight):  # end_training: in launch order, then everything exactly
        k, sent, launched = flight[e]
        apply(fragments[k], sent, launched, alpha)
    everything = list(range(n))
    apply(everything, exchange(everything, final=True))
    history.append([[t.detach().clone() for t in th] for th in thetas])
    return history


def worst(a, b) -> float:
    return max(max_diff(x[g], y[g]) for x, y in zip(a, b) for g in range(F))


def _check_exact(four, name, variants=()):
    recs = four(name)
    sc = BY_NAME[name]
    frags = recs[0]["fragment_indices"]
    got = trajectory(recs)
    assert len(got) == sc["steps"] + 1
    sim = simulate(group_batches(recs), sc["fl"], frags, sc["steps"], momentum=sc["momentum"])
    err = worst(got, sim)
    print(f"[{name}: max |gloo - simulation| over {sc['steps']} steps + end = {err:.2e}]")
    assert err <= TOL
    assert all(torch.equal(a, b) for a, b in zip(got[-1][0], got[-1][1]))  # end_training: identical groups
    for label, change, kw in variants:
        other = simulate(group_batches(recs), {**sc["fl"], **change}, frags, sc["steps"], momentum=sc["momentum"],
                         **kw)
        miss = worst(got, other)
        assert miss > 1e-3, f"{name}: the simulation with {label} also matches ({miss:.2e}); the test cannot tell"
    return recs, got


# ====================================================================== a. exact, every step
def test_p1_tau_h_keep_avg_and_nesterov_equal_the_simulation(four):
    """P=1, H=3, tau=H, "keep": the event at step 3 applies nothing (its launch would be at step
    0) and launches round 1's exchange, which runs during round 2 and is applied at step 6 as
    global + (theta_now - theta_launch), then round 2's launches; end_training applies the one
    launched at step 9, then the exact full sync. fp32 "avg" (inner SGD) and "nesterov" (inner
    SGD with momentum): every rank's shards equal the simulation after every step and at the
    end. Not vacuous: "discard" with alpha 1 (theta <- theta_now: no exchange applied), tau = 0
    and the blocking sync all miss; the groups differ after every event (the kept local steps)."""
    for name in ("keep_p1_avg", "keep_p1_nesterov"):
        recs, got = _check_exact(four, name, [
            ("discard, alpha 1", {"delayed_local_steps": "discard", "fragment_update_alpha": 1.0}, {}),
            ("tau 0 (blocking)", {"sync_delay": 0, "delayed_local_steps": "discard"}, {})])
        flights = [st["inflight_fragments"] for st in recs[0]["steps"]]
        assert flights == [[], [], [0], [0], [0], [0], [0], [0], [0], [0]]
        assert [st["num_fragment_syncs"] for st in recs[0]["steps"]] == [0, 0, 1, 1, 1, 2, 2, 2, 3, 3]
        assert max_diff(got[5][0], got[5][1]) > 1e-4  # right after the apply at step 6 the groups differ


def test_p2_tau_h_keep_has_two_fragments_in_flight(four):
    """P=2, H=4 (an event every 2 steps), tau=H, "keep", "nesterov": the events at steps 2 and 4
    apply nothing; from step 4 on two fragments are in flight (launched at steps 2, 4, 6, ...,
    each applied 4 steps later, then relaunched at once); equal to the simulation after every
    step and after end_training (which applies both, oldest first)."""
    recs, _ = _check_exact(four, "keep_p2", [
        ("tau = H/P", {"sync_delay": 2}, {}),
        ("discard, alpha 1", {"delayed_local_steps": "discard", "fragment_update_alpha": 1.0}, {})])
    flights = [st["inflight_fragments"] for st in recs[0]["steps"]]
    assert flights[:8] == [[], [0], [0], [0, 1], [0, 1], [1, 0], [1, 0], [0, 1]]
    assert max(len(f) for f in flights) == 2


def test_p2_tau_h_over_p_keep_int8_error_feedback(four):
    """P=2, H=6, tau=H/P=3, "keep", int8 with error feedback, "avg": each exchange launches at the
    previous event, its all-gather a step later; the simulation quantizes as the codec does (both
    stages, the residual on each rank's chunk), so it matches after every step within 1e-6. Not
    vacuous: the exact (fp32) mean misses."""
    _check_exact(four, "keep_p2_int8_ef", [("the fp32 exchange", {"sync_dtype": "fp32"}, {})])


def test_p2_tau_h_over_p_keep_int8_one_all_gather(four):
    """The same with ``sync_collectives`` "auto" at F = 2: one all-gather of every group's int8
    payload at the launch, summed in fp32 on every rank; equal to the simulation of that path within
    1e-6 after every step. Not vacuous: the two-collective simulation (a second rounding) misses."""
    _check_exact(four, "keep_p2_int8_gather", [("the two-collective exchange", {"sync_collectives": "all_to_all"}, {})])


def test_discard_with_tau_beyond_h_over_p(four):
    """"discard" (Streaming DiLoCo's rule) with tau=4 > H/P=3, alpha 0.5, "nesterov": up to two
    fragments in flight; equal to the simulation."""
    recs, _ = _check_exact(four, "discard_long", [("keep", {"fragment_update_alpha": 0.0, **KEEP}, {})])
    assert max(len(st["inflight_fragments"]) for st in recs[0]["steps"]) == 2


def test_warmup_is_one_data_parallel_job_then_the_schedule_from_k(four):
    """sync_warmup_steps=3, H=3, "nesterov", inner SGD with momentum: after each of the first 3
    steps every rank's shards are bitwise equal across the groups (the same averaged gradient,
    the same inner optimizer step), the anchor is retaken at step 3 and the first sync is at
    step 6; the whole run equals the simulation. Not vacuous: without the warm-up, or with the
    anchor not retaken at step 3, the simulation misses."""
    recs, got = _check_exact(four, "warmup", [("no warm-up", {"sync_warmup_steps": 0}, {}),
                                               ("the anchor not retaken", {}, {"retake_anchor": False})])
    for i in range(3):
        assert all(torch.equal(a, b) for a, b in zip(got[i][0], got[i][1])), i
    assert max_diff(got[3][0], got[3][1]) > 1e-4  # step 4: local again
    syncs = [st["local_step"] for st in recs[0]["steps"]]
    assert syncs == [0, 0, 0, 1, 2, 0, 1, 2, 0, 1]  # events at steps 6 and 9 (K + H, K + 2H)


def test_fl_bytes_equal_the_cost_model(four):
    """Bytes on "fl" of each run, measured by the comm accounting, equal fl_accel.planning.cost's
    estimate for the same FLConfig and T steps on shard 0 (its busiest rank), byte for byte:
    the skipped launches, the exchanges end_training completes, the final exact sync and the
    warm-up's fp32 gradient means are all counted as the run makes them."""
    from unit.test_cost_model import estimate_from_config
    from fl_accel.planning.units import units_from_module

    units = units_from_module(tiny_llama())
    for name in ("keep_p1_avg", "keep_p2", "keep_p2_int8_ef", "keep_p2_int8_gather", "discard_long", "warmup"):
        sc = BY_NAME[name]
        est = estimate_from_config(FLConfig(**sc["fl"]), 4, units, total_steps=sc["steps"])
        for rec in four(name):
            f, _, shard = rec["coords"]
            want = sc["steps"] * est.by_group()[f]["fl"]
            got = rec["final_comm"]["fl"]["bytes"]
            assert got == pytest.approx(want, rel=1e-12) if shard == 0 else 0 < got <= want, (name, rec["rank"])


# ====================================================================== b. resume mid-exchange
@pytest.mark.parametrize("name,saved,ref,k", [
    ("keep_p1_nesterov_from7", "keep_p1_nesterov_saved", "keep_p1_nesterov", 7),
    ("keep_p2_from7", "keep_p2_saved", "keep_p2", 7),
    ("keep_p2_int8_ef_from3", "keep_p2_int8_ef_saved", "keep_p2_int8_ef", 3),
    ("keep_p2_int8_gather_from3", "keep_p2_int8_gather_saved", "keep_p2_int8_gather", 3)])
def test_resume_mid_exchange_is_bitwise_the_uninterrupted_run(four, name, saved, ref, k):
    """A checkpoint with exchanges in flight under "keep" (P=1 at step 7, launched at 6; P=2 at
    step 7 with two fragments in flight, counters ``inflight_fragments``; int8 + error feedback
    at step 3, before its all-gather), loaded into a fresh accelerator, model, optimizer and
    synchronizer: every later loss and every rank's shards after every step and after
    end_training are bitwise those of the run that never saved, and so are the saving run's.
    Each group stores its own parameters at the launch (they differ between the groups)."""
    base, with_save, res = four(ref), four(saved), four(name)
    for rec in with_save:
        state = {s["step"]: s for s in rec["saved"]}[k]["sync_state"]
        assert state["inflight_fragment"] is not None
        if name == "keep_p2_from7":
            assert state["inflight_fragments"] == [1, 0]
    for rec in res:
        assert rec["load_error"] is None, rec["load_error"]
        steps = [st["step"] for st in rec["steps"]]
        assert rec["start"] == k and steps == list(range(k + 1, BY_NAME[ref]["steps"] + 1))
    got = trajectory(base)
    assert max_diff(got[k - 1][0], got[k - 1][1]) > 1e-4  # the groups differed at the checkpoint
    _assert_same_run(base, with_save, 1)
    _assert_same_run(base, res, k + 1)


# ====================================================================== c. bad inputs
@pytest.mark.parametrize("case,fl,names", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_overlap_and_warmup_settings_raise_naming_the_fields(case, fl, names):
    with pytest.raises(ValueError) as info:
        FLConfig(**fl)
    assert all(n in str(info.value) for n in names), str(info.value)


def test_bad_settings_raise_on_every_rank_before_any_collective(four):
    for case, _, names in BAD_CASES:
        for rank in range(4):
            rec = json.loads((four.out / "bad" / case / f"rank{rank}.json").read_text())
            assert rec["type"] == "ValueError" and all(n in rec["message"] for n in names), (case, rec)
            assert rec["dist_initialized"] is False, (case, rec)


# ====================================================================== d. rounds by time / speed
sys.path.insert(0, str(WORKERS))
import unequal_worker as U  # noqa: E402  (the model and data of speed_worker)

SPEED_WORKER = WORKERS / "speed_worker.py"
PLAN = [[3, 1], [2, 4], [1, 3]]  # steps of group 0 and group 1 per round
OVERLAP = {"algorithm": "fl_fsdp", "num_groups": 2, "sync_every": 4, "sync_delay": 4, **KEEP}


@pytest.fixture(scope="module")
def rounds(tmp_path_factory):
    out = tmp_path_factory.mktemp("overlap_rounds")
    spec = {"scenarios": [
        {"name": "speed_plan", "fl": {**OVERLAP, "sync_trigger": "speed"}, "max_steps": 7, "plan": PLAN},
        {"name": "time", "fl": {**OVERLAP, "sync_trigger": "time", "sync_window_s": 0.15}, "max_steps": 24,
         "plan": None, "spy_exchange": True}]}
    res = run_torchrun(4, SPEED_WORKER, write_json(out / "spec.json", spec), out, timeout=400)
    assert res.returncode == 0, res.tail()
    return out


def _records(out, name):
    return [torch.load(out / name / f"rank{k}.pt", weights_only=False) for k in range(4)]


def _full(recs, key, f):
    shards = [next(r for r in recs if r["coords"] == [f, 0, s]) for s in range(2)]
    pick = (lambda r: r["steps"][key]) if isinstance(key, int) else (lambda r: r[key])
    return [torch.cat(parts, dim=0) for parts in zip(*(pick(r) for r in shards))]


def _simulate_rounds(recs):
    """Rounds of ``PLAN`` (SGD lr 1 on the mean loss of the group's ranks), fp32 "avg", tau = H
    "keep": at the end of round k the exchange launched at the end of round k-1 (the mean of
    the parameters then, weighted by round k-1's tokens) is applied as global + (theta_now -
    theta_launch), then round k's is launched; end_training applies the last, then the exact
    mean (weights by size: no steps since). Returns ``{(f, t): params}`` and the weights per round."""
    tokens, models = U.token_table(), []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(U.build_model())
    opts = [torch.optim.SGD(m.parameters(), lr=1.0, momentum=0.0) for m in models]
    steps, hist, weights, flight = [0, 0], {}, [], None

    @torch.no_grad()
    def apply(pending):
        means, launched = pending
        for f, m in enumerate(models):
            for p, g, la in zip(m.parameters(), means, launched[f]):
                p.copy_((p - la) + g)

    for n in PLAN:
        for f, m in enumerate(models):
            ranks = [2 * f, 2 * f + 1]
            for _ in range(n[f]):
                t = steps[f]
                batch = [tokens[recs[k]["index_batches"][t % len(recs[k]["index_batches"])]] for k in ranks]
                (sum(m(input_ids=x, labels=x).loss for x in batch) / len(batch)).backward()
                opts[f].step()
                opts[f].zero_grad()
                steps[f] += 1
                hist[(f, steps[f])] = [p.detach().clone() for p in m.parameters()]
        w = [n[f] / sum(n) for f in range(2)]
        weights.append(w)
        if flight is not None:
            apply(flight)
        launched = [[p.detach().clone() for p in m.parameters()] for m in models]
        flight = ([sum(wf * la[i] for wf, la in zip(w, launched)) for i in range(len(launched[0]))], launched)
        for f in range(2):
            hist[(f, steps[f])] = [p.detach().clone() for p in models[f].parameters()]
    apply(flight)
    with torch.no_grad():
        for ps in zip(*(m.parameters() for m in models)):
            mean = sum(0.5 * p.detach() for p in ps)
            for p in ps:
                p.copy_(mean)
    return hist, weights, [p.detach().clone() for p in models[0].parameters()]


def test_speed_rounds_of_a_plan_overlap_exactly(rounds):
    """sync_trigger "speed" with the plan [[3, 1], [2, 4], [1, 3]] injected, tau = H, "keep":
    every rank equals the simulation after every one of its own steps and at the end; round
    k's exchange carries round k's token weights (3/4, 1/4; 1/3, 2/3; ...) and is applied at
    the end of round k+1."""
    recs = _records(rounds, "speed_plan")
    hist, weights, final = _simulate_rounds(recs)
    for rec in recs:
        f = rec["coords"][0]
        ends = sorted(rec["weights"])
        assert ends == [sum(n[f] for n in PLAN[:k + 1]) for k in range(len(PLAN))]
        for k, t in enumerate(ends):
            assert rec["weights"][t] == pytest.approx(weights[k], abs=1e-12)
    worst_err = 0.0
    for f in range(2):
        for t in range(1, sum(n[f] for n in PLAN) + 1):
            d = max_diff(_full(recs, t, f), hist[(f, t)])
            assert d <= TOL, (f, t, d)
            worst_err = max(worst_err, d)
        assert max_diff(_full(recs, "final", f), final) <= TOL
    assert max_diff(_full(recs, 4, 0), _full(recs, 5, 1)) > 1e-4  # after round 2's apply: local steps kept
    print(f"[speed plan, tau = H keep: max |gloo - simulation| {worst_err:.2e}]")


def test_time_rounds_overlap_and_the_groups_end_identical(rounds):
    """sync_trigger "time" (0.15 s windows), tau = H, "keep", a budget of 24 steps: the run
    finishes, the groups end bitwise identical, and each exchange launched at the end of a
    round completes at the end of the next (or in end_training): it was in flight across a whole
    round, during which the training went on (an exchange is in flight at every step after the
    first round)."""
    recs = _records(rounds, "time")
    for f in range(2):
        assert all(torch.equal(a, b) for a, b in zip(_full(recs, "final", 0), _full(recs, "final", f)))
    for rec in recs:
        ends = sorted(rec["weights"])
        assert len(ends) >= 2, ends
        assert rec["launched_at"] == ends
        assert rec["completed_at"] == ends[1:] + [max(rec["steps"])]
        assert all(rec["inflight"][t] == [0] for t in rec["inflight"] if t >= ends[0])
        assert rec["rounds"]["num_rounds"] == len(ends)
