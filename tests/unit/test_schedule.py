"""The sync's control flow without processes: SyncSchedule's integer logic, and the
synchronizer over a fake transport with exact collective counts (as torchft tests its
DiLoCo in tests/test_local_sgd.py), a checkpoint taken while an exchange is in flight,
and the bounded memory of a blocking sync. The numerics are pinned by the gloo tests
(test_sync_gloo.py, test_streaming_sync.py)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from fl_accel import FLConfig
from fl_accel.exchange import EventHooks, Exchange, Membership
from workers._scenario import outer_view
from fl_accel.schedule import ADVANCE, APPLY, FULL, LAUNCH, SyncSchedule


# ====================================================================== the schedule alone
def _drive(schedule: SyncSchedule, steps: int) -> list[tuple[int, str, int | None]]:
    """Step ``schedule`` like the synchronizer does; returns (step, action, fragment)."""
    out = []
    for step in range(1, steps + 1):
        for kind, k in schedule.step():
            out.append((step, kind, k))
            if kind == APPLY:
                schedule.applied()
            elif kind == FULL:
                schedule.synced(schedule.fragment_update_alpha)
    return out


def test_p1_tau0_is_a_full_sync_every_h_steps():
    s = SyncSchedule(sync_every=3)
    assert _drive(s, 7) == [(3, FULL, None), (6, FULL, None)]
    assert (s.local_step, s.global_step, s.num_syncs, s.num_fragment_syncs, s.in_sync) == (1, 7, 2, 0, False)
    assert s.due() is False and _drive(s, 1) == [] and s.due() is True


def test_p1_tau2_launches_advances_applies():
    """H=4, tau=2: launch at local step 2, advance at 3, apply at 4."""
    s = SyncSchedule(sync_every=4, sync_delay=2)
    assert _drive(s, 8) == [(2, LAUNCH, 0), (3, ADVANCE, 0), (4, APPLY, 0),
                            (6, LAUNCH, 0), (7, ADVANCE, 0), (8, APPLY, 0)]
    assert (s.num_syncs, s.num_fragment_syncs, s.in_sync, s.inflight) == (2, 2, True, None)


def test_p3_tau0_deals_fragments_round_robin():
    s = SyncSchedule(sync_every=6, num_fragments=3)
    assert _drive(s, 8) == [(2, APPLY, 0), (4, APPLY, 1), (6, APPLY, 2), (8, APPLY, 0)]
    assert s.in_sync is False  # P > 1: the groups are never all equal between full syncs


def test_p2_tau1_no_advance_when_the_apply_follows():
    """H/P=2, tau=1: launch at local step 1 and apply at 2 (the all-gather runs in the apply)."""
    s = SyncSchedule(sync_every=4, num_fragments=2, sync_delay=1)
    assert _drive(s, 6) == [(1, LAUNCH, 0), (2, APPLY, 0), (3, LAUNCH, 1), (4, APPLY, 1), (5, LAUNCH, 0),
                            (6, APPLY, 0)]


def test_full_sync_completes_the_fragment_in_flight():
    s = SyncSchedule(sync_every=6, num_fragments=2, sync_delay=1)
    assert _drive(s, 2) == [(2, LAUNCH, 0)]
    s.synced()
    assert (s.inflight, s.num_fragment_syncs, s.num_syncs, s.local_step, s.in_sync) == (None, 1, 1, 0, True)
    assert _drive(s, 3) == [(2, LAUNCH, 1), (3, APPLY, 1)]


def test_state_dict_mid_exchange_resumes_the_same_sequence():
    a = SyncSchedule(sync_every=8, num_fragments=2, sync_delay=2)
    full = _drive(a, 12)
    b = SyncSchedule(sync_every=8, num_fragments=2, sync_delay=2)
    head = _drive(b, 6)  # fragment 1 launched at step 6, in flight
    assert b.state_dict() == {"local_step": 2, "global_step": 6, "num_syncs": 1, "num_fragment_syncs": 1,
                              "in_sync": False, "inflight_fragment": 1}
    c = SyncSchedule(sync_every=8, num_fragments=2, sync_delay=2)
    c.load_state_dict(b.state_dict())
    tail = [(step + 6, kind, k) for step, kind, k in _drive(c, 6)]
    assert head + tail == full and c.state_dict() == a.state_dict()


def test_one_group_counts_steps_and_syncs_nothing():
    s = SyncSchedule(sync_every=1, active=False)
    assert _drive(s, 3) == [] and s.global_step == 3 and not s.due()
    s.synced()
    assert (s.local_step, s.in_sync, s.num_syncs) == (0, True, 0)


# ====================================================================== the synchronizer, fake transport
class FakeTransport:
    """F groups in one process: every other group holds this group's values plus ``offset``
    (fp32 exchange); counts every collective."""

    num_chunks, chunk_index, device, group_index, elastic = 1, 0, torch.device("cpu"), 0, False

    def __init__(self, num_groups: int = 2, offset: float = 0.0):
        self.round = Membership(num_groups, 0, (1.0 / num_groups,) * num_groups)
        self.offset, self.calls = offset, Counter()

    def begin(self):
        return self.round

    def hooks(self):
        return EventHooks()

    def _done(self, async_op):
        class Work:
            def wait(self):
                return True

        return Work() if async_op else None

    def all_reduce(self, tensor, async_op=False):
        self.calls["all_reduce"] += 1
        F = self.round.num_groups
        tensor.mul_(F).add_(self.offset * (F - 1))
        return self._done(async_op)

    def all_to_all(self, output, input, async_op=False):
        self.calls["all_to_all"] += 1
        output.copy_(input[self.round.position].expand_as(output))
        return self._done(async_op)

    def all_gather(self, output, input, async_op=False):
        self.calls["all_gather"] += 1
        output.copy_(input.expand_as(output))
        return self._done(async_op)

    def share_chunks(self, flat):
        self.calls["share_chunks"] += 1

    def bad_groups(self, local_bad, membership):
        self.calls["bad_groups"] += 1
        return [membership.position] if local_bad else []


def _synchronizer(transport, sizes=(6, 5, 4), seed=0, device="cpu", **fields):
    from fl_accel.sync import Synchronizer

    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen).to(device)) for n in sizes]
    cfg = FLConfig(**fields)
    opt = torch.optim.SGD(params, lr=0.1)
    sync = Synchronizer([(f"p{i}", p) for i, p in enumerate(params)], opt, transport=transport, config=cfg)
    return sync, params


def _train(sync, params, steps, start=0):
    """Move the parameters as training would (a function of the step), then step the hook."""
    for step in range(start, start + steps):
        with torch.no_grad():
            for i, p in enumerate(params):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i)).to(p.device) * 0.1)
        sync.on_optimizer_step()


@pytest.mark.parametrize("fields,steps,calls", [
    ({"sync_every": 3}, 7, {"bad_groups": 2, "all_reduce": 2, "share_chunks": 2}),
    ({"sync_every": 4, "sync_delay": 2, "sync_dtype": "int8", "sync_collectives": "all_to_all"}, 8,
     {"bad_groups": 2, "all_to_all": 2, "all_gather": 2, "share_chunks": 2}),
    ({"sync_every": 4, "sync_delay": 2, "sync_dtype": "int8"}, 8,  # "auto" at F = 2: one all-gather
     {"bad_groups": 2, "all_gather": 2, "share_chunks": 2}),
    ({"sync_every": 6, "num_fragments": 3}, 8, {"bad_groups": 4, "all_reduce": 4, "share_chunks": 4}),
    ({"sync_every": 4, "num_fragments": 2, "sync_delay": 1, "sync_dtype": "bf16", "outer_optimizer": "nesterov",
      "sync_collectives": "all_to_all"}, 6, {"bad_groups": 3, "all_to_all": 3, "all_gather": 3, "share_chunks": 3}),
])
def test_collective_counts(fields, steps, calls):
    """One bucket per exchange: P=1 tau=0 (one all-reduce per sync), P=1 tau=2 int8 (all-to-all
    at launch, all-gather one step later; or, "auto" at F = 2, one all-gather at launch), P=3 tau=0 (one fragment per H/P steps), P=2 tau=1
    bf16 nesterov; one non-finite check per sync event."""
    transport = FakeTransport()
    sync, params = _synchronizer(transport, **fields)
    _train(sync, params, steps)
    assert dict(transport.calls) == calls


def test_fp32_avg_writes_the_mean_in_place():
    """The other group holds mine + 2: after the sync every shard is mine + 1 (a sum without
    the division by F would give 2 mine + 2), in place."""
    transport = FakeTransport(offset=2.0)
    sync, params = _synchronizer(transport, sync_every=1)
    before, storage = [p.detach().clone() for p in params], [p.data_ptr() for p in params]
    assert sync.on_optimizer_step() is True
    assert all(torch.allclose(p, b + 1.0) for p, b in zip(params, before))
    assert [p.data_ptr() for p in params] == storage


def test_checkpoint_mid_exchange_resumes_bitwise():
    """int8 + error feedback + nesterov, P=2, H=6, tau=2: a synchronizer saved at step 4
    (fragment 1's exchange in flight) and loaded into a fresh one continues exactly as the
    uninterrupted run: parameters, anchors, residuals and counters bitwise, and the same
    collectives after the load."""
    fields = dict(sync_every=6, num_fragments=2, sync_delay=2, sync_dtype="int8", error_feedback=True,
                  outer_optimizer="nesterov")
    ref_t, resumed_t = FakeTransport(), FakeTransport()
    ref, ref_params = _synchronizer(ref_t, **fields)
    _train(ref, ref_params, 4)
    saved_state = ref.schedule.state_dict()
    shared, per_rank = ref.state_tensors()  # completes the exchange in flight
    counts_at_4 = Counter(ref_t.calls)
    assert saved_state["inflight_fragment"] == 1 and all("inflight" in shared[n] for n in ref.fragments[1].names)
    snapshot = ([p.detach().clone() for p in ref_params],
                {i: {k: t.clone() for k, t in d.items()} for i, d in shared.items()},
                {i: {k: t.clone() for k, t in d.items()} for i, d in per_rank.items()})
    _train(ref, ref_params, 8, start=4)
    res, res_params = _synchronizer(resumed_t, seed=1, **fields)  # other initial values: all must be loaded
    with torch.no_grad():
        for p, v in zip(res_params, snapshot[0]):
            p.copy_(v)
    res.load_state_dict(saved_state, snapshot[1], snapshot[2])
    _train(res, res_params, 8, start=4)
    assert all(torch.equal(a, b) for a, b in zip(ref_params, res_params))
    assert all(torch.equal(a, b) for a, b in zip(outer_view(ref).anchor, outer_view(res).anchor))
    assert all(torch.equal(a, b) for a, b in zip(outer_view(ref).residuals, outer_view(res).residuals))
    assert res.schedule.state_dict() == ref.schedule.state_dict()
    assert Counter(ref_t.calls) - counts_at_4 == resumed_t.calls


def test_blocking_sync_keeps_two_buckets_in_flight(monkeypatch):
    """8 tensors of 1 MiB fp32 and sync_bucket_mb=1: a blocking sync holds at most two
    buckets (2 MiB) of exchange buffers at once, a delayed exchange of the same tensors all
    eight; both give the same means."""
    import fl_accel.exchange as exchange_module

    made = []

    class Recording(Exchange):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(exchange_module, "Exchange", Recording)
    mib = 2**18
    transport = FakeTransport(offset=1.0)
    sync, params = _synchronizer(transport, sizes=(mib,) * 8, sync_every=1, sync_bucket_mb=1)
    before = [p.detach().clone() for p in params]
    sync.on_optimizer_step()
    assert len(made) == 1 and made[0].peak_bytes == 2 * 4 * mib
    delayed = Exchange(transport, transport.round, before, bucket_values=mib).start()
    means = delayed.finish()
    assert delayed.peak_bytes == 8 * 4 * mib
    assert all(torch.equal(p, m) for p, m in zip(params, means))
    assert transport.calls["all_reduce"] == 16


def test_sync_wait_seconds_count_sync_events_only():
    transport = FakeTransport()
    sync, params = _synchronizer(transport, sync_every=2)
    sync.on_optimizer_step()
    assert sync.clock.seconds == 0.0
    sync.on_optimizer_step()
    first = sync.clock.seconds
    assert first > 0.0
    sync.on_optimizer_step()
    assert sync.clock.seconds == first


def test_nonfinite_abort_names_the_group_and_reset_drops_it():
    from fl_accel.sync import NonFiniteError

    sync, params = _synchronizer(FakeTransport(), sync_every=1)
    with torch.no_grad():
        params[1][2] = float("nan")
    with pytest.raises(NonFiniteError, match=r"group\(s\) \[0\]"):
        sync.on_optimizer_step()
    transport = FakeTransport(num_groups=3)
    sync, params = _synchronizer(transport, sync_every=1, on_nonfinite="reset")
    with torch.no_grad():
        params[0][0] = float("nan")
    assert sync.on_optimizer_step() is True
    assert transport.calls["bad_groups"] == 1 and transport.calls["all_reduce"] == 1  # the masked mean
    assert all(torch.isfinite(p).all() for p in params)  # this group took the healthy groups' values


def test_a_synchronizer_built_on_meta_syncs_after_materialization():
    """Built while the model is on the meta device (prepare before materialize): no anchor
    yet, and the first sync after the shards were allocated runs on their device."""
    from fl_accel.sync import Synchronizer

    params = [torch.nn.Parameter(torch.empty(n, device="meta")) for n in (6, 5)]
    transport = FakeTransport(offset=2.0)
    sync = Synchronizer([(f"p{i}", p) for i, p in enumerate(params)], torch.optim.SGD(params, lr=0.1),
                        transport=transport, config=FLConfig(sync_every=1, outer_optimizer="nesterov",
                                                             outer_lr=1.0, outer_momentum=0.0))
    assert sync.fragments[0].anchor is None and sync.device.type == "meta"
    for p in params:  # as FSDP2's to_empty: the same parameter objects, new storage
        torch.utils.swap_tensors(p, torch.nn.Parameter(torch.zeros(p.shape)))
    sync.reset_anchors()
    assert sync.on_optimizer_step() is True
    assert all(torch.equal(p.detach(), torch.ones(p.shape)) for p in params)  # mean of 0 and 0 + 2
