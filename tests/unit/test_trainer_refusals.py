"""fl_accel.trainer without processes: what FLTrainer refuses before any process group, and
``federated()`` on a class that is not a Trainer (the trainer itself: tests/dist/test_trainer.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="FLTrainer needs transformers (pip install -e .[trainer])")

from fl_accel import FLConfig  # noqa: E402


@pytest.mark.parametrize("config,args,match", [
    (FLConfig(sync_trigger="time", sync_window_s=5.0), {}, "sync_trigger='time' is not supported"),
    (FLConfig(sync_trigger="speed"), {}, "sync_trigger='speed' is not supported"),
    (FLConfig(fault_tolerance="torchft", group_index=0), {}, "fault_tolerance='torchft' is not supported"),
    (FLConfig(), {"load_best_model_at_end": True}, "load_best_model_at_end=True is not supported"),
])
def test_refused_before_any_process_group(config, args, match):
    from types import SimpleNamespace

    from fl_accel.trainer import FLTrainer

    with pytest.raises(ValueError, match=match):
        FLTrainer(model=None, args=SimpleNamespace(**args), fl_config=config)


def test_fl_config_must_be_a_config():
    from fl_accel.trainer import FLTrainer

    with pytest.raises(ValueError, match="fl_config must be an FLConfig, got dict"):
        FLTrainer(model=None, fl_config={"num_groups": 2})


def test_federated_needs_a_trainer_class_and_keeps_a_federated_one():
    from transformers import Trainer

    from fl_accel.trainer import FederatedTrainerMixin, FLTrainer, federated

    with pytest.raises(TypeError, match="needs a transformers.Trainer subclass"):
        federated(dict)
    cls = federated(Trainer)
    assert cls.__name__ == "FLTrainer" and cls.__mro__[1] is FederatedTrainerMixin and issubclass(cls, Trainer)
    assert federated(FLTrainer) is FLTrainer
