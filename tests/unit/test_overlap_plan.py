"""Overlap mode and synchronous warm-up without processes (issue 46 items 2 and 3): the schedule's
integer logic (several fragments in flight, skipped launches, apply-then-launch, the warm-up's
shift), the keep rule and the warm-up's gradient mean through the synchronizer over a fake
transport, a checkpoint with two exchanges in flight, the config's refusals and ignore rules,
and the cost, memory and link-guide figures. The numerics on gloo: tests/dist/test_overlap_sync.py."""

from __future__ import annotations

import pytest
import torch

from fl_accel import FLConfig
from fl_accel.mesh import FLLayout
from fl_accel.planning import cost as cm
from fl_accel.planning import memory as mm
from fl_accel.schedule import ADVANCE, ANCHOR, APPLY, LAUNCH, SKIP, SyncSchedule, inflight_of
from unit.test_schedule import FakeTransport, _synchronizer, _train
from workers._scenario import outer_view


# ====================================================================== the schedule
def test_p1_tau_h_skips_the_first_event_then_applies_and_launches_at_each():
    """P=1, H=4, tau=4: the launch for the event at step 4 would be at step 0 (skipped); every
    event then applies round k-1's exchange first and launches round k's; a compressed exchange
    advances halfway through its window (2 of its 4 steps)."""
    s = SyncSchedule(sync_every=4, sync_delay=4, delayed_local_steps="keep")
    assert _drive_all(s, 10) == [(4, SKIP, 0), (4, LAUNCH, 0), (6, ADVANCE, 0), (8, APPLY, 0), (8, LAUNCH, 0),
                                 (10, ADVANCE, 0)]
    assert (s.inflight_fragments, s.num_fragment_syncs, s.in_sync) == ([0], 2, False)


@pytest.mark.parametrize("tau, advance_after", [(1, None), (2, 1), (3, 1), (4, 2), (5, 2), (8, 4)])
def test_a_compressed_exchange_advances_halfway_through_its_window(tau, advance_after):
    """H=16, P=2 (events every 8 steps): the second collective (the all-gather) is launched
    max(1, floor(tau/2)) steps after the launch, so on a slow link each of the two gets half the
    window; with tau=1 there is no step between launch and event (both at the apply)."""
    s = SyncSchedule(sync_every=16, num_fragments=2, sync_delay=tau, delayed_local_steps="keep")
    acts = _drive_all(s, 32)
    launches = [t for t, kind, _ in acts if kind == LAUNCH]
    advances = [t for t, kind, _ in acts if kind == ADVANCE]
    assert launches == [event - tau for event in (8, 16, 24, 32, 40) if 0 < event - tau <= 32]
    if advance_after is None:
        assert advances == []
    else:
        assert advances == [t + advance_after for t in launches if t + advance_after <= 32], (launches, advances)


def test_p2_tau_h_keeps_two_fragments_in_flight_in_launch_order():
    s = SyncSchedule(sync_every=4, num_fragments=2, sync_delay=4, delayed_local_steps="keep")
    acts = [a for a in _drive_all(s, 8) if a[1] != ADVANCE]
    assert acts == [(2, SKIP, 0), (2, LAUNCH, 0), (4, SKIP, 1), (4, LAUNCH, 1), (6, APPLY, 0), (6, LAUNCH, 0),
                    (8, APPLY, 1), (8, LAUNCH, 1)]
    assert s.inflight_fragments == [0, 1]
    state = s.state_dict()
    assert state["inflight_fragment"] == 0 and state["inflight_fragments"] == [0, 1]
    again = SyncSchedule(sync_every=4, num_fragments=2, sync_delay=4, delayed_local_steps="keep")
    again.load_state_dict(state)  # a resume with two in flight continues the same sequence
    assert _drive_all(again, 4) == _drive_all(s, 4) and again.state_dict() == s.state_dict()
    s.synced()  # a full sync completes both
    assert (s.inflight_fragments, s.num_fragment_syncs, s.in_sync) == ([], 8, True)


def test_the_old_single_key_is_still_read():
    assert inflight_of({"inflight_fragment": 1}) == [1]
    assert inflight_of({"inflight_fragment": None}) == [] and inflight_of({}) == []
    assert inflight_of({"inflight_fragment": 1, "inflight_fragments": [1, 0]}) == [1, 0]


def test_discard_with_tau_beyond_h_over_p_launches_for_the_event_after_next():
    """P=2, H=6 (events every 3 steps), tau=4: fragment 1's exchange for the event at step 6 is
    launched at step 2, before the event at step 3 (which applies nothing: its launch is at -1)."""
    s = SyncSchedule(sync_every=6, num_fragments=2, sync_delay=4)
    acts = [a for a in _drive_all(s, 9) if a[1] != ADVANCE]
    assert acts == [(2, LAUNCH, 1), (3, SKIP, 0), (5, LAUNCH, 0), (6, APPLY, 1), (8, LAUNCH, 1), (9, APPLY, 0)]


def test_warmup_counts_no_events_then_shifts_the_schedule():
    s = SyncSchedule(sync_every=3, warmup_steps=2)
    assert s.warming_up and not s.due()
    acts = _drive_all(s, 8)
    assert acts == [(2, ANCHOR, None), (5, "full", None), (8, "full", None)]
    assert not s.warming_up and s.global_step == 8
    one_group = SyncSchedule(sync_every=3, warmup_steps=2, active=False)
    assert not one_group.warming_up and _drive_all(one_group, 3) == []


def test_rounds_of_a_planner_overlap_whatever_their_length():
    """P=1, tau=H with a round planner's lengths (3, then 5): launch at each round's end, advance
    halfway through the round it overlaps, apply at the next round's end."""
    s = SyncSchedule(sync_every=4, sync_delay=4, delayed_local_steps="keep", round_steps=3)
    out = _drive_all(s, 3)
    s.round_steps = 5
    out += [(t + 3, a, k) for t, a, k in _drive_all(s, 5)]
    assert out == [(3, SKIP, 0), (3, LAUNCH, 0), (5, ADVANCE, 0), (8, APPLY, 0), (8, LAUNCH, 0)]  # halfway: 5 steps


def _drive_all(schedule, steps):
    """:func:`unit.test_schedule._drive` that also reports SKIP (as the synchronizer does)."""
    out = []
    for step in range(1, steps + 1):
        for kind, k in schedule.step():
            out.append((step, kind, k))
            if kind in (APPLY, SKIP):
                schedule.applied(skipped=kind == SKIP)
            elif kind == "full":
                schedule.synced(schedule.fragment_update_alpha)
    return out


# ====================================================================== the synchronizer, fake transport
def test_keep_applies_the_global_value_plus_the_local_steps_since_the_launch():
    """P=1, H=2, tau=2, "avg" fp32, "keep": the other group holds mine + 2, so each exchange's mean
    is theta_launch + 1; at the apply theta <- (theta_launch + 1) + (theta_now - theta_launch)."""
    transport = FakeTransport(offset=2.0)
    sync, params = _synchronizer(transport, sync_every=2, sync_delay=2, delayed_local_steps="keep")
    _train(sync, params, 2)  # the event at step 2: nothing to apply; launch
    launched = [p.detach().clone() for p in params]
    assert [f.launched is not None for f in sync.fragments] == [True]
    _train(sync, params, 1, start=2)
    before = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.add_(0.25)
    sync.on_optimizer_step()  # step 4: apply, launch
    for p, la, b in zip(params, launched, before):
        torch.testing.assert_close(p.detach(), (la + 1.0) + (b + 0.25 - la), rtol=0, atol=1e-6)
    assert transport.calls["all_reduce"] == 2


def test_warmup_averages_gradients_then_takes_the_anchor():
    """sync_warmup_steps=2: before each of the first two optimizer steps every gradient becomes
    the mean over the groups (the other holds mine + 2: + 1), none after; the anchor is the
    parameters at step 2, and the first sync comes H=3 steps later."""
    transport = FakeTransport(offset=2.0)
    sync, params = _synchronizer(transport, sync_every=3, sync_warmup_steps=2, outer_optimizer="nesterov")
    sync.attach()
    seen = []
    for step in range(5):
        for p in params:
            p.grad = torch.full_like(p, float(step))
        sync.optimizer.step()
        seen.append(float(params[0].grad[0]))
        if step == 1:
            assert all(torch.equal(a, p.detach()) for a, p in zip(outer_view(sync).anchor, params))
        if step == 3:
            assert (sync.schedule.local_step, sync.schedule.num_syncs, transport.calls["all_reduce"]) == (2, 0, 2)
    assert seen == [1.0, 2.0, 2.0, 3.0, 4.0]
    assert (sync.schedule.local_step, sync.schedule.num_syncs, transport.calls["all_reduce"]) == (0, 1, 3)
    sync.detach()


def test_checkpoint_with_two_exchanges_in_flight_resumes_bitwise():
    """int8 + error feedback + nesterov + "keep", P=2, H=4, tau=4: a synchronizer saved at step 5
    (two exchanges in flight) and loaded into a fresh one continues exactly as the uninterrupted
    run; the per-rank state holds each fragment's parameters at its launch."""
    fields = dict(sync_every=4, num_fragments=2, sync_delay=4, sync_dtype="int8", error_feedback=True,
                  outer_optimizer="nesterov", delayed_local_steps="keep")
    ref, ref_params = _synchronizer(FakeTransport(), **fields)
    _train(ref, ref_params, 5)
    counters = ref.counters()
    assert counters["inflight_fragments"] == [0, 1]
    shared, per_rank = ref.state_tensors()
    assert all("launched" in per_rank[n] for f in ref.fragments for n in f.names)
    copy = lambda tensors: {n: {k: t.clone() for k, t in d.items()} for n, d in tensors.items()}  # noqa: E731
    snap = ([p.detach().clone() for p in ref_params], copy(shared), copy(per_rank))
    _train(ref, ref_params, 7, start=5)
    res, res_params = _synchronizer(FakeTransport(), seed=1, **fields)
    templates = res.state_tensors(inflight=[0, 1])
    assert set(templates[1]["p0"]) == {"residual", "launched"} and "inflight" in templates[0]["p0"]
    with torch.no_grad():
        for p, v in zip(res_params, snap[0]):
            p.copy_(v)
    res.load_state_dict(counters, snap[1], snap[2])
    _train(res, res_params, 7, start=5)
    assert all(torch.equal(a, b) for a, b in zip(ref_params, res_params))
    assert res.schedule.state_dict() == ref.schedule.state_dict()


# ====================================================================== config
def test_config_ignore_rules_and_checkpoint_identity():
    assert FLConfig(delayed_local_steps="keep").ignored_fields()["delayed_local_steps"] == "with sync_delay 0"
    assert "delayed_local_steps" not in FLConfig(sync_delay=2, delayed_local_steps="keep").ignored_fields()
    keep = FLConfig(sync_every=4, sync_delay=4, delayed_local_steps="keep")
    assert keep.sync_state(2)["delayed_local_steps"] == "keep" and "delayed_local_steps" not in keep.sync_state(1)
    assert "delayed_local_steps" not in FLConfig(sync_delay=2).sync_state(2)  # older checkpoints stay compatible
    FLConfig(sync_trigger="time", sync_window_s=1.0, sync_every=4, sync_delay=4, delayed_local_steps="keep")
    FLConfig(sync_trigger="speed", sync_every=4, sync_delay=4, delayed_local_steps="keep")
    FLConfig(sync_every=4, sync_delay=4, fragment_update_alpha=0.5)  # discard with alpha: Streaming DiLoCo's rule


def test_a_checkpoint_of_another_sync_schedule_is_refused_naming_it():
    """load_state's check (no collective): a checkpoint written with another sync_every or
    sync_delay is refused naming both values; one written before the schedule was stored (no
    such keys) still loads; with one group (no sync) the schedule is not compared."""
    from fl_accel.checkpoint import CheckpointError, check_compatible, layout_meta

    layout = FLLayout.from_config(FLConfig(num_groups=2), 4)
    written = layout_meta(FLConfig(num_groups=2, sync_every=8), layout)
    assert (written["sync_every"], written["sync_delay"]) == (8, 0)
    check_compatible(written, layout_meta(FLConfig(num_groups=2, sync_every=8), layout))
    for here, named in ((FLConfig(num_groups=2, sync_every=16), "sync_every=8 vs 16"),
                        (FLConfig(num_groups=2, sync_every=8, sync_delay=2), "sync_delay=0 vs 2")):
        with pytest.raises(CheckpointError, match=f"different setup.*{named}"):
            check_compatible(written, layout_meta(here, layout))
    older = {k: v for k, v in written.items() if k not in ("sync_every", "sync_delay")}
    check_compatible(older, layout_meta(FLConfig(num_groups=2, sync_every=16), layout))
    one = FLLayout.from_config(FLConfig(algorithm="fsdp"), 4)
    assert "sync_every" not in layout_meta(FLConfig(algorithm="fsdp", sync_every=3), one)
    assert FLConfig.from_env({"FL_ACCEL_DELAYED_LOCAL_STEPS": "keep", "FL_ACCEL_SYNC_DELAY": "8",
                              "FL_ACCEL_SYNC_WARMUP_STEPS": "16"}).sync_warmup_steps == 16


# ====================================================================== cost, memory, link guide
UNITS = [cm.ShardUnit(f"u{i}", 256) for i in range(4)]


def test_cost_model_counts_the_events_of_an_overlapped_run():
    """H=4, P=2 (events every 2 steps), tau=4, T=11: events at 2 and 4 skipped (launched at or
    before step 0), 6, 8, 10 applied, 12 and 14 launched at 8 and 10 (end_training completes
    them): fragments 0, 1, 0 (6, 10, 14) and 1, 1 (8, 12): 3 and 2 exchanges, plus the final sync."""
    e = cm.estimate(FLLayout.equal(2, 1, 2), UNITS, sync_every=4, num_fragments=2, sync_delay=4, total_steps=11,
                    delayed_local_steps="keep")
    assert e.weights == [3 / 11, 2 / 11] and e.full_weight == 1 / 11 and e.warmup_weight == 0
    p1 = cm.estimate(FLLayout.equal(2, 1, 2), UNITS, sync_every=4, sync_delay=4, total_steps=12,
                     delayed_local_steps="keep")
    assert p1.weights == [3 / 12] and p1.full_weight == 1 / 12  # 8, 12 applied, 16 launched at 12
    blocking = cm.estimate(FLLayout.equal(2, 1, 2), UNITS, sync_every=4, total_steps=12)
    assert blocking.full_weight == 0  # step 12's sync was the last, nothing in flight


def test_cost_model_of_the_warmup():
    """K=3 of T=9 steps: an fp32 mean of every gradient shard per warm-up step (the full sync's
    "fl" bytes, no flags), 3/9 per step; the events count from step 3 (H=3: 6 and 9, the last
    one at step T: no final sync); without the warm-up, syncs at 3, 6 and 9."""
    layout = FLLayout.equal(2, 1, 2)
    e = cm.estimate(layout, UNITS, sync_every=3, total_steps=9, sync_warmup_steps=3, ranks_per_node=2)
    assert e.warmup_weight == 3 / 9 and e.weights == [2 / 9] and e.full_weight == 0
    assert e.warmup[0].of("fl") == e.full[0].of("fl") > 0 and e.warmup[0].of("world") == 0
    no = cm.estimate(layout, UNITS, sync_every=3, total_steps=9, ranks_per_node=2)
    assert no.weights == [3 / 9] and no.warmup_weight == 0
    assert e.by_axis()["fl"] == pytest.approx(5 / 9 * e.full[0].of("fl"))
    kw = dict(compute_s=1.0, intra_node_bw=1e12, inter_node_bw=1e3)
    assert cm.predict_step_time(e, **kw).exposed_sync_s > cm.predict_step_time(no, **kw).exposed_sync_s


def test_step_time_overlaps_at_most_h_over_p_steps():
    """An exchange hides at most H/P steps of compute: P=2, H=4, tau=4 hides as much as tau=2."""
    layout = FLLayout.equal(2, 1, 2)
    kw = dict(compute_s=1.0, intra_node_bw=1e12, inter_node_bw=200.0)
    t = {tau: cm.predict_step_time(cm.estimate(layout, UNITS, sync_every=4, num_fragments=2, sync_delay=tau,
                                               ranks_per_node=2), **kw).exposed_sync_s for tau in (1, 2, 4)}
    assert t[1] > t[2] == t[4]


def test_memory_counts_the_exchanges_in_flight_and_the_kept_parameters():
    cfg = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4)
    layout = FLLayout.equal(2, 1, 2)
    kw = dict(seq_len=32, micro_batch=1, layout=layout, sync_dtype="int8", error_feedback=True, num_fragments=2,
              sync_every=8, accelerator="cpu")
    one = mm.estimate(cfg, sync_delay=2, **kw)
    two = mm.estimate(cfg, sync_delay=8, **kw)
    kept = mm.estimate(cfg, sync_delay=8, delayed_local_steps="keep", **kw)
    assert two.phases["loss"]["sync_buffers"] == 2 * one.phases["loss"]["sync_buffers"] > 0
    nk = max(sum(sum(u.local_sizes(2)) for u in part) for part in
             (lambda units: [units[0::2], units[1::2]])(mm.llama_units(cfg)))
    assert kept.phases["loss"]["outer_state"] - two.phases["loss"]["outer_state"] == 4 * nk * 2
    host = mm.estimate(cfg, sync_delay=8, delayed_local_steps="keep", outer_state_device="cpu", **kw)
    assert host.phases["loss"]["outer_state"] == 0


def test_link_guide_prices_the_warmup():
    from scripts import link_guide as lg

    tiny = lg.resolve_model("tiny", seq_len=256)
    w = lg.warmup_cost(tiny, 32, groups=2, gpus_per_group=2, link_bits_per_s=1e7, compute_s=0.5)
    e = cm.estimate(FLLayout.equal(2, 1, 2), list(tiny.units), sync_every=1, ranks_per_node=2)
    assert w["bytes_per_gpu"] == pytest.approx(32 * e.full[0].of("fl"))
    assert w["extra_seconds"] == pytest.approx(w["seconds"] - 32 * 0.5) and w["extra_seconds"] > 32 * 0.5
    [row] = lg.guide([tiny], [1e7], groups=2, gpus_per_group=2, compute_s=0.5, warmup_steps=32)
    assert row["warmup"] == w and lg.warmup_lines([row])[0].startswith("  tiny at 10 Mbit/s: 32 warm-up steps")
