"""Synchronizer.on_optimizer_step without processes: the "fl" all-reduce is faked
(the other groups hold this group's parameters plus an offset), so the schedule, the in-place
mean, the outer Nesterov step and the non-finite abort run in this process. The same path on
real gloo launches: tests/dist/test_sync_gloo.py."""

from __future__ import annotations

import pytest
import torch

from fl_accel import FLConfig


# ====================================================================== no processes
class _FakeFL:
    """Stands in for the "fl" all-reduce: the other F-1 groups hold ``self`` + offset."""

    def __init__(self, num_groups: int, offset: float):
        self.num_groups, self.offset, self.calls = num_groups, offset, 0

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        import torch.distributed as dist

        self.calls += 1
        if op == dist.ReduceOp.SUM:  # the parameter average: sum over F groups
            tensor.mul_(self.num_groups).add_(self.offset * (self.num_groups - 1))
        # ReduceOp.MAX: the non-finite flags; identical elsewhere, nothing to do

        class _Done:
            def wait(self):
                return True

        return _Done() if async_op else None


def _fake_synchronizer(monkeypatch, sync_every=3, offset=2.0, **config):
    import torch.distributed as dist

    from fl_accel.mesh import FLLayout, FLMesh
    from fl_accel.mesh_transport import MeshTransport
    from fl_accel.sync import Synchronizer

    fake = _FakeFL(2, offset)
    monkeypatch.setattr(dist, "all_reduce", fake.all_reduce)
    params = [torch.nn.Parameter(torch.arange(6, dtype=torch.float32).reshape(2, 3)), torch.nn.Parameter(torch.ones(5))]
    cfg = FLConfig(sync_every=sync_every, **config)
    mesh = FLMesh(FLLayout.equal(2, 1, 1), None, {"fl": object()})  # the fake collective ignores the group
    transport = MeshTransport.from_mesh(mesh, 0, cfg.group_weighting, torch.device("cpu"))
    sync = Synchronizer(list(zip(["a", "b"], params)), torch.optim.SGD(params, lr=0.1), transport=transport,
                        config=cfg)
    return sync, params, fake


def test_on_optimizer_step_syncs_every_h_steps_with_fake_collective(monkeypatch):
    """H=3: on_optimizer_step syncs at steps 3 and 6 only, counts steps, leaves a pending
    round after step 7, and the sync writes mean = (mine + other)/F in place (other =
    mine + 2, so the mean is mine + 1: a sum without the division by F would give 2*mine + 2)."""
    sync, params, fake = _fake_synchronizer(monkeypatch, sync_every=3, offset=2.0)
    before = [p.detach().clone() for p in params]
    storage = [p.data_ptr() for p in params]
    synced = [sync.on_optimizer_step() for _ in range(7)]
    assert synced == [False, False, True, False, False, True, False]
    assert (sync.schedule.num_syncs, sync.schedule.local_step, sync.schedule.global_step,
            sync.schedule.in_sync) == (2, 1, 7, False)
    assert fake.calls == 4  # per sync: one MAX (non-finite flags) + one SUM (the one bucket)
    for p, b in zip(params, before):
        torch.testing.assert_close(p.detach(), b + 2.0, rtol=0, atol=1e-6)  # two syncs, +1 each
    assert [p.data_ptr() for p in params] == storage


def test_nesterov_lr1_momentum0_is_the_mean_with_fake_collective(monkeypatch):
    """Outer SGD with lr 1, momentum 0 on the pseudo-gradient anchor - mean gives the mean."""
    sync, params, _ = _fake_synchronizer(monkeypatch, sync_every=1, offset=3.0, outer_optimizer="nesterov",
                                         outer_lr=1.0, outer_momentum=0.0)
    before = [p.detach().clone() for p in params]
    assert sync.on_optimizer_step() is True
    for p, b in zip(params, before):
        torch.testing.assert_close(p.detach(), b + 1.5, rtol=0, atol=1e-6)


def test_nonfinite_parameters_abort_the_sync_naming_the_group(monkeypatch):
    """A NaN in this group's shard raises NonFiniteError (on_nonfinite='abort') naming group 0."""
    from fl_accel.sync import NonFiniteError

    sync, params, _ = _fake_synchronizer(monkeypatch, sync_every=1)
    with torch.no_grad():
        params[1][2] = float("nan")
    with pytest.raises(NonFiniteError, match=r"group\(s\) \[0\]"):
        sync.on_optimizer_step()
