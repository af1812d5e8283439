"""FLAccelerator as a drop-in for Accelerator: a script written for Accelerate, run twice on 4
gloo processes with only the line that builds the accelerator changed
(tests/workers/clm_worker.py, the shape of transformers' run_clm_no_trainer.py).

* The LR at every optimizer step equals the plain run's: the script sizes its scheduler
  the Accelerate way (times ``num_processes``), and FLAccelerator steps it as Accelerate does.
* The run ends with exit 0 and its final export, ``unwrap_model(model).save_pretrained(...)``
  called before ``end_training()`` mid-round, is the mean of the groups (their parameters
  right before the sync the export triggered) and loads with ``from_pretrained``.
* A run killed after its step-10 checkpoint and resumed with ``load_state`` +
  ``skip_first_batches`` ends with the uninterrupted run's model.
* ``accelerator.save_model`` and ``save_pretrained(state_dict=accelerator.get_state_dict(model))``
  export the same federated model; ``model.no_sync()`` (DDP's call, which Accelerate's
  autoregressive example makes) works on the FSDP2 model.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from _launch import WORKERS, run_torchrun

WORKER = WORKERS / "clm_worker.py"
FL_ENV = {"FL_ACCEL_ALGORITHM": "fl_fsdp", "FL_ACCEL_NUM_GROUPS": "2", "FL_ACCEL_SYNC_EVERY": "4"}
STEPS = "11"  # not a multiple of H=4: the export comes mid-round and must sync first


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Text files, a 300-token byte-level BPE and a 2-layer Llama config, as a user's local files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("clm_inputs")
    words = "to be or not that is the question whether tis nobler in mind suffer slings arrows fortune".split()
    rng = random.Random(0)
    lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(200)]
    (root / "train.txt").write_text("\n".join(lines[:170]))
    (root / "val.txt").write_text("\n".join(lines[170:]))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    fast.save_pretrained(root / "tokenizer")
    LlamaConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2, max_position_embeddings=64).save_pretrained(root / "config")
    return ["--train_file", str(root / "train.txt"), "--validation_file", str(root / "val.txt"),
            "--config_name", str(root / "config"), "--tokenizer_name", str(root / "tokenizer")]


def launch(kind: str, out, inputs, *extra: str, env: dict | None = None):
    env = {"WANDB_DIR": str(out), **(FL_ENV if kind == "fl" else {}), **(env or {})}
    res = run_torchrun(4, WORKER, "--accelerator", kind, "--output_dir", str(out), *inputs, *extra, timeout=300,
                       env=env)
    assert res.returncode == 0, res.tail()
    return res


COMMON = ("--max_train_steps", STEPS, "--gradient_accumulation_steps", "2", "--checkpointing_steps", "5")


@pytest.fixture(scope="module")
def plain_and_fl(tmp_path_factory, inputs):
    """The same script under Accelerator and under FLAccelerator (tracking on)."""
    plain, fl = tmp_path_factory.mktemp("plain"), tmp_path_factory.mktemp("fl")
    launch("plain", plain, inputs, *COMMON, "--with_tracking")
    launch("fl", fl, inputs, *COMMON, "--with_tracking")
    return plain, fl


def lrs(out) -> list[dict]:
    return [json.loads((out / f"lr-rank{r}.json").read_text()) for r in range(4)]


def exported(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def mean_of_groups(out) -> dict[str, torch.Tensor]:
    g0, g1 = (torch.load(out / f"group{f}-before-last-sync.pt") for f in (0, 1))
    return {k: ((g0[k].double() + g1[k].double()) / 2).float() for k in g0}


def test_lr_at_every_step_equals_plain_accelerator(plain_and_fl):
    plain, fl = plain_and_fl
    a, b = lrs(plain), lrs(fl)
    assert len(a[0]) == int(STEPS)
    assert a == b  # every rank, every optimizer step, exactly
    warm = [a[0][str(s)] for s in (1, 2, 3, 4)]
    assert warm[0] == 0.0 and warm[1] < warm[2] < warm[3]  # the warmup takes 3 optimizer steps, not 12


def test_final_save_pretrained_before_end_training_is_the_federated_model(plain_and_fl):
    from transformers import AutoModelForCausalLM

    _, fl = plain_and_fl
    saved, mean = exported(fl / "final"), mean_of_groups(fl)
    assert set(saved) <= set(mean) and len(saved) >= 20
    g0 = torch.load(fl / "group0-before-last-sync.pt")
    assert max((g0[k] - mean[k]).abs().max().item() for k in saved) > 1e-6  # the groups did differ
    assert max((saved[k] - mean[k]).abs().max().item() for k in saved) < 1e-6
    model = AutoModelForCausalLM.from_pretrained(fl / "final")
    assert torch.equal(dict(model.named_parameters())["model.norm.weight"].detach(), saved["model.norm.weight"])
    assert json.loads((fl / "all_results.json").read_text())["steps"] == int(STEPS)
    assert list((fl / "wandb").glob("offline-run-*")), "the tracker wrote nothing"


def test_resume_after_a_crash_ends_with_the_uninterrupted_model(plain_and_fl, tmp_path, inputs):
    _, fl = plain_and_fl
    launch("fl", tmp_path, inputs, *COMMON, "--stop_after", "5")
    assert (tmp_path / "step_5").is_dir() and not (tmp_path / "final").exists()
    launch("fl", tmp_path, inputs, *COMMON, "--resume_from_checkpoint", str(tmp_path / "step_5"))
    resumed, straight = exported(tmp_path / "final"), exported(fl / "final")
    assert max((resumed[k] - straight[k]).abs().max().item() for k in straight) < 1e-6
    assert lrs(tmp_path) == lrs(fl)


def test_save_model_get_state_dict_and_model_no_sync(tmp_path, inputs):
    """Two more exports of one short run each: ``save_model`` after accumulating with
    ``model.no_sync()``, and ``save_pretrained(state_dict=accelerator.get_state_dict(model))``
    after checkpointing with Accelerate's automatic naming (``save_state()`` every 2 steps,
    ``total_limit=2``, then ``load_state()`` of the latest)."""
    short = ("--max_train_steps", "6", "--gradient_accumulation_steps", "2", "--num_warmup_steps", "1")
    a, b = tmp_path / "save_model", tmp_path / "state_dict"
    launch("fl", a, inputs, *short, "--export", "save_model", "--model_no_sync")
    launch("fl", b, inputs, *short, "--export", "save_pretrained_state_dict", "--checkpointing_steps", "2",
           "--automatic_checkpoint_naming")
    for out in (a, b):
        saved, mean = exported(out / "final"), mean_of_groups(out)
        assert max((saved[k] - mean[k]).abs().max().item() for k in saved) < 1e-6, out.name
    kept = sorted(p.name for p in (b / "checkpoints").iterdir())
    assert kept == ["checkpoint_1", "checkpoint_2"], kept  # three saves, the oldest removed
    assert all((b / "checkpoints" / k / "fl_accel_checkpoint.json").is_file() for k in kept)
