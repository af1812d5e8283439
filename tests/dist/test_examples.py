"""The examples the README sends users to run, run as a user would (short settings).

* examples/train_loop.py (the README's "use it in your own Accelerate loop"): 4 gloo
  processes, FL+FSDP with 2 groups of 2, H=4, 8 optimizer steps under gradient
  accumulation. It trains (finite loss, below a uniform guess), syncs twice, carries
  traffic on the "fl" axis, and after the final sync every shard is equal across the
  groups.
* examples/trainer.py (the README's Trainer swap): FLTrainer trains 8 steps, checkpoints at
  multiples of H with model files, and exports a model ``from_pretrained`` loads.
* examples/run_clm_no_trainer.py (the canonical Accelerate script, swapped): trains, checkpoints
  mid-round, and a resumed launch ends with the same evaluation and model, bitwise.
* examples/train_loop.py's checksum after a forward without backward (FSDP2 leaves the root
  unit unsharded): still this rank's shards, as after a training step.
* examples/slurm_multinode.sh: its srun/torchrun line (c10d rendezvous, through
  scripts.launch_guard) run for real as a one-node job under stand-ins for srun and scontrol.
* examples/torchft_two_groups.sh (the torchft how-to): a Lighthouse and two torchruns
  through ``python -m scripts.ft_launch``, each running examples/train_loop.py in the
  fault-tolerant mode. Both groups finish their steps, each sync is a quorum of both, and
  their models are equal after the final sync. One rank per group (the script's
  ``NPROC_PER_GROUP=1``): each rank of a real torchrun imports torch, transformers and
  fl_accel (about 10 CPU-s), and what the second rank of a group adds, FSDP2 inside a
  torchft group, is tested on forked ranks in tests/ft/test_ft.py.
"""

from __future__ import annotations

import json
import math
import re
import subprocess

import pytest

import torch

from _launch import REPO_ROOT, WORKERS, launch_env, run_torchrun
from dist.test_drop_in import inputs  # noqa: F401  (a fixture: local text files)

EXAMPLE = REPO_ROOT / "examples" / "train_loop.py"
RESULT = re.compile(r"^\[train_loop\] result (\{.*\})$", re.M)
STEP = re.compile(r"^\[train_loop\] step (\d+): loss ([0-9.]+)", re.M)


def _results(text: str) -> list[dict]:
    return [json.loads(m) for m in RESULT.findall(text)]


def test_train_loop_trains_syncs_and_ends_with_identical_groups():
    res = run_torchrun(4, EXAMPLE, "--num_groups", "2", "--sync_every", "4", "--max_steps", "8",
                       "--log_every", "4", timeout=300)
    assert res.returncode == 0, res.tail()
    [result] = _results(res.stdout)
    assert (result["algorithm"], result["num_groups"], result["fault_tolerance"]) == ("fl_fsdp", 2, "none")
    assert result["steps"] == 8 and result["num_syncs"] == 2, result
    assert result["loss_finite"] and result["final_loss"] < math.log(256), result  # below a uniform guess
    losses = {int(s): float(v) for s, v in STEP.findall(res.stdout)}
    assert sorted(losses) == [4, 8] and losses[8] < losses[4], losses
    assert result["comm_bytes"]["fl"] > 0 and result["comm_bytes"]["dp_shard"] > 0, result["comm_bytes"]
    shards = result["shards"]
    assert sorted((s["group"], s["shard"]) for s in shards) == [(0, 0), (0, 1), (1, 0), (1, 1)], shards
    for k in (0, 1):  # the same shard in both groups: the same values after the final sync
        assert len({s["checksum"] for s in shards if s["shard"] == k}) == 1, shards
    assert result["groups_identical"] is True


def test_train_loop_checksum_is_of_the_shards_after_a_forward_without_backward():
    """examples/train_loop.py ends a torchft run that healed last with a ``no_grad`` forward
    (the healed state's loss), which leaves FSDP2's root unit unsharded; its checksum (2 ranks,
    FSDP2 over both; tests/workers/example_checksum_worker.py) is still the shards' sum, as
    after the training step (before the fix, full tensors were summed and equal groups printed
    different checksums). Two ranks per group through the real torchft example (a kill and a
    heal) would cost minutes of CPU here."""
    res = run_torchrun(2, WORKERS / "example_checksum_worker.py", timeout=240)
    assert res.returncode == 0, res.tail()
    recs = [json.loads(m) for m in re.findall(r"^\[checksum\] (\{.*\})$", res.stdout, re.M)]
    assert sorted(r["rank"] for r in recs) == [0, 1], res.tail()
    for r in recs:
        assert r["after_forward"] == r["trained"], r  # "unsharded_after_forward": what the fix undoes
    assert recs[0]["trained"] != recs[1]["trained"]  # each rank sums its own shard


def test_torchft_example_runs_two_groups_to_the_end(tmp_path):
    pytest.importorskip("torchft", reason="torchft is not installed (pip install torchft==0.2.0)")
    from scripts import ft_launch

    logs = tmp_path / "logs"
    env = launch_env({"LOG_DIR": str(logs), "MAX_RESTARTS": "0", "NPROC_PER_GROUP": "1"})
    proc = subprocess.Popen(["bash", str(REPO_ROOT / "examples" / "torchft_two_groups.sh"), "--max_steps", "4"],
                            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=420)
    finally:
        if proc.poll() is None:
            ft_launch.kill_group(proc)
    group_logs = "\n".join((logs / f"group{f}.log").read_text()[-3000:] for f in range(2)
                           if (logs / f"group{f}.log").exists())
    assert proc.returncode == 0 and "group exit statuses: [0, 0]" in out, out + group_logs
    results = {r["group_index"]: r for r in _results(out)}
    assert sorted(results) == [0, 1], out
    for f, r in results.items():
        assert r["fault_tolerance"] == "torchft" and r["num_groups"] == 2, r
        assert r["steps"] == 4 and r["num_syncs"] == 1 and r["loss_finite"], r
        assert r["comm_bytes"]["fl"] > 0, r["comm_bytes"]  # the exchange over torchft's process group
        assert [(s["group"], s["shard"]) for s in r["shards"]] == [(f, 0)], r["shards"]  # each launch is one group
    checksums = [{s["shard"]: s["checksum"] for s in results[f]["shards"]} for f in (0, 1)]
    assert checksums[0] == checksums[1], checksums  # equal after the final sync


def test_trainer_example_trains_checkpoints_and_exports_the_federated_model(tmp_path):
    """examples/trainer.py (the README's Trainer swap): FLTrainer with 2 groups of 2, H=4, 8
    steps, a checkpoint every 4 (multiples of H: model files too), evaluate() and save_model."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    res = run_torchrun(4, REPO_ROOT / "examples" / "trainer.py", "--num_groups", "2", "--sync_every", "4",
                       "--max_steps", "8", "--save_steps", "4", "--output_dir", str(out), timeout=300)
    assert res.returncode == 0, res.tail()
    [line] = re.findall(r"^\[trainer\] result (\{.*\})$", res.stdout, re.M)
    result = json.loads(line)
    assert (result["trainer"], result["num_groups"], result["world_size"]) == ("FLTrainer", 2, 4), result
    assert result["steps"] == 8 and result["num_syncs"] == 2 and result["eval_loss"] < math.log(256), result
    for step in (4, 8):
        assert (out / f"checkpoint-{step}" / "model.safetensors").is_file()
        assert (out / f"checkpoint-{step}" / "fl_state" / "fl_accel_checkpoint.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert model.config.num_hidden_layers == 2


def test_run_clm_no_trainer_example_trains_checkpoints_and_resumes_exactly(tmp_path, inputs):  # noqa: F811
    """examples/run_clm_no_trainer.py (the canonical Accelerate script with the one-line swap), on
    local text files with its own BPE: 6 steps, H=4 (FL_ACCEL_SYNC_EVERY), a checkpoint at step 3
    (mid-round); a second launch resumes from it and ends with the same evaluation and model. The
    first launch has ``--with_tracking`` and no ``WANDB_MODE`` (as from a bare shell, no W&B key):
    W&B runs offline, its run under ``--output_dir``, not the working directory."""
    from safetensors.torch import load_file

    files = inputs[:4]  # --train_file, --validation_file
    args = [*files, "--vocab_size", "300", "--block_size", "32", "--max_train_steps", "6", "--checkpointing_steps",
            "3"]
    script = REPO_ROOT / "examples" / "run_clm_no_trainer.py"
    env = {"FL_ACCEL_SYNC_EVERY": "4"}
    a, b = tmp_path / "a", tmp_path / "b"
    res = run_torchrun(4, script, *args, "--output_dir", str(a), "--with_tracking", timeout=300,
                       env={**env, "WANDB_MODE": None, "WANDB_API_KEY": None, "WANDB_DIR": None})
    assert res.returncode == 0, res.tail()
    assert f"wrote the federated model to {a / 'final'}" in res.stdout, res.tail()  # where its outputs are
    assert len(list((a / "wandb").glob("offline-run-*"))) == 1, sorted(p.name for p in a.iterdir())
    straight = json.loads((a / "all_results.json").read_text())
    assert straight["steps"] == 6 and straight["syncs"] == 2 and straight["perplexity"] < 300, straight
    (b / "step_3").parent.mkdir()
    import shutil

    shutil.copytree(a / "step_3", b / "step_3")
    shutil.copytree(a / "tokenizer", b / "tokenizer")
    res = run_torchrun(4, script, *args, "--output_dir", str(b), "--resume_from_checkpoint", str(b / "step_3"),
                       timeout=300, env=env)
    assert res.returncode == 0, res.tail()
    assert json.loads((b / "all_results.json").read_text()) == straight
    x, y = load_file(a / "final" / "model.safetensors"), load_file(b / "final" / "model.safetensors")
    assert all(torch.equal(x[k], y[k]) for k in x)


def test_slurm_example_launches_one_torchrun_per_node(tmp_path):
    """examples/slurm_multinode.sh under stand-ins for ``srun`` (runs the command once, as node
    0 of a one-node job) and ``scontrol`` (prints localhost): the real torchrun with its c10d
    rendezvous, through scripts.launch_guard, runs examples/train_loop.py as 2 federation groups
    of one CPU process (NUM_GROUPS=2, GPUS_PER_NODE=2: each real torchrun rank imports torch,
    transformers and fl_accel, about 10 CPU-s)."""
    import os

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/sh\nwhile [ "${1#--}" != "$1" ]; do shift; done\nexec "$@"\n')
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho localhost\n")
    for f in ("srun", "scontrol"):
        (bin_dir / f).chmod(0o755)
    from scripts.launch import free_port

    env = launch_env({"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_NNODES": "1",
                      "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": "pytest", "NUM_GROUPS": "2",
                      "GPUS_PER_NODE": "2", "MASTER_PORT": str(free_port())})
    proc = subprocess.run(["bash", str(REPO_ROOT / "examples" / "slurm_multinode.sh"), "examples/train_loop.py",
                           "--max_steps", "4", "--sync_every", "2", "--log_every", "2"], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "[slurm] 1 nodes x 2 GPUs, 2 federation groups, rendezvous localhost:" in proc.stdout
    [result] = _results(proc.stdout)
    assert result["num_groups"] == 2 and result["steps"] == 4 and result["num_syncs"] == 2, result
    assert result["groups_identical"] is True
