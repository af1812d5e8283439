"""fl_accel/federation.py: ``accelerator.federation``'s read-only views over a stand-in
accelerator and synchronizer (the real ones behind it: tests/dist/test_accelerator_api.py)."""

from types import SimpleNamespace

from fl_accel import FLConfig
from fl_accel.comm import CommStats
from fl_accel.exchange import Round
from fl_accel.federation import Federation
from fl_accel.schedule import SyncSchedule


def _accelerator(synchronizer=None, fault_tolerant=False):
    config = FLConfig(algorithm="fl_fsdp", num_groups=2, sync_every=4)
    return SimpleNamespace(synchronizer=synchronizer, fl_config=config, layout=None, group_index=0,
                           comm_stats=CommStats(), fault_tolerant=fault_tolerant)


def test_before_prepare_the_status_reads_as_a_run_without_sync():
    fed = Federation(_accelerator())
    assert (fed.prepared, fed.active, fed.step, fed.rounds_done, fed.local_step, fed.sync_pending) == \
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
    sync = SimpleNamespace(schedule=schedule, last_round=Round(2, 0, (0.25, 0.75)), rounds=None,
                           fragments=[SimpleNamespace(names=["w", "b"])], clock=SimpleNamespace(seconds=1.5),
                           arrival=SimpleNamespace(seconds=0.5), transport=SimpleNamespace(heals=3))
    fed = Federation(_accelerator(sync))
    assert (fed.active, fed.step, fed.rounds_done, fed.local_step, fed.sync_pending) == (True, 6, 1, 2, True)
    assert fed.last_weights == (0.25, 0.75) and fed.last_num_groups == 2 and fed.fragment_plan == [["w", "b"]]
    assert fed.progress_step == 6 and fed.counters()["global_step"] == 6
    assert (fed.sync_wait_seconds, fed.sync_arrival_seconds) == (1.5, 0.5)
    assert fed.heals == 0  # one world: the transport's counters are torchft's only
    assert Federation(_accelerator(sync, fault_tolerant=True)).heals == 3
