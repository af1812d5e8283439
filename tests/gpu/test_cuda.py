"""Checks that only a GPU can make: NCCL rejects CPU tensors in collectives, gloo accepts them.

Users run fl_accel on GPUs with NCCL and bf16. A CPU tensor passed to a collective on the
default process group (plain "nccl" in accelerate 1.15, ``accelerate/state.py``) raises
there and passes on gloo, so CPU runs cannot catch it. These tests run every collective of
the library and the recipe on a 1-process NCCL group (which still rejects CPU tensors: none
of the code skips its collectives at world size 1) and the recipe end to end on one GPU.
They run on the device machine when one is lent; elsewhere they are skipped.
"""

from __future__ import annotations

import json

import pytest
import torch

from _launch import REPO_ROOT, WORKERS, run_torchrun

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: NCCL rejects CPU tensors in collectives while gloo accepts them, so only a GPU "
           "run can catch a collective on a tensor left on the CPU")


def test_every_collective_runs_on_a_one_process_nccl_group(tmp_path):
    res = run_torchrun(1, WORKERS / "api_worker.py", "collectives", str(tmp_path), timeout=600,
                       launcher="torchrun")
    assert res.returncode == 0, res.tail()
    rec = json.loads((tmp_path / "collectives-rank0.json").read_text())
    assert rec["backend"] == "nccl" and rec["device"].startswith("cuda") and rec["ok"]
    assert rec["main_first"] == "ok"
    assert rec["eval"][0] > 1 and rec["eval_per_group"] == pytest.approx(rec["eval"])
    assert rec["exchange_fp32_max_err"] == 0.0
    assert rec["exchange_bf16_max_err"] <= 2 ** -8 and rec["exchange_int8_max_err"] <= 1 / 127
    for collectives in ("all_to_all", "all_gather"):  # sync_collectives: both int8 wires stay on the GPU
        device, err = rec[f"exchange_int8_{collectives}"]
        assert device.startswith("cuda") and err <= 1 / 127, (collectives, device, err)
    assert rec["exchange_sparse_device"].startswith("cuda") and rec["exchange_sparse_vs_cpu"] <= 1e-6
    assert rec["group_max"] == 2.5 and rec["group_table"] == [[3.0, 1.5, 0.25, 3.0]]  # float64 on NCCL


def test_recipe_on_one_gpu_in_bf16(tmp_path):
    """The recipe as one plain process on a GPU (NCCL group of one, bf16): it trains, evaluates,
    checkpoints, resumes and exports the final model."""
    import subprocess
    import sys

    out = tmp_path / "run"
    args = [sys.executable, str(REPO_ROOT / "recipes" / "pretrain.py"), "--algorithm", "fsdp", "--max_steps", "4",
            "--seq_len", "128", "--micro_batch_size", "2", "--max_eval_blocks", "16", "--checkpoint_every", "2",
            "--report_to", "none", "--mixed_precision", "bf16", "--output_dir", str(out),
            "--cache_dir", str(tmp_path / "cache")]
    proc = subprocess.run(args, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((out / "all_results.json").read_text())
    assert results["steps"] == 4 and results["eval_loss"] > 0
    assert (out / "final_model" / "model.safetensors").is_file()


def test_recipe_refuses_a_model_that_cannot_fit_before_building_it(tmp_path):
    """Llama-3.1-8B's shape (the tokenizer's vocabulary) on one GPU, unsharded: about 100 GiB of
    parameters, gradients and AdamW state: the memory check (recipes/memory_check.py, the GPU's
    own memory through an NCCL all-reduce) stops the run with its one line before the model is
    built, naming the memory model's verdict; ``--memory_check off`` skips it (not run here)."""
    import subprocess
    import sys

    args = [sys.executable, str(REPO_ROOT / "recipes" / "pretrain.py"), "--algorithm", "fsdp", "--model",
            "llama3.1-8b", "--resize_vocab", "--max_steps", "1", "--seq_len", "256", "--report_to", "none",
            "--mixed_precision", "bf16", "--output_dir", str(tmp_path / "run"), "--cache_dir", str(tmp_path / "cache")]
    proc = subprocess.run(args, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "does not fit" in proc.stderr and "--memory_check warn runs anyway" in proc.stderr, proc.stderr[-4000:]


def test_outer_state_device_cpu_keeps_the_outer_state_in_pinned_host_memory(tmp_path):
    """One GPU, a 1-process NCCL group (F=1 on the world group: the "fl" collectives still
    run), the synchronizer's outer step driven through four fragment syncs, each launched,
    advanced and applied with the parameters moving in between (training meanwhile), for fp32
    + "nesterov" and for int8 + error feedback + "nesterov" (P=2, alpha 0.5). With
    outer_state_device="cpu": the anchor and the residuals are pinned CPU tensors and the momentum
    a CPU tensor; the parameters, every tensor given to a collective, the exchange's buffers
    and the means stay on cuda; the outer state holds (almost) no device memory, while "same"
    holds at least 4 bytes x numel for each of anchor, momentum and residuals. The parameters
    equal those of "same" after every sync: within fp32 rounding for fp32 (the outer step runs
    on CPU kernels instead of CUDA ones), and for int8 within two quantization steps, with
    almost every value equal (an fp32 rounding difference can flip an int8 rounding). State
    moves between the placements unchanged, and DCP saves and loads a host tensor keyed by
    shard (as the checkpoint keeps the sync's state) without moving it to the GPU."""
    res = run_torchrun(1, WORKERS / "api_worker.py", "outer_state_device", str(tmp_path), timeout=600,
                       launcher="torchrun")
    assert res.returncode == 0, res.tail()
    rec = json.loads((tmp_path / "outer_state_device-rank0.json").read_text())
    assert rec["backend"] == "nccl" and rec["device"].startswith("cuda") and rec["ok"]
    n = rec["numel"]
    for label in ("fp32", "int8_ef"):
        same, cpu = rec["runs"][f"{label}/same"], rec["runs"][f"{label}/cpu"]
        for run in (same, cpu):
            for key in ("param_devices", "collective_devices"):
                assert all(d.startswith("cuda") for d in run[key]), (label, key, run[key])
            assert all(d.startswith("cuda") for d in run["buffers"] + run["means"]), label
        assert cpu["anchor"] == {"devices": ["cpu"], "pinned": [True] * 3}, cpu["anchor"]
        assert cpu["momentum"]["devices"] == ["cpu"] and len(cpu["momentum"]["pinned"]) == 3
        assert same["anchor"]["devices"][0].startswith("cuda") and same["momentum"]["devices"][0].startswith("cuda")
        kinds = 3 if label == "int8_ef" else 2
        if label == "int8_ef":
            assert cpu["residual"] == {"devices": ["cpu"], "pinned": [True] * 3}, cpu["residual"]
            assert same["residual"]["devices"][0].startswith("cuda")
        assert same["state_bytes_on_device"] >= kinds * 4 * n, same["state_bytes_on_device"]
        assert cpu["state_bytes_on_device"] < 4 * n, cpu["state_bytes_on_device"]  # at most a freed bucket pending
        for k, (ps, pc) in enumerate(zip(same["params"], cpu["params"])):
            for x, y in zip(ps, pc):
                x, y = torch.tensor(x).flatten(), torch.tensor(y).flatten()
                diff = (x - y).abs()
                if label == "fp32":
                    assert torch.allclose(x, y, rtol=1e-5, atol=1e-5), (k, diff.max().item())
                else:
                    assert diff.max() <= 2e-2 and (diff > 1e-5).float().mean() <= 0.02, (k, diff.max().item())
        moved = (torch.tensor(same["params"][-1][0]) - torch.tensor(same["params"][0][0])).abs().max()
        assert moved > 0.1  # not vacuous: the parameters moved over the syncs
    assert rec["state_round_trip_equal"] == {"cpu->same": True, "same->cpu": True}
    assert rec["dcp_host"] == {"wrapped_local_device": "cpu", "same_storage": True, "loaded_equal": True,
                               "mesh": "cuda"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events, side streams and allocator peaks need a GPU")
def test_sync_on_cuda_streams_events_and_bounded_buckets():
    """No process group (the fake transport of tests/unit/test_schedule.py): the synchronizer on CUDA
    packs on a side stream and times its sync events with CUDA events on the compute stream.
    sync_wait_seconds is 0 before the first sync and positive after; an fp32 and an int8 +
    nesterov run give the CPU run's parameters (fp32 bitwise, int8 within a quantization step);
    a blocking sync of 16 MiB in 1 MiB buckets raises the allocator's peak by at most about two
    buckets (plus the quantized copies), not the whole model."""
    from unit.test_schedule import FakeTransport, _synchronizer, _train

    for fields, exact in (({"sync_every": 2}, True),
                          ({"sync_every": 2, "sync_dtype": "int8", "outer_optimizer": "nesterov"}, False)):
        results = {}
        for device in ("cpu", "cuda"):
            transport = FakeTransport(offset=1.0 if exact else 0.0)
            transport.device = torch.device(device)
            sync, params = _synchronizer(transport, device=device, **fields)
            _train(sync, params, 1)
            assert sync.clock.seconds == 0.0
            _train(sync, params, 3, start=1)
            assert sync.clock.seconds > 0.0
            results[device] = [p.detach().cpu() for p in params]
        for a, b in zip(results["cpu"], results["cuda"]):
            assert torch.equal(a, b) if exact else torch.allclose(a, b, atol=2e-2), fields
    mib = 2**18
    transport = FakeTransport(offset=1.0)
    transport.device = torch.device("cuda")
    sync, params = _synchronizer(transport, sizes=(mib,) * 16, device="cuda", sync_every=1, sync_bucket_mb=1)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    sync.on_optimizer_step()
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base <= 3 * 4 * mib, torch.cuda.max_memory_allocated() - base



@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host copies and CUDA events of the kept "
                    "parameters need a GPU")
def test_overlap_keep_and_warmup_on_cuda_match_the_cpu_run():
    """No process group (the fake transport): P=2, H=4, tau=H, "keep" (two fragments in flight,
    each rank's parameters at the launch kept on the GPU, or pinned on the host with
    outer_state_device="cpu"), and a 2-step warm-up whose gradient mean runs before the
    optimizer step: the CUDA runs give the CPU run's parameters (fp32 exchange; within 1e-5, the
    GPU's fused multiply-adds in the outer step aside), and the kept parameters of "cpu" are
    pinned host tensors."""
    from unit.test_schedule import FakeTransport, _synchronizer

    fields = dict(sync_every=4, num_fragments=2, sync_delay=4, delayed_local_steps="keep", sync_warmup_steps=2,
                  outer_optimizer="nesterov")
    results = {}
    for device, where in (("cpu", "same"), ("cuda", "same"), ("cuda", "cpu")):
        transport = FakeTransport(offset=1.0)
        transport.device = torch.device(device)
        sync, params = _synchronizer(transport, device=device, outer_state_device=where, **fields)
        sync.attach()
        for step in range(9):
            for p in params:
                p.grad = torch.full_like(p, 0.01 * (step + 1))
            sync.optimizer.step()
            if step == 6 and where == "cpu":
                kept = [t for f in sync.fragments for t in (f.launched or ())]
                assert kept and all(t.device.type == "cpu" and t.is_pinned() for t in kept)
        sync.sync(final=True)
        torch.cuda.synchronize()
        results[(device, where)] = [p.detach().cpu() for p in params]
        sync.detach()
    for key in (("cuda", "same"), ("cuda", "cpu")):
        assert all(torch.allclose(a, b, rtol=0, atol=1e-5) for a, b in zip(results[("cpu", "same")], results[key])), \
            key
