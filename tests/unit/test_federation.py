"""fl_accel/federation.py: ``accelerator.federation``'s read-only views over a stand-in
accelerator and synchronizer (the real ones behind it: tests/dist/test_accelerator_api.py)."""

from types import SimpleNamespace

from fl_accel import FLConfig
from fl_accel.comm import CommStats
from fl_accel.exchange import Membership
from fl_accel.federation import Federation
from fl_accel.schedule import SyncSchedule


def _accelerator(synchronizer=None, fault_tolerant=False):
    config = FLConfig(algorithm="fl_fsdp", num_groups=2, sync_every=4)
    return SimpleNamespace(synchronizer=synchronizer, fl_config=config, layout=None, group_index=0,
                           comm_stats=CommStats(), run_config=SimpleNamespace(fault_tolerant=fault_tolerant))


def test_before_prepare_the_status_reads_as_a_run_without_sync():
    fed = Federation(_accelerator())
    assert (fed.prepared, fed.active, fed.step, fed.syncs_done, fed.local_step, fed.sync_pending) == \
        (False, False, 0, 0, 0, False)
    assert fed.round_length == 4 and fed.last_weights is None and fed.last_num_groups is None
    assert fed.fragment_plan == [] and fed.counters() == {} and fed.rounds is None and not fed.triggered
    assert (fed.progress_step, fed.training_done, fed.sync_wait_seconds, fed.heals, fed.heal_log,
            fed.membership_seconds) == (0, False, 0.0, 0, [], {})
    with fed.arriving():
        pass
    fed.restart_round_clock()


def test_the_status_follows_the_schedule_and_the_last_round():
    schedule = SyncSchedule(4, 1, 0, 0.0, active=True)
    for _ in range(6):
        schedule.step()
        if schedule.local_step == schedule.round_length:
            schedule.synced(0.0)
    sync = SimpleNamespace(schedule=schedule, last_membership=Membership(2, 0, (0.25, 0.75)),
                           planner=SimpleNamespace(rounds=None), fragments=[SimpleNamespace(names=["w", "b"])],
                           clock=SimpleNamespace(seconds=1.5), arrival=SimpleNamespace(seconds=0.5),
                           transport=SimpleNamespace(heals=3, heal_sources=[{"source_group": 1, "step": 4}],
                                                     seconds={"quorum": 0.5}))
    fed = Federation(_accelerator(sync))
    assert (fed.active, fed.step, fed.syncs_done, fed.local_step, fed.sync_pending) == (True, 6, 1, 2, True)
    assert fed.rounds_done == fed.syncs_done  # the deprecated name
    assert fed.last_weights == (0.25, 0.75) and fed.last_num_groups == 2 and fed.fragment_plan == [["w", "b"]]
    assert fed.progress_step == 6 and fed.counters()["global_step"] == 6
    assert (fed.sync_wait_seconds, fed.sync_arrival_seconds) == (1.5, 0.5)
    assert fed.heals == 0  # one world: the transport's counters are torchft's only
    ft = Federation(_accelerator(sync, fault_tolerant=True))
    assert ft.heals == 3 and ft.heal_log == [{"source_group": 1, "step": 4}]
    ft.heal_log[0]["step"] = 99  # a copy: the library's record stays as the library wrote it
    ft.membership_seconds["quorum"] = 9.0
    assert sync.transport.heal_sources == [{"source_group": 1, "step": 4}] and sync.transport.seconds == {"quorum": 0.5}


def test_the_round_state_is_handed_out_as_a_copy():
    from fl_accel.trigger import RoundState

    rounds = RoundState("speed", 4, (2, 2), 0)
    sync = SimpleNamespace(schedule=SyncSchedule(4, 1, 0, 0.0, active=True), planner=SimpleNamespace(rounds=rounds))
    fed = Federation(_accelerator(sync))
    assert fed.triggered and fed.rounds.sync_every == 4 and fed.rounds is not rounds
    fed.rounds.group_steps[0] = 99
    assert rounds.group_steps == [0, 0]
