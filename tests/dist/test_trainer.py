"""FLTrainer as a drop-in for ``transformers.Trainer``, and TRL's ``SFTTrainer`` made federated:
a Trainer script run on 4 gloo processes with only the line that builds the trainer changed
(tests/workers/trainer_worker.py; FL+FSDP with 2 groups of 2, H=4 from ``FL_ACCEL_*``;
``TrainingArguments(fsdp="full_shard", fsdp_config={"version": 2})``, 10 optimizer steps of 2
accumulated micro-batches, a linear schedule with warmup, ``save_steps=5``).

* The LR at every optimizer step equals plain ``Trainer``'s with the same arguments, and so do
  the losses of the steps before the groups diverge (the group-local token count).
* ``save_model`` after ``train()`` writes the mean of the groups (their parameters right
  before the final sync, which the last step, 10, not a multiple of H, adds), loadable by
  ``from_pretrained``; ``trainer.evaluate()`` reports that model's loss, not a group's.
* Checkpoints: step 5 is mid-round (fl_state/ only, no model files); step 10, after the final
  sync, has both.
* A run stopped right after its mid-round step-5 checkpoint and resumed with
  ``resume_from_checkpoint`` ends with the uninterrupted run's model and log, bitwise.
* ``federated(SFTTrainer)`` (TRL) trains, checkpoints at multiples of H with model files, and
  exports the groups' mean.
"""

from __future__ import annotations

import json

import pytest
import torch

from _launch import WORKERS, run_torchrun
from dist.test_drop_in import exported, inputs, mean_of_groups  # noqa: F401  (inputs: a fixture)

WORKER = WORKERS / "trainer_worker.py"
FL_ENV = {"FL_ACCEL_ALGORITHM": "fl_fsdp", "FL_ACCEL_NUM_GROUPS": "2", "FL_ACCEL_SYNC_EVERY": "4"}
COMMON = ("--max_steps", "10", "--gradient_accumulation_steps", "2", "--save_steps", "5")


def launch(kind: str, out, inputs, *extra: str):
    res = run_torchrun(4, WORKER, "--trainer", kind, "--output_dir", str(out), *inputs, *COMMON, *extra,
                       timeout=300, env={"WANDB_DIR": str(out), **(FL_ENV if kind != "plain" else {})})
    assert res.returncode == 0, res.tail()
    return res


def results(out) -> dict:
    return json.loads((out / "results.json").read_text())


def step_logs(out) -> list[dict]:
    """Trainer's per-step log records (``logging_steps=1``), in order."""
    return [h for h in results(out)["log_history"] if "learning_rate" in h]


@pytest.fixture(scope="module")
def plain_and_fl(tmp_path_factory, inputs):  # noqa: F811
    plain, fl = tmp_path_factory.mktemp("trainer_plain"), tmp_path_factory.mktemp("trainer_fl")
    launch("plain", plain, inputs)
    launch("fl", fl, inputs)
    return plain, fl


def test_lr_at_every_step_equals_plain_trainer(plain_and_fl):
    plain, fl = plain_and_fl
    a, b = step_logs(plain), step_logs(fl)
    assert [h["step"] for h in a] == list(range(1, 11))
    assert [h["learning_rate"] for h in a] == [h["learning_rate"] for h in b]  # exactly
    lr = [h["learning_rate"] for h in a]
    assert lr[0] == 0.0 and lr[1] < lr[2] < lr[3] and lr[3] > lr[9] > 0  # warmup 3 steps, then linear decay
    assert [h["fl/syncs"] for h in b] == [0, 0, 0, 1, 1, 1, 1, 2, 2, 3]  # every H=4, and the final sync at 10
    assert "fl/syncs" not in a[0]
    # the loss is normalized by the group's tokens (no world count per step): before the groups
    # diverge (step 1's LR is 0) it is plain Trainer's world mean
    assert [h["loss"] for h in b[:2]] == pytest.approx([h["loss"] for h in a[:2]], rel=1e-6)


def _eval_loss(model, blocks) -> float:
    """The mean loss of ``blocks`` [n, L] under ``model``, one block at a time (equal token counts)."""
    with torch.no_grad():
        return sum(model(input_ids=b[None], labels=b[None]).loss.item() for b in blocks) / len(blocks)


def test_saved_model_is_the_groups_mean_loads_and_is_what_evaluate_scores(plain_and_fl):
    from transformers import AutoModelForCausalLM

    _, fl = plain_and_fl
    saved, mean = exported(fl / "final"), mean_of_groups(fl)
    assert set(saved) <= set(mean) and len(saved) >= 20
    assert max((saved[k] - mean[k]).abs().max().item() for k in saved) < 1e-6
    model = AutoModelForCausalLM.from_pretrained(fl / "final")
    assert torch.equal(dict(model.named_parameters())["model.norm.weight"].detach(), saved["model.norm.weight"])
    # evaluate() after train(): 16 blocks (2 full global batches of 4 ranks x 2; dataloader_drop_last)
    blocks = torch.load(fl / "eval_blocks.pt")[:16]
    federated = _eval_loss(model, blocks)
    reported = results(fl)["eval"]["eval_loss"]
    assert abs(reported - federated) < 2e-6, (reported, federated)
    for f in (0, 1):  # each group's own model before the final sync scores measurably differently
        model.load_state_dict(torch.load(fl / f"group{f}-before-last-sync.pt"), strict=False)
        assert abs(_eval_loss(model, blocks) - reported) > 5e-5, f


def test_checkpoints_hold_the_federated_state_and_model_files_when_the_groups_agree(plain_and_fl):
    _, fl = plain_and_fl
    mid, last = fl / "checkpoint-5", fl / "checkpoint-10"
    for ckpt in (mid, last):
        assert (ckpt / "fl_state" / "fl_accel_checkpoint.json").is_file(), sorted(p.name for p in ckpt.iterdir())
        assert (ckpt / "trainer_state.json").is_file() and (ckpt / "scheduler.pt").is_file()
    assert not (mid / "model.safetensors").exists()  # step 5 is mid-round: saving never syncs
    assert torch.equal(exported(last)["model.norm.weight"], exported(fl / "final")["model.norm.weight"])


def test_resume_from_a_mid_round_checkpoint_equals_the_uninterrupted_run(plain_and_fl, tmp_path, inputs):  # noqa: F811
    _, fl = plain_and_fl
    launch("fl", tmp_path, inputs, "--stop_after", "5")
    assert (tmp_path / "checkpoint-5").is_dir() and not (tmp_path / "final").exists()
    launch("fl", tmp_path, inputs, "--resume_from_checkpoint", str(tmp_path / "checkpoint-5"))
    resumed, straight = exported(tmp_path / "final"), exported(fl / "final")
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)
    after = [(h["step"], h["loss"], h["learning_rate"]) for h in step_logs(tmp_path) if h["step"] > 5]
    assert after == [(h["step"], h["loss"], h["learning_rate"]) for h in step_logs(fl) if h["step"] > 5]
    assert results(tmp_path)["eval"]["eval_loss"] == results(fl)["eval"]["eval_loss"]


def test_trl_sft_trainer_with_the_same_swap(tmp_path, inputs):  # noqa: F811
    pytest.importorskip("trl", reason="TRL is not installed (pip install trl; requirements.txt installs it)")
    launch("sft", tmp_path, inputs, "--save_steps", "4")
    logs = step_logs(tmp_path)
    assert len(logs) == 10 and logs[-1]["loss"] < logs[0]["loss"] and logs[-1]["fl/syncs"] == 3
    assert "mean_token_accuracy" in logs[0]  # SFTTrainer's own metrics
    for step in (4, 8):  # multiples of H: the groups agree, the checkpoint has the model
        assert (tmp_path / f"checkpoint-{step}" / "model.safetensors").is_file()
    saved, mean = exported(tmp_path / "final"), mean_of_groups(tmp_path)
    assert max((saved[k] - mean[k]).abs().max().item() for k in saved) < 1e-6
