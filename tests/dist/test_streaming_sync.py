"""Streaming fragments, delayed application, outer optimizers, compressed exchange and
resume, checked step by step on real gloo processes against references.

The spec is torchft's streaming DiLoCo (``torchft.local_sgd.DiLoCo``, 0.2.0; Streaming
DiLoCo, arXiv 2501.18512): one fragment of the FSDP units (dealt strided) syncs every
H/P optimizer steps, round-robin; its pseudo-gradient ``anchor - theta`` is launched at
local step H/P - tau and applied at H/P with the outer optimizer ("avg": anchor -
mean; "nesterov": torch SGD), then ``theta <- global + alpha (theta_now - global)``.
``end_training`` completes an in-flight exchange, then syncs everything with alpha=0.

Launches (tests/workers/stream_worker.py, 4 processes = FL+FSDP 2 groups x 2 shards,
a tiny Llama, inner SGD, fixed per-rank batches):

1. one launch runs the invalid settings (section f) and every training scenario
   below, recording every rank's local shards after every optimizer step;
2. one launch resumes the runs checkpointed mid-exchange in launch 1 (section e);
3. one 8-process launch (FL+HSDP 2 groups x 2 replicas x 2 shards) for the bitwise
   FedAvg, the chunked int8 exchange and a mid-exchange checkpoint round trip.

Section g runs outer_state_device="cpu" against "same" (bitwise, also across a resume that
switches the setting). Three tests pin checkpoint behaviour outside the synchronizer: DCP's zero-lr "fake"
optimizer step (taken by get/set_optimizer_state_dict when an optimizer has no state)
must not advance the sync schedule, and each HSDP replica's error-feedback residual is
its own.

References:

* :func:`simulate`, a single-process simulation written from the spec above (each
  group's full parameters in one model; a group's inner step is SGD on the mean of its
  two ranks' losses, which is the gradient FSDP computes);
* torchft 0.2.0's own ``DiLoCo``, run in this process with one thread per federation
  group and :class:`_FakeManager`, a stand-in for ``torchft.manager.Manager`` whose
  ``allreduce`` averages over the threads (SUM then divide, as the real one). Fragments
  are ``nn.ParameterList`` views of the FSDP units' parameters, with one outer optimizer
  per fragment. torchft has no final sync of everything, so ``end_training`` is compared
  with the simulation only. Needs ``torchft==0.2.0`` (requirements.txt; a CPU wheel on
  PyPI); without it those tests skip.

Measured figures are printed (``pytest -s``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
from pathlib import Path

import pytest
import torch

from _launch import WORKERS, run_torchrun, write_json
from fl_accel import FLConfig
from fl_accel.codecs import Quantized
from fl_accel.wire import BLOCK, QMAX
from workers._scenario import validated


def quantize(x, sync_dtype, rows):
    return Quantized(sync_dtype).quantize(x, rows)


def dequantize(buf, sync_dtype):
    return Quantized(sync_dtype).dequantize(buf)


def quantization_error_bound(x: torch.Tensor, sync_dtype: str) -> torch.Tensor:
    """Per-element bound of ``|dequantize(quantize(x)) - x|`` in fp32: half an int8 step
    ``scale / 2`` of the element's block, widened by the fp32 roundings of ``x / scale``
    (at most 127 * 2^-24 of a step) and of ``q * scale`` and the difference (2^-23 |x|);
    for bf16 half an ulp of its 8 significant bits (at most 2^-8 |x|)."""
    if sync_dtype == "bf16":
        return x.abs() * 2.0 ** -8 + torch.finfo(torch.float32).tiny
    blocks = x.reshape(-1, BLOCK)
    scale = blocks.abs().amax(dim=1, keepdim=True) / QMAX
    return (scale * 0.5 * (1 + 2.0 ** -15)).expand_as(blocks).reshape(x.shape) + x.abs() * 2.0 ** -23


WORKER = WORKERS / "stream_worker.py"
LAUNCH_TIMEOUT = 600  # seconds; a hang fails the test instead of blocking the suite
F = 2  # federation groups in every scenario
STEPS, LR = 11, 0.5
TOL = 1e-6

FL2 = {"algorithm": "fl_fsdp", "num_groups": F}
STREAM = {**FL2, "sync_every": 6, "num_fragments": 2}  # a fragment syncs every H/P = 3 steps
NESTEROV = {"outer_optimizer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.9}
EXACT_A = {**STREAM, "sync_delay": 1, "fragment_update_alpha": 0.5, **NESTEROV}
EXACT_B = {**STREAM, "sync_delay": 0, "fragment_update_alpha": 0.0, "outer_optimizer": "avg"}
WIRE = {**STREAM, "sync_delay": 2}  # launch at local step 1, all-gather at 2 (all_to_all), apply at 3
A2A = {"sync_collectives": "all_to_all"}  # the two-collective path; "auto" (F = 2) is one all-gather
# int8 + EF resume: H/P = 4, tau = 2: launch at local step 2, all-gather at 3, apply at 4
RESUME_INT8 = {**FL2, "sync_every": 8, "num_fragments": 2, "sync_delay": 2, "sync_dtype": "int8",
               "error_feedback": True, **NESTEROV}
LAUNCH_AT_1 = {**WIRE, "sync_dtype": "int8", "error_feedback": True, **NESTEROV}  # launch at local step 1
# outer_state_device: H/P = 3, tau = 1 (launch at local step 2, apply at 3), int8 + EF, "nesterov": every kind of outer state
ANCHOR_SAME = {**STREAM, "sync_delay": 1, "sync_dtype": "int8", "error_feedback": True, **NESTEROV}
ANCHOR_CPU = {**ANCHOR_SAME, "outer_state_device": "cpu"}
# sparse (SparseLoCo-style top-k + 2-bit values + EF): H/P = 3, tau = 1 (launch at local step 2, apply at 3)
SPARSE = {**STREAM, "sync_delay": 1, "sync_dtype": "sparse", "error_feedback": True}
SPARSE_N = {**SPARSE, **NESTEROV}  # the defaults: "senders" aggregation, decay 0.95, exact final sync
SPARSE_ZERO_FILL = {**SPARSE, "sparse_aggregation": "zero_fill", "error_feedback_decay": 1.0}  # the earlier recipe


def _sc(name, fl, steps=STEPS, **extra):
    return {"name": name, "fl": fl, "steps": steps, "lr": LR, **extra}


SCENARIOS = [
    _sc("exact_a", EXACT_A),
    _sc("exact_b", EXACT_B),
    _sc("fedavg", {**FL2, "sync_every": 3}, steps=7, spy=True),
    _sc("wire_fp32", WIRE, spy=True),
    _sc("wire_bf16", {**WIRE, "sync_dtype": "bf16", **A2A}, spy=True),
    _sc("wire_int8", {**WIRE, "sync_dtype": "int8", **A2A}, spy=True),
    _sc("wire_int8_ef", {**WIRE, "sync_dtype": "int8", "error_feedback": True, **A2A}, spy=True),
    _sc("wire_int8_gather", {**WIRE, "sync_dtype": "int8"}, spy=True),  # "auto" at F = 2: one all-gather
    # resume: SGD with momentum, so the optimizer has state (see test_save_with_stateless_optimizer...)
    _sc("resume_fp32", EXACT_A, momentum=0.9),
    _sc("resume_fp32_saved", EXACT_A, momentum=0.9, save_at=[5]),
    _sc("resume_int8", RESUME_INT8, momentum=0.9),
    _sc("resume_int8_saved", RESUME_INT8, momentum=0.9, save_at=[6, 7]),
    _sc("launch1_int8", LAUNCH_AT_1, momentum=0.9),
    _sc("launch1_int8_saved", LAUNCH_AT_1, momentum=0.9, save_at=[4]),
    _sc("stateless_saved", EXACT_A, save_at=[5]),
    _sc("anchor_same", ANCHOR_SAME, momentum=0.9, save_at=[5]),
    _sc("anchor_cpu", ANCHOR_CPU, momentum=0.9, save_at=[5]),
    _sc("sparse_nesterov", SPARSE_N, spy=True),
    _sc("sparse_avg", SPARSE_ZERO_FILL, spy=True),
    _sc("sparse_saved", SPARSE_N, momentum=0.9, save_at=[5]),
]
RESUMES = [
    _sc("resume_fp32_from5", EXACT_A, momentum=0.9, resume=["resume_fp32_saved", 5]),
    _sc("resume_int8_from6", RESUME_INT8, momentum=0.9, resume=["resume_int8_saved", 6]),
    _sc("resume_int8_from7", RESUME_INT8, momentum=0.9, resume=["resume_int8_saved", 7]),
    _sc("launch1_int8_from4", LAUNCH_AT_1, momentum=0.9, resume=["launch1_int8_saved", 4], record_load_error=True),
    _sc("anchor_cpu_from_cpu5", ANCHOR_CPU, momentum=0.9, resume=["anchor_cpu", 5]),
    _sc("anchor_same_from_cpu5", ANCHOR_SAME, momentum=0.9, resume=["anchor_cpu", 5]),
    _sc("anchor_cpu_from_same5", ANCHOR_CPU, momentum=0.9, resume=["anchor_same", 5]),
    _sc("sparse_from5", SPARSE_N, momentum=0.9, resume=["sparse_saved", 5]),
]
FL2_HSDP = {"algorithm": "fl_hsdp", "num_groups": F, "hsdp_shard_size": 2}
HSDP_SCENARIOS = [
    _sc("hsdp_fedavg", {**FL2_HSDP, "sync_every": 3}, steps=4, spy=True),
    _sc("hsdp_int8_ef", {**FL2_HSDP, "sync_every": 6, "num_fragments": 2, "sync_delay": 2, "sync_dtype": "int8",
                         "error_feedback": True}, steps=4, spy=True),
    _sc("hsdp_int8_ef_roundtrip", {**FL2_HSDP, "sync_every": 6, "num_fragments": 2, "sync_delay": 2,
                                   "sync_dtype": "int8", "error_feedback": True}, steps=4, momentum=0.9,
        save_at=[4], roundtrip_at=[4]),
    _sc("hsdp_sparse", {**FL2_HSDP, "sync_every": 6, "num_fragments": 2, "sync_delay": 1, "sync_dtype": "sparse",
                        "error_feedback": True, "outer_optimizer": "nesterov"}, steps=4, spy=True),
]

# (case, FLConfig fields, fields overwritten after construction, field the message must name)
BAD_CASES = [
    ("h_not_multiple_of_p", {"sync_every": 5, "num_fragments": 2}, {}, "num_fragments"),
    ("tau_above_h", {"sync_every": 6, "num_fragments": 2, "sync_delay": 7}, {}, "sync_delay"),  # issue 46: tau <= H
    ("tau_negative", {"sync_delay": -1}, {}, "sync_delay"),
    ("alpha_above_one", {"fragment_update_alpha": 1.5}, {}, "fragment_update_alpha"),
    ("alpha_negative", {"fragment_update_alpha": -0.1}, {}, "fragment_update_alpha"),
    ("alpha_nan", {"fragment_update_alpha": float("nan")}, {}, "fragment_update_alpha"),
    ("unknown_sync_dtype", {"sync_dtype": "fp8"}, {}, "sync_dtype"),
    ("unknown_outer_state_device", {"outer_state_device": "gpu"}, {}, "outer_state_device"),
    ("density_zero", {"sync_dtype": "sparse", "error_feedback": True, "sync_density": 0.0}, {}, "sync_density"),
    ("density_above_one", {"sync_density": 1.5}, {}, "sync_density"),
    ("sparse_without_error_feedback", {"sync_dtype": "sparse"}, {}, "error_feedback"),
    # valid when built, broken by a changed copy: dataclasses.replace validates it like a new one
    ("set_h_not_multiple_of_p", {"sync_every": 6}, {"num_fragments": 4}, "num_fragments"),
    ("set_tau_too_large", {"sync_every": 6, "num_fragments": 2}, {"sync_delay": 7}, "sync_delay"),
    ("set_alpha_above_one", {}, {"fragment_update_alpha": 2.0}, "fragment_update_alpha"),
    ("set_unknown_sync_dtype", {}, {"sync_dtype": "int4"}, "sync_dtype"),
    ("set_unknown_outer_state_device", {}, {"outer_state_device": "cuda"}, "outer_state_device"),
    ("set_density_negative", {"sync_dtype": "sparse", "error_feedback": True}, {"sync_density": -0.02},
     "sync_density"),
]


# ====================================================================== launches
class Results:
    """Per-rank records of the launches, by scenario name."""

    def __init__(self, out: Path, world: int):
        self.out, self.world = out, world

    def __call__(self, name: str) -> list[dict]:
        recs = [torch.load(self.out / name / f"rank{r}.pt", weights_only=False) for r in range(self.world)]
        assert [rec["rank"] for rec in recs] == list(range(self.world))
        return recs


def _launch(out: Path, world: int, spec: dict, label: str):
    path = write_json(out / f"spec_{label}.json", spec)
    res = run_torchrun(world, WORKER, path, out, timeout=LAUNCH_TIMEOUT)
    assert res.returncode == 0, res.tail()
    print(f"\n[{label}: {world}-process launch, {len(spec.get('scenarios', []))} scenarios, {res.seconds:.1f} s]")
    return res


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("stream")


@pytest.fixture(scope="module")
def four(out_dir) -> Results:
    cases = [{"name": n, "fl": fl, "set": st} for n, fl, st, _ in BAD_CASES]
    _launch(out_dir, 4, {"bad_cases": cases, "scenarios": SCENARIOS}, "main")
    return Results(out_dir, 4)


@pytest.fixture(scope="module")
def resumed(four, out_dir) -> Results:
    _launch(out_dir, 4, {"scenarios": RESUMES}, "resume")
    return Results(out_dir, 4)


@pytest.fixture(scope="module")
def eight(tmp_path_factory) -> Results:
    out = tmp_path_factory.mktemp("stream8")
    _launch(out, 8, {"scenarios": HSDP_SCENARIOS}, "hsdp")
    return Results(out, 8)


# ====================================================================== helpers
def by_coord(recs) -> dict[tuple[int, int, int], dict]:
    return {tuple(rec["coords"]): rec for rec in recs}


def max_diff(a, b) -> float:
    assert len(a) == len(b)
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))


def full(recs, f: int, pick, r: int = 0) -> list[torch.Tensor]:
    """Group f's (replica r's) full parameters from its S dim-0 shards (FSDP2 shards dim
    0 like torch.chunk; to_local() is unpadded)."""
    coords = by_coord(recs)
    S = recs[0]["layout"][2]
    shards = [pick(coords[(f, r, s)]) for s in range(S)]
    return [torch.cat([sh[i] for sh in shards], dim=0) for i in range(len(shards[0]))]


def trajectory(recs) -> list[list[list[torch.Tensor]]]:
    """[step][group] -> full parameters after every optimizer step, then after end_training."""
    n = len(recs[0]["steps"])
    out = [[full(recs, f, lambda rec, i=i: rec["steps"][i]["params"]) for f in range(F)] for i in range(n)]
    return out + [[full(recs, f, lambda rec: rec["final"]) for f in range(F)]]


def group_batches(recs) -> list[list[list[torch.Tensor]]]:
    """[group][step] -> the micro-batches its ranks trained on, in shard order."""
    coords = by_coord(recs)
    S = recs[0]["layout"][2]
    return [[[coords[(f, 0, s)]["steps"][i]["batch"] for s in range(S)] for i in range(len(recs[0]["steps"]))]
            for f in range(F)]


def tiny_llama():
    import sys

    sys.path.insert(0, str(WORKERS))
    from stream_worker import MODEL
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**MODEL))


def group_loss(model, xs) -> torch.Tensor:
    """Mean of the group's ranks' losses: its gradient is what FSDP's reduce-scatter averages."""
    return sum(model(input_ids=x, labels=x).loss for x in xs) / len(xs)


# ====================================================================== the simulation
def ref_sparse(x: torch.Tensor, density: float, bits: int, with_mask: bool = False):
    """The spec of "sparse" for one rank's flat buffer ``x`` (numel a multiple of 4096),
    written without fl_accel.codecs: in each block of 4096 values keep the k of largest
    magnitude (k = density x 4096 rounded up to a multiple of 32/bits); with lo/hi the
    smallest/largest kept magnitude and step = (hi - lo)/(L - 1), L = 2^(bits-1), send
    sign x (lo + round((|v| - lo)/step) step) (fp32). Returns the dense values sent (and,
    ``with_mask``, the 0/1 mask of the indices sent)."""
    q, levels, out = 32 // bits, 2 ** (bits - 1), torch.zeros_like(x)
    mask = torch.zeros_like(x)
    k = min(4096, max(q, math.ceil(density * 4096 / q) * q))
    for start in range(0, x.numel(), 4096):
        v = x[start:start + 4096]
        order = torch.sort(v.abs(), descending=True, stable=True).indices[:k]
        mag = v[order].abs()
        lo, step = mag.min(), (mag.max() - mag.min()) / (levels - 1)
        level = torch.round((mag - lo) / step).clamp(0, levels - 1) if step > 0 else torch.zeros_like(mag)
        val = lo + level * step
        out[start + order] = torch.where(v[order] < 0, -val, val)
        mask[start + order] = 1.0
    return (out, mask) if with_mask else out


def sparse_mean(anchor, thetas, residual, idx, cfg, shards: int = 2, weights=None) -> list[torch.Tensor]:
    """The "sparse" exchange of parameters ``idx`` across the groups of ``thetas`` (each of
    ``shards`` ranks holding one chunk): rank (g, s) packs its dim-0 shards (torch.chunk)
    of (anchor - theta_g) + residual into one buffer, padded to a multiple of 4096, sends
    :func:`ref_sparse` of it and keeps the rest as its residual (error feedback, the old
    residual decayed by beta = ``cfg.residual_decay`` first); the mean is sum_g w_g sent_g
    (default w_g = 1/F), added in group order, over sum of w_g of the groups that sent each
    index for ``sparse_aggregation="senders"``. Returns the full mean per parameter."""
    weights = weights or [1.0 / len(thetas)] * len(thetas)
    beta = cfg.residual_decay
    means = [[] for _ in idx]
    for s in range(shards):
        total, senders = 0, 0
        for g, w in enumerate(weights):
            parts = [((anchor[i] - thetas[g][i].detach()) + beta * residual[g][i]).chunk(shards)[s] for i in idx]
            flat = _flat(parts, 4096)
            sent, mask = ref_sparse(flat, cfg.sync_density, cfg.sync_value_bits, with_mask=True)
            offset = 0
            for i, part in zip(idx, parts):
                residual[g][i].chunk(shards)[s].copy_((flat - sent)[offset:offset + part.numel()].view_as(part))
                offset += part.numel()
            total, senders = total + sent * w, senders + mask * w
        if cfg.sparse_aggregation == "senders":
            total = torch.where(senders > 0, total / senders.clamp(min=1e-30), total)
        offset = 0
        for j, part in enumerate(parts):
            means[j].append(total[offset:offset + part.numel()].view_as(part))
            offset += part.numel()
    return [torch.cat(m, dim=0) for m in means]


def simulate(batches, fl: dict, fragments: list[list[int]], steps: int = STEPS, lr: float = LR):
    """The spec in one process. ``batches[g][step]``: group g's micro-batches; the mean of
    the pseudo-gradients is exact, or :func:`sparse_mean` for sync_dtype "sparse".

    Returns ``[step][group] -> full parameters`` after every optimizer step, then after
    the final sync (end_training)."""
    cfg = FLConfig(**fl)
    models = [tiny_llama() for _ in range(F)]
    opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.0) for m in models]
    thetas = [[p for _, p in m.named_parameters()] for m in models]
    anchor = [p.detach().clone() for p in thetas[0]]
    buf: list[torch.Tensor | None] = [None] * len(anchor)
    period, tau, P = cfg.sync_every // cfg.num_fragments, cfg.sync_delay, cfg.num_fragments

    residual = [[torch.zeros_like(a) for a in anchor] for _ in range(F)]

    def mean_delta(idx, final=False):
        if cfg.sync_dtype == "sparse" and not (final and cfg.final_sync == "exact"):
            return sparse_mean(anchor, thetas, residual, idx, cfg)
        beta = cfg.residual_decay  # the exact final sync: pseudo-gradient + decayed residual, fp32 mean
        out = [sum(anchor[i] - th[i].detach() + beta * residual[g][i] for g, th in enumerate(thetas)) / F
               for i in idx]
        for r in residual:
            for t in r:
                t.zero_()
        return out

    @torch.no_grad()
    def apply(idx, deltas, alpha):
        for i, d in zip(idx, deltas):
            if cfg.outer_optimizer == "nesterov":  # torch SGD, nesterov=True, dampening 0
                mu = cfg.outer_momentum
                buf[i] = d.clone() if buf[i] is None else buf[i] * mu + d
                new = anchor[i] - cfg.outer_lr * (d + mu * buf[i])
            else:
                new = anchor[i] - d
            anchor[i] = new
            for th in thetas:
                th[i].copy_(new + alpha * (th[i] - new))

    def snapshot():
        return [[t.detach().clone() for t in th] for th in thetas]

    history, k, local, inflight = [], 0, 0, None
    for step in range(steps):
        for g in range(F):
            opts[g].zero_grad()
            group_loss(models[g], batches[g][step]).backward()
            opts[g].step()
        local += 1
        frag = k % P
        if tau and local == period - tau:
            inflight = (frag, mean_delta(fragments[frag]))
        if local == period:
            if inflight is None:
                inflight = (frag, mean_delta(fragments[frag]))
            apply(fragments[inflight[0]], inflight[1], cfg.fragment_update_alpha)
            inflight, k, local = None, k + 1, 0
        history.append(snapshot())
    if inflight is not None:  # end_training: the in-flight fragment as scheduled, then everything, alpha=0
        apply(fragments[inflight[0]], inflight[1], cfg.fragment_update_alpha)
    everything = list(range(len(anchor)))
    apply(everything, mean_delta(everything, final=True), 0.0)
    history.append(snapshot())
    return history


def worst(traj_a, traj_b, upto: int | None = None) -> float:
    return max(max_diff(a[g], b[g]) for a, b in list(zip(traj_a, traj_b))[:upto] for g in range(F))


# ====================================================================== torchft's DiLoCo
class _FakeAllReduce:
    """The F threads' ``Manager.allreduce`` calls, matched by call number: the last
    arrival computes SUM over the groups (in group order), every tensor becomes SUM / F."""

    def __init__(self, num_groups: int):
        self.num_groups = num_groups
        self.cond = threading.Condition()
        self.pending: dict[int, dict[int, torch.Tensor]] = {}
        self.done: set[int] = set()
        self.failed = False

    def start(self, call: int, group: int, tensor: torch.Tensor):
        with self.cond:
            slot = self.pending.setdefault(call, {})
            slot[group] = tensor
            if len(slot) == self.num_groups:
                total = sum(slot[g].clone() for g in range(self.num_groups))
                for t in slot.values():
                    t.copy_(total).div_(self.num_groups)
                self.done.add(call)
                self.cond.notify_all()
        return _FakeWork(self, call)

    def abort(self):
        with self.cond:
            self.failed = True
            self.cond.notify_all()


class _FakeWork:
    def __init__(self, coll: _FakeAllReduce, call: int):
        self.coll, self.call = coll, call

    def wait(self, timeout=None) -> bool:
        with self.coll.cond:
            ok = self.coll.cond.wait_for(lambda: self.call in self.coll.done or self.coll.failed, timeout=120)
            if not ok or self.coll.failed:
                raise RuntimeError(f"fake allreduce {self.call} never completed")
        return True


class _FakeManager:
    """What ``torchft.local_sgd.DiLoCo`` uses of ``torchft.manager.Manager`` (read in
    torchft 0.2.0's local_sgd.py): a fixed quorum of F groups that always commits;
    ``current_step`` counts commits (the fragment schedule), ``allreduce`` averages."""

    _use_async_quorum = False

    def __init__(self, coll: _FakeAllReduce, group: int):
        self.coll, self.group, self.step, self.calls, self.state_fns = coll, group, 0, 0, {}

    def allreduce(self, tensor, should_quantize=False, **_):
        assert not should_quantize
        self.calls += 1
        return self.coll.start(self.calls, self.group, tensor)

    def start_quorum(self, *args, **kwargs):
        pass

    def should_commit(self, timeout=None) -> bool:
        self.step += 1
        return True

    def current_step(self) -> int:
        return self.step

    def register_state_dict_fn(self, key, load_fn, save_fn):
        self.state_fns[key] = (load_fn, save_fn)

    def allow_state_dict_read(self):
        pass

    def disallow_state_dict_read(self):
        pass

    def errored(self):
        return None


def run_torchft_diloco(batches, fl: dict, fragments: list[list[int]], steps: int = STEPS, lr: float = LR):
    """torchft 0.2.0 ``DiLoCo`` over F simulated groups (one thread each). Fragments are
    ``nn.ParameterList`` views of the same Parameter objects; one outer optimizer per
    fragment (a shared one would also step the other fragments with their inner
    gradients); "avg" is outer SGD with lr 1, no momentum. Returns ``[step][group] ->
    parameters`` after every optimizer step (torchft has no final sync of everything)."""
    local_sgd = pytest.importorskip("torchft.local_sgd", reason="pip install torchft==0.2.0")
    cfg = FLConfig(**fl)
    coll = _FakeAllReduce(F)
    models = [tiny_llama() for _ in range(F)]  # built here: torch.manual_seed is process-wide
    history = [[None] * F for _ in range(steps)]
    errors = []

    def group(g: int):
        try:
            model = models[g]
            params = [p for _, p in model.named_parameters()]
            frags = [torch.nn.ParameterList([params[i] for i in idx]) for idx in fragments]
            inner = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.0)
            if cfg.outer_optimizer == "nesterov":
                outer = [torch.optim.SGD(f.parameters(), lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=True)
                         for f in frags]
            else:
                outer = [torch.optim.SGD(f.parameters(), lr=1.0, momentum=0.0) for f in frags]
            with local_sgd.DiLoCo(_FakeManager(coll, g), frags, inner, outer, sync_every=cfg.sync_every,
                                  fragment_sync_delay=cfg.sync_delay,
                                  fragment_update_alpha=cfg.fragment_update_alpha):
                for step in range(steps):
                    inner.zero_grad()
                    group_loss(model, batches[g][step]).backward()
                    inner.step()
                    history[step][g] = [p.detach().clone() for p in params]
        except BaseException as exc:  # noqa: BLE001 (re-raised in the test's thread)
            errors.append(exc)
            coll.abort()

    threads = [threading.Thread(target=group, args=(g,)) for g in range(F)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    if errors:
        raise errors[0]
    assert all(h is not None for row in history for h in row)
    return history


# ====================================================================== a. exact equality, every step
EXACT = {"exact_a": EXACT_A, "exact_b": EXACT_B}


def _expected_fragments(names):
    """FSDP units in forward order: embed_tokens, layer 0, layer 1, root (norm, lm_head);
    dealt strided (unit u -> fragment u mod 2)."""
    units = [[n for n in names if n.startswith("model.embed_tokens")],
             [n for n in names if n.startswith("model.layers.0.")],
             [n for n in names if n.startswith("model.layers.1.")],
             [n for n in names if n in ("model.norm.weight", "lm_head.weight")]]
    return [sorted(units[0] + units[2], key=names.index), sorted(units[1] + units[3], key=names.index)]


@pytest.mark.parametrize("name", list(EXACT))
def test_streaming_equals_simulation_at_every_step(four, name):
    """exact_a: P=2, H=6, tau=1, alpha=0.5, outer "nesterov" (lr 0.7, momentum 0.9);
    exact_b: P=2, H=6, tau=0, alpha=0, "avg"; fp32, inner SGD, 11 steps + end_training
    (whose in-flight fragment from step 11 is applied before the final full sync).
    Every rank's shards, rebuilt into each group's full parameters, equal the
    single-process simulation of the spec after every step and at the end (<= 1e-6).

    Not vacuous: the fragments are the strided deal of the four FSDP units; the groups
    differ between syncs and (alpha=0.5) even right after one; the outer step moves the
    anchor; and variants of the simulation (alpha=0, tau=0, "avg", the fragments
    swapped) all miss the gloo run by far more than the tolerance."""
    recs = four(name)
    names = recs[0]["names"]
    expected = _expected_fragments(names)
    assert [[names[i] for i in f] for f in recs[0]["fragment_indices"]] == expected
    assert all(rec["fragment_indices"] == recs[0]["fragment_indices"] for rec in recs)
    frags = recs[0]["fragment_indices"]
    got = trajectory(recs)
    sim = simulate(group_batches(recs), EXACT[name], frags)
    err = worst(got, sim)
    print(f"[{name}: max |gloo - simulation| over 11 steps + end = {err:.2e}]")
    assert err <= TOL
    # schedule, as the worker saw it: fragment syncs complete at steps 3, 6, 9
    assert [st["num_fragment_syncs"] for st in recs[0]["steps"]] == [0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert recs[0]["num_fragment_syncs"] == (4 if name == "exact_a" else 3)  # exact_a: step 11's launch, at the end
    # the groups differ between syncs; after end_training they are identical
    assert max_diff(got[1][0], got[1][1]) > 1e-3
    assert all(torch.equal(a, b) for a, b in zip(got[-1][0], got[-1][1]))
    synced = [i for i in frags[0]]  # fragment 0 synced at step 3; fragment 1 did not
    d_synced = max_diff([got[2][0][i] for i in synced], [got[2][1][i] for i in synced])
    d_other = max_diff([got[2][0][i] for i in frags[1]], [got[2][1][i] for i in frags[1]])
    assert d_other > 1e-3
    if name == "exact_b":
        assert d_synced == 0.0  # alpha=0, exact mean: the fragment is bitwise equal across groups
    else:
        assert d_synced > 1e-4  # alpha=0.5 keeps half of each group's own drift
    variants = {"alpha=0": {"fragment_update_alpha": 0.0}, "tau=0": {"sync_delay": 0}, "tau=1": {"sync_delay": 1},
                "avg": {"outer_optimizer": "avg"}, "fragments swapped": {}}
    for label, change in variants.items():
        fl = {**EXACT[name], **change}
        if fl == EXACT[name] and label != "fragments swapped":
            continue
        other = simulate(group_batches(recs), fl, frags[::-1] if label == "fragments swapped" else frags)
        miss = worst(got, other)
        assert miss > 1e-3, f"{name}: the simulation with {label} also matches ({miss:.2e}); the test cannot tell"


# ====================================================================== b. torchft differential
@pytest.mark.parametrize("name", list(EXACT))
def test_streaming_equals_torchft_diloco(four, name):
    """torchft 0.2.0's DiLoCo (F=2 groups as threads, a fake Manager with a fixed
    quorum), given the same initial model, fragments, inner SGD and per-group batches,
    produces the same parameters as the gloo run after every optimizer step (1e-6), and
    so does the simulation. torchft has no final sync of everything, so the
    end_training state is compared with the simulation only (previous test)."""
    recs = four(name)
    frags = recs[0]["fragment_indices"]
    got = trajectory(recs)
    ft = run_torchft_diloco(group_batches(recs), EXACT[name], frags)
    sim = simulate(group_batches(recs), EXACT[name], frags)
    err, err_sim = worst(got, ft, upto=STEPS), worst(sim, ft, upto=STEPS)
    print(f"[{name}: max |gloo - torchft DiLoCo| = {err:.2e}, |simulation - torchft| = {err_sim:.2e}]")
    assert err <= TOL and err_sim <= TOL
    assert max_diff(ft[STEPS - 1][0], ft[STEPS - 1][1]) > 1e-3  # torchft's groups diverged too


# ====================================================================== c. no regression: FedAvg bitwise
def _check_fedavg_bitwise(recs, R: int, S: int, sync_steps: list[int]) -> int:
    """At every sync, every copy of shard (r, s) equals (a + b) / 2 in fp32 of the two
    groups' pre-sync shards (torch.equal). Pre-sync = what the exchange was given
    (the spied ``_start``); post-sync = the shards after that step, or after
    end_training for the last sync (``sync_steps``: the optimizer step of each sync)."""
    coords = by_coord(recs)
    checked = 0
    for r in range(R):
        for s in range(S):
            launches = [coords[(f, r, s)]["launches"] for f in range(F)]
            assert [e["step"] for e in launches[0]] == sync_steps
            for k, step in enumerate(sync_steps):
                a, b = launches[0][k]["theta"], launches[1][k]["theta"]
                assert max_diff(a, b) > 1e-4, f"sync at step {step}: the groups were already equal"
                want = [(x + y) / 2 for x, y in zip(a, b)]
                for f in range(F):
                    rec = coords[(f, r, s)]
                    post = rec["final"] if k == len(sync_steps) - 1 else rec["steps"][step - 1]["params"]
                    assert all(torch.equal(p, w) for p, w in zip(post, want)), (f, r, s, step)
                    checked += 1
    return checked


def test_p1_fp32_avg_is_bitwise_fedavg(four):
    """P=1, tau=0, fp32, "avg", H=3, 7 steps: syncs at steps 3, 6 and at end_training;
    each is one fp32 all-reduce on "fl" and leaves every rank's shards bitwise equal to
    (a + b) / 2 of the two groups' pre-sync shards."""
    recs = four("fedavg")
    n = _check_fedavg_bitwise(recs, 1, 2, [3, 6, 7])
    for rec in recs:
        calls = [st["comm"]["fl"]["calls"] for st in rec["steps"]]
        assert calls == [0, 0, 1, 1, 1, 2, 2] and rec["final_comm"]["fl"]["calls"] == 3
        assert set(rec["final_comm"]["fl"]["by_op"]) == {"all_reduce"}
    print(f"[fedavg FL+FSDP: {n} post-sync shard sets bitwise (a+b)/2]")


def test_p1_fp32_avg_is_bitwise_fedavg_hsdp(eight):
    """The same on FL+HSDP 2 groups x 2 replicas x 2 shards (each replica exchanges half
    of its shard across groups, then the replicas all-gather): H=3, 4 steps, syncs at
    step 3 and at end_training, all 8 ranks bitwise (a + b) / 2."""
    recs = eight("hsdp_fedavg")
    assert recs[0]["layout"] == [2, 2, 2]
    n = _check_fedavg_bitwise(recs, 2, 2, [3, 4])
    print(f"[fedavg FL+HSDP: {n} post-sync shard sets bitwise (a+b)/2]")


# ====================================================================== d. compressed exchange
WINDOWS = [(0, 3), (3, 6), (6, 9), (9, None)]  # one fragment exchange each; the last adds the final full sync


def _window_bytes(rec, lo: int, hi: int | None) -> int:
    start = rec["steps"][lo - 1]["comm"]["fl"]["bytes"] if lo else 0
    end = rec["final_comm"]["fl"]["bytes"] if hi is None else rec["steps"][hi - 1]["comm"]["fl"]["bytes"]
    return end - start


def test_compressed_bytes_on_fl_axis(four):
    """Same schedule (P=2, H=6, tau=2) in fp32, bf16 and int8: per sync window, the
    "fl" bytes of every rank are <= 0.52x (bf16) and <= 0.27x (int8) of fp32, and no
    less than the payload ratio itself (1/2; (1 + 4/256)/4), i.e. something was sent.
    The last window holds end_training's exact final sync (an fp32 all-reduce, the same
    as fp32's own): its share is above the bound, so it is checked apart."""
    ref = four("wire_fp32")
    ratios = {}
    for dtype, limit, floor in (("bf16", 0.52, 0.5), ("int8", 0.27, (1 + 4 / BLOCK) / 4),
                                ("int8_gather", 0.27, (1 + 4 / BLOCK) / 4)):
        recs = four(f"wire_{dtype}")
        ops = {"all_gather", "all_reduce"} | (set() if dtype.endswith("gather") else {"all_to_all"})
        for rec, base, two in zip(recs, ref, four("wire_int8")):
            assert set(rec["final_comm"]["fl"]["by_op"]) == ops
            if dtype.endswith("gather"):  # F = 2: the one all-gather sends what all-to-all + all-gather send
                assert rec["final_comm"]["fl"]["bytes"] == two["final_comm"]["fl"]["bytes"]
            final = rec["final_comm"]["fl"]["by_op"]["all_reduce"]
            want = _sparse_model({**WIRE, "sync_dtype": dtype[:4]}, 4, STEPS).full[rec["coords"][0]].bytes["fl"]
            assert set(want) == {"all_reduce"}
            assert final == want["all_reduce"] if rec["coords"][2] == 0 else 0 < final <= want["all_reduce"]
            for lo, hi in WINDOWS[:-1]:
                b, b0 = _window_bytes(rec, lo, hi), _window_bytes(base, lo, hi)
                assert b0 > 0
                ratio = b / b0
                ratios.setdefault(dtype, []).append(ratio)
                assert floor <= ratio <= limit, f"{dtype} rank {rec['rank']} window {lo}-{hi}: {ratio:.4f}"
    print("[fl bytes vs fp32 per sync: " + ", ".join(f"{d} {min(v):.4f}-{max(v):.4f}" for d, v in ratios.items())
          + "]")


def _flat(tensors, pad: int) -> torch.Tensor:
    x = torch.cat([t.reshape(-1) for t in tensors])
    return torch.nn.functional.pad(x, (0, (-x.numel()) % pad))


def _two_stage_bound(deltas: list[torch.Tensor], exact: torch.Tensor, dtype: str,
                     one_stage: bool = False) -> torch.Tensor:
    """Per-element bound of |received - exact| for the scheme of fl_accel.exchange, with
    weights w_g = 1/F. Stage 1: group g sends Q(D_g), error e_g <= b(D_g) (half an int8
    step of its 256-value block, or 2^-8 |x| for bf16); the owner of a sub-chunk sums
    r = sum_g w_g deQ(Q(D_g)) = exact + sum_g w_g e_g. Stage 2: r is re-quantized, error
    <= b(r), with |r| <= |exact| + E1, E1 = sum_g w_g b(D_g). Total <= E1 + b(|exact| + E1).
    Sub-chunks are multiples of 256 and aligned, so both stages use the same blocks.
    Plus 4 fp32 roundings of the summed magnitudes (weights, sum, dequantization)."""
    w = 1.0 / len(deltas)
    e1 = sum(w * quantization_error_bound(d, dtype).double() for d in deltas)
    mags = sum(w * d.abs().double() for d in deltas)
    if dtype == "int8":  # b(r) as in quantization_error_bound, with |r| bounded as above
        blockmax = (exact.abs() + e1).reshape(-1, BLOCK).amax(dim=1, keepdim=True)
        e2 = (blockmax / 127 / 2 * (1 + 2.0 ** -15)).expand(-1, BLOCK).reshape(-1) + (exact.abs() + e1) * 2.0 ** -23
        slack = 4 * 2.0 ** -24 * mags.reshape(-1, BLOCK).amax(dim=1, keepdim=True).expand(-1, BLOCK).reshape(-1)
    else:
        e2 = (exact.abs() + e1) * 2.0 ** -8
        slack = 4 * 2.0 ** -24 * mags
    return e1 + slack + (0 if one_stage else e2)


@pytest.mark.parametrize("dtype", ["int8", "bf16", "int8_ef", "int8_gather"])
def test_compressed_mean_within_two_stage_bound(four, dtype):
    """Every exchange (4 fragment syncs and the final full sync; for int8_ef the first,
    before any residual exists): the mean each rank receives is identical in both
    groups and within :func:`_two_stage_bound` of the exact fp64 mean of the two
    groups' pseudo-gradients (anchor - theta at launch), element by element (int8_gather,
    one all-gather: within the first stage's bound alone, nothing is re-quantized); after
    end_training the groups are identical. Not vacuous: the groups' pseudo-gradients
    differ, and the error is a sizable share of the bound (it is not trivially 0)."""
    recs = four(f"wire_{dtype}")
    wire = "int8" if dtype.startswith("int8") else dtype
    coords = by_coord(recs)
    ratio_max, err_max = 0.0, 0.0
    for s in range(2):
        ranks = [coords[(f, 0, s)] for f in range(F)]
        pairs = list(zip(ranks[0]["launches"], ranks[0]["applies"]))
        assert [(la["step"], ap["step"]) for la, ap in pairs][:4] == [(1, 3), (4, 6), (7, 9), (10, 11)]
        if dtype == "int8_ef":
            pairs = pairs[:1]
        for k, (launch, apply) in enumerate(pairs):
            assert launch["indices"] == apply["indices"] and apply["alpha"] == 0.0
            deltas = []
            for rec in ranks:
                la = rec["launches"][k]
                deltas.append(_flat([a - t.float() for a, t in zip(la["anchor"], la["theta"])], 2 * BLOCK))
                got = _flat(rec["applies"][k]["means"], 2 * BLOCK)
                if rec is ranks[0]:
                    received = got
                else:
                    assert torch.equal(got, received), "the groups received different means"
            assert (deltas[0] - deltas[1]).abs().max() > 1e-5
            exact = (deltas[0].double() + deltas[1].double()) / 2
            err = (received.double() - exact).abs()
            bound = _two_stage_bound(deltas, exact, wire, one_stage=dtype.endswith("gather"))
            assert (err <= bound).all(), f"{dtype} shard {s} exchange {k}: error exceeds the bound"
            live = bound > 0  # the padding: both 0
            ratio = (err[live] / bound[live]).max().item()
            ratio_max, err_max = max(ratio_max, ratio), max(err_max, err.max().item())
    print(f"[{dtype}: max error vs exact mean {err_max:.2e}, max error/bound {ratio_max:.3f}]")
    assert ratio_max > 0.2
    end = trajectory(recs)[-1]  # the final full sync (alpha=0) leaves the groups identical
    assert all(torch.equal(a, b) for a, b in zip(end[0], end[1]))


def _check_residuals(recs, num_chunks: int) -> tuple[int, float]:
    """For every launch on every rank: residual_after == (D + residual_before) -
    deQ(Q(D + residual_before)) on this rank's chunk of the packed buffer and 0 outside
    it, recomputed from the recorded D = anchor - theta with the int8 codec; within
    the quantization bound; carried forward to the next launch unchanged; 0 after the
    exact final sync (end_training sends D + residual in fp32)."""
    checked, biggest, exact = 0, 0.0, 0
    for rec in recs:
        chunk = rec["coords"][1] if num_chunks > 1 else 0
        launches = rec["launches"]
        assert launches and all(la["residual_before"] is not None for la in launches)
        last_after: dict[int, torch.Tensor] = {}
        for la in launches:
            for i, r in zip(la["indices"], la["residual_before"]):
                if i in last_after:
                    assert torch.equal(r, last_after[i]), "the residual was not carried forward"
                else:
                    assert not r.any(), "a residual before the first launch must be 0"
            if la["exact"]:
                assert not any(r.any() for r in la["residual_after"]), f"rank {rec['rank']}: left after the final sync"
                exact += 1
                continue
            values = [(a - t.float()) + r for a, t, r in zip(la["anchor"], la["theta"], la["residual_before"])]
            n = sum(v.numel() for v in values)
            flat = _flat(values, num_chunks * F * BLOCK)
            size = flat.numel() // num_chunks
            mine = flat[chunk * size:(chunk + 1) * size]
            want_chunk = mine - dequantize(quantize(mine, "int8", F), "int8").view(-1)
            assert (want_chunk.abs() <= quantization_error_bound(mine, "int8")).all()
            want = torch.zeros_like(flat)
            want[chunk * size:(chunk + 1) * size] = want_chunk
            got = _flat(la["residual_after"], num_chunks * F * BLOCK)
            assert torch.equal(got[:n], want[:n]), f"rank {rec['rank']} step {la['step']}"
            assert got[:n].any()
            biggest = max(biggest, got.abs().max().item())
            for i, r in zip(la["indices"], la["residual_after"]):
                last_after[i] = r
            checked += 1
    assert exact == len(recs), "every rank ends with one exact final sync"
    return checked, biggest


def test_error_feedback_residual_is_what_quantization_dropped(four):
    """int8 + error_feedback on FL+FSDP (one chunk per rank): at every launch the
    residual carried forward is exactly (Delta + old residual) - dequantized(sent)."""
    n, biggest = _check_residuals(four("wire_int8_ef"), 1)
    print(f"[int8 EF: {n} residual updates exact, max |residual| {biggest:.2e}]")


def _assert_replicas_identical_every_step(recs) -> None:
    """FL+HSDP 2x2x2: the two replicas of each group hold identical parameters after every step."""
    coords = by_coord(recs)
    for f in range(F):
        for s in range(2):
            for st0, st1 in zip(coords[(f, 0, s)]["steps"], coords[(f, 1, s)]["steps"]):
                assert all(torch.equal(a, b) for a, b in zip(st0["params"], st1["params"]))


def test_error_feedback_residual_on_hsdp_chunks(eight):
    """The same on FL+HSDP 2x2x2, where replica c exchanges chunk c of the buffer: the
    residual is kept on that chunk only (0 on the other replica's chunk), and the two
    replicas of a group end every step with identical parameters."""
    recs = eight("hsdp_int8_ef")
    n, biggest = _check_residuals(recs, 2)
    _assert_replicas_identical_every_step(recs)
    print(f"[int8 EF FL+HSDP: {n} residual updates exact, max |residual| {biggest:.2e}]")


# ====================================================================== e. resume mid-exchange
def _assert_same_run(ref, other, first_step: int) -> None:
    for r_rec, o_rec in zip(ref, other):
        for st in o_rec["steps"]:
            want = r_rec["steps"][st["step"] - 1]
            assert st["loss"] == want["loss"], (o_rec["rank"], st["step"])
            assert all(torch.equal(a, b) for a, b in zip(st["params"], want["params"])), (o_rec["rank"], st["step"])
        assert all(torch.equal(a, b) for a, b in zip(o_rec["final"], r_rec["final"])), o_rec["rank"]


def _check_resume(four, resumed, name, saved, k):
    ref, with_save, res = four(saved), four(f"{saved}_saved"), resumed(name)
    for rec in res:
        assert rec["load_error"] is None, rec["load_error"]
        assert rec["start"] == k and [st["step"] for st in rec["steps"]] == list(range(k + 1, STEPS + 1))
        assert rec["resumed_sync_state"]["inflight_fragment"] is not None
    for rec in with_save:
        saved_at = {s["step"]: s for s in rec["saved"]}
        assert saved_at[k]["sync_state"]["inflight_fragment"] is not None
    got = trajectory(ref)
    assert max_diff(got[k - 1][0], got[k - 1][1]) > 1e-3  # the groups differed at the checkpoint
    _assert_same_run(ref, with_save, 1)
    _assert_same_run(ref, res, k + 1)


@pytest.mark.parametrize("name,saved,k", [("resume_fp32_from5", "resume_fp32", 5),
                                          ("resume_int8_from6", "resume_int8", 6),
                                          ("resume_int8_from7", "resume_int8", 7)])
def test_resume_mid_exchange_is_the_same_run(four, resumed, name, saved, k):
    """Checkpoint taken while a fragment's exchange is in flight, resumed in fresh
    processes (inner SGD with momentum): fp32 "nesterov" H/P=3 tau=1 alpha=0.5, saved
    at step 5 (launched at 5, applied at 6); int8 + error feedback "nesterov" H/P=4
    tau=2, saved at step 6 right after the all-to-all was launched, and at step 7 after
    the all-gather was launched (applied at 8). Every later loss and every rank's shards
    after every step and after end_training are bitwise equal to the uninterrupted run
    (which never saved), and so is the run that saved."""
    _check_resume(four, resumed, name, saved, k)


def test_resume_when_launch_is_at_local_step_1(four, resumed):
    """int8 + error feedback, H/P=3, tau=2 (launch at local step 1), saved at step 4
    with an exchange in flight: the resumed run must be the uninterrupted one."""
    _check_resume(four, resumed, "launch1_int8_from4", "launch1_int8", 4)


def test_save_with_stateless_optimizer_keeps_the_schedule(four):
    """exact_a with a save_state after step 5 (plain SGD: no optimizer state) must be the
    same run as exact_a: the same fragment-sync counter and bitwise-equal shards after
    every step."""
    ref, saved = four("exact_a"), four("stateless_saved")
    for r, s in zip(ref, saved):
        assert s["saved"][0]["sync_state"]["global_step"] == 5
        assert [st["num_fragment_syncs"] for st in s["steps"]] == [st["num_fragment_syncs"] for st in r["steps"]]
    _assert_same_run(ref, saved, 1)


# ====================================================================== f. bad values
@pytest.mark.parametrize("case,fl,changes,field", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_value_raises_naming_the_field(case, fl, changes, field):
    """No processes: FLConfig(...) raises ValueError naming the field, and so does a copy
    changed after construction (``dataclasses.replace``: FLConfig is frozen and validates
    every copy)."""
    if not changes:
        with pytest.raises(ValueError, match=rf"FLConfig\.{field}"):
            FLConfig(**fl)
        return
    config = FLConfig(**fl)
    with pytest.raises(ValueError, match=rf"FLConfig\.{field}"):
        dataclasses.replace(config, **changes)


def test_bad_values_raise_on_every_rank_before_any_collective(four):
    """In the 4-process launch every rank raises ValueError naming the field for every
    case, before torch.distributed is initialized (so no rank can wait in a collective
    for one that raised): in FLConfig(...) itself, or in ``dataclasses.replace`` for a
    config changed after construction."""
    for case, _, changes, field in BAD_CASES:
        for rank in range(4):
            rec = json.loads((four.out / "bad" / case / f"rank{rank}.json").read_text())
            assert rec["type"] == "ValueError" and f"FLConfig.{field}" in rec["message"], (case, rec)
            assert rec["stage"] == ("replace" if changes else "FLConfig"), (case, rec)
            assert rec["dist_initialized"] is False, (case, rec)


def test_valid_streaming_settings_pass():
    """The boundary values that are allowed: tau = H/P - 1, alpha 0 and 1, every sync_dtype."""
    for dtype in ("fp32", "bf16", "int8"):
        validated(FLConfig(sync_every=6, num_fragments=2, sync_delay=2, fragment_update_alpha=1.0, sync_dtype=dtype), 4)
    validated(FLConfig(sync_every=6, num_fragments=6, sync_delay=0, fragment_update_alpha=0.0), 4)
    assert math.isclose(FLConfig(fragment_update_alpha=1).fragment_update_alpha, 1.0)


def test_suspended_steps_do_not_advance_the_schedule():
    """No processes: optimizer steps taken inside ``Synchronizer.suspended()`` (what
    a checkpoint must wrap around DCP's state-initializing optimizer step) leave every
    counter alone; steps outside count. H=100, so no sync (no collective) is due."""
    sync, params = _no_mesh_synchronizer(FLConfig(sync_every=100, num_fragments=2, sync_delay=1),
                                         [torch.ones(4), torch.zeros(3)])
    sync.on_optimizer_step()
    with sync.suspended():
        assert sync.on_optimizer_step() is False
        with sync.suspended():
            sync.on_optimizer_step()
        sync.on_optimizer_step()
    sync.on_optimizer_step()
    assert (sync.schedule.local_step, sync.schedule.global_step, sync.schedule.in_sync) == (2, 2, False)


def _no_mesh_synchronizer(cfg, values):
    """A synchronizer of F=2 groups on 4 ranks whose transport has no process groups (no
    collective may run): for tests of what happens between syncs."""
    from fl_accel.mesh import FLLayout, FLMesh
    from fl_accel.mesh_transport import MeshTransport
    from fl_accel.sync import Synchronizer

    params = [torch.nn.Parameter(v) for v in values]
    transport = MeshTransport.from_mesh(FLMesh(FLLayout.from_config(cfg, 4), None, {}), 0, "size", torch.device("cpu"))
    return Synchronizer([(f"p{i}", p) for i, p in enumerate(params)], torch.optim.SGD(params, lr=0.1),
                        transport=transport, config=cfg), params


def test_checkpoint_keeps_each_replicas_residual_hsdp(eight):
    """FL+HSDP 2x2x2, int8 + error feedback: the checkpoint of step 4 (below), loaded
    straight back, restores every rank's residual bitwise. Not vacuous: the two replicas
    of a group hold different residuals (each that of its own chunk), all nonzero."""
    recs = eight("hsdp_int8_ef_roundtrip")
    coords = by_coord(recs)
    for f in range(F):
        for s in range(2):
            r0, r1 = (coords[(f, r, s)]["roundtrip"]["before"]["residual"] for r in range(2))
            assert not all(torch.equal(a, b) for a, b in zip(r0, r1))
    for rec in recs:
        rt = rec["roundtrip"]
        assert any(r.any() for r in rt["before"]["residual"])
        assert all(torch.equal(a, b) for a, b in zip(rt["before"]["residual"], rt["after"]["residual"])), rec["rank"]


def test_checkpoint_mid_exchange_hsdp_round_trip(eight):
    """FL+HSDP 2x2x2, int8 + error feedback, H/P=3, tau=2: save_state at step 4, right
    after the all-to-all of fragment 1 was launched, completes that exchange (its
    all-gather over "dp_replicate" included) and loading it straight back into the same
    processes restores every rank's parameters and anchors bitwise; the run then
    finishes (end_training applies the in-flight fragment and syncs everything)."""
    for rec in eight("hsdp_int8_ef_roundtrip"):
        rt = rec["roundtrip"]
        assert rt["step"] == 4 and rec["saved"][0]["sync_state"]["inflight_fragment"] == 1
        for key in ("params", "anchor"):
            assert all(torch.equal(a, b) for a, b in zip(rt["before"][key], rt["after"][key])), (rec["rank"], key)
        assert rec["num_fragment_syncs"] == 2


# ====================================================================== g. outer_state_device="cpu"
def test_outer_state_device_cpu_is_bitwise_the_same_run(four):
    """int8 + error feedback, "nesterov", P=2, H=6, tau=1, inner SGD with momentum, 11 steps
    + end_training, each saving a checkpoint at step 5: the run with the outer state in host
    memory (outer_state_device="cpu") has every loss and every rank's shards after every step and
    after end_training bitwise equal to the run with outer_state_device="same". On this CPU machine
    both are host memory: what differs is only how the state is allocated (never pinned
    without CUDA); the GPU placement is checked in tests/gpu/test_cuda.py. Not vacuous: the groups
    differ between syncs, and the anchor, momentum and residuals all exist."""
    same, cpu = four("anchor_same"), four("anchor_cpu")
    _assert_same_run(same, cpu, 1)
    got = trajectory(same)
    assert max_diff(got[4][0], got[4][1]) > 1e-3  # step 5: the groups differ
    for rec in same + cpu:
        devices = rec["state_devices"]
        for kind in ("anchor", "momentum", "residual"):
            assert devices[kind] == [["cpu"], False], (rec["rank"], kind, devices)


@pytest.mark.parametrize("name,saved", [("anchor_cpu_from_cpu5", "anchor_cpu"),
                                        ("anchor_same_from_cpu5", "anchor_cpu"),
                                        ("anchor_cpu_from_same5", "anchor_same")])
def test_outer_state_device_resume_mid_exchange_is_bitwise(four, resumed, name, saved):
    """The checkpoint of step 5 (mid-round, fragment 1's int8 exchange launched at step 5 and
    in flight), resumed in fresh processes with outer_state_device "cpu" from a "cpu" checkpoint,
    and switched either way ("same" from "cpu", "cpu" from "same": the setting places state, it
    does not change values, so a resume may switch it): every later loss and shard, and the
    state after end_training, are bitwise those of the uninterrupted "same" run."""
    ref = four("anchor_same")
    for rec in four(saved):
        assert {s["step"]: s for s in rec["saved"]}[5]["sync_state"]["inflight_fragment"] == 1
    res = resumed(name)
    for rec in res:
        assert rec["load_error"] is None, rec["load_error"]
        assert rec["start"] == 5 and rec["resumed_sync_state"]["inflight_fragment"] == 1
        assert [st["step"] for st in rec["steps"]] == list(range(6, STEPS + 1))
        assert rec["state_devices"]["anchor"] == [["cpu"], False]
    _assert_same_run(ref, res, 6)


def test_outer_state_device_cpu_places_the_outer_state_on_the_host():
    """No processes: with outer_state_device="cpu" the anchor, the residuals and (after an outer
    step) the momentum are CPU tensors, pinned only when the parameters are on CUDA (never
    here), all fp32, and two outer steps (the fragments' outer step with given means, alpha 0.5) give bitwise
    the parameters, anchors and momentum of outer_state_device="same"."""
    from fl_accel.fragment import apply
    from workers._scenario import outer_view

    out = {}
    for where in ("same", "cpu"):
        cfg = FLConfig(sync_every=100, num_fragments=2, sync_dtype="int8", error_feedback=True,
                       outer_state_device=where, **NESTEROV)
        gen = torch.Generator().manual_seed(0)
        sync, params = _no_mesh_synchronizer(cfg, [torch.randn(40, generator=gen), torch.randn(3, 5, generator=gen)])
        outer = outer_view(sync)
        assert outer.anchor is not None and outer.residuals is not None and not outer.on_host
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn(p.shape, generator=gen))
            for _ in range(2):  # the second step uses the momentum taken by the first
                apply(sync.parts, [torch.randn(p.shape, generator=gen) for p in params], 0.5, 0)
        momentum = [s["momentum_buffer"] for s in outer.optimizer.state.values()]
        assert len(momentum) == 2
        for t in list(outer.anchor) + outer.residuals + momentum:
            assert t.device.type == "cpu" and not t.is_pinned() and t.dtype == torch.float32
        out[where] = [p.detach().clone() for p in params] + [a.detach().clone() for a in outer.anchor] + momentum
    assert all(torch.equal(a, b) for a, b in zip(out["same"], out["cpu"]))


# ====================================================================== h. sparse exchange
SPARSE_RUNS = {"sparse_nesterov": SPARSE_N, "sparse_avg": SPARSE_ZERO_FILL}


@pytest.mark.parametrize("name", list(SPARSE_RUNS))
def test_sparse_equals_simulation_at_every_step(four, name):
    """sync_dtype "sparse" (top 1/64 of every 4096 values, 2-bit values, error feedback),
    P=2, H=6, tau=1, "nesterov" (0.7, 0.9) and "avg", inner SGD, 11 steps + end_training:
    every rank's shards, rebuilt into each group's full parameters, equal the
    single-process simulation (top-k, quantization and error feedback written from the
    spec: :func:`ref_sparse`, :func:`sparse_mean`) after every step and at the end
    (<= 1e-6). Not vacuous: the exact-mean simulation and one at twice the density miss
    the gloo run by far more than the tolerance; the groups differ between syncs."""
    recs = four(name)
    frags = recs[0]["fragment_indices"]
    got = trajectory(recs)
    sim = simulate(group_batches(recs), SPARSE_RUNS[name], frags)
    err = worst(got, sim)
    print(f"[{name}: max |gloo - sparse simulation| over 11 steps + end = {err:.2e}]")
    assert err <= TOL
    assert max_diff(got[1][0], got[1][1]) > 1e-3
    assert all(torch.equal(a, b) for a, b in zip(got[-1][0], got[-1][1]))
    changes = {"exact mean": {"sync_dtype": "fp32"}, "density 2/64": {"sync_density": 2 / 64},
               "the other aggregation": {"sparse_aggregation": "zero_fill" if SPARSE_RUNS[name].get(
                   "sparse_aggregation", "senders") == "senders" else "senders"},
               "another decay": {"error_feedback_decay": 0.5},
               "a compressed final sync": {"final_sync": "compressed"}}
    for label, change in changes.items():
        miss = worst(got, simulate(group_batches(recs), {**SPARSE_RUNS[name], **change}, frags))
        print(f"[{name}: the simulation with {label} misses by {miss:.2e}]")
        assert miss > 1e-3, f"{name}: the simulation with {label} also matches ({miss:.2e})"


def _check_sparse_residuals(recs, num_chunks: int, density: float = 1 / 64, bits: int = 2,
                            beta: float = 0.95) -> tuple[int, float]:
    """For every launch on every rank: residual_after == x - ref_sparse(x) on this rank's
    chunk of the packed buffer x = (anchor - theta) + beta residual_before (0 outside the
    chunk), bitwise; carried forward to the next launch unchanged; the exact final sync
    leaves it zero. Returns (launches checked, the largest share of a chunk's squared norm
    that error feedback kept)."""
    checked, kept_share = 0, 0.0
    for rec in recs:
        chunk = rec["coords"][1] if num_chunks > 1 else 0
        last_after: dict[int, torch.Tensor] = {}
        assert rec["launches"]
        for la in rec["launches"]:
            for i, r in zip(la["indices"], la["residual_before"]):
                assert torch.equal(r, last_after[i]) if i in last_after else not r.any()
            if la["exact"]:  # the final sync sends everything in fp32: nothing is left
                assert not any(r.any() for r in la["residual_after"] or ()), f"rank {rec['rank']}"
                continue
            values = [torch.add(a - t.float(), r, alpha=beta)
                      for a, t, r in zip(la["anchor"], la["theta"], la["residual_before"])]
            n = sum(v.numel() for v in values)
            flat = _flat(values, num_chunks * 4096)
            size = flat.numel() // num_chunks
            mine = flat[chunk * size:(chunk + 1) * size]
            want = torch.zeros_like(flat)
            want[chunk * size:(chunk + 1) * size] = mine - ref_sparse(mine, density, bits)
            got = _flat(la["residual_after"], num_chunks * 4096)
            assert torch.equal(got[:n], want[:n]), f"rank {rec['rank']} step {la['step']}"
            kept_share = max(kept_share, (got.norm() ** 2 / mine.norm() ** 2).item())
            for i, r in zip(la["indices"], la["residual_after"]):
                last_after[i] = r
            checked += 1
    return checked, kept_share


def test_sparse_error_feedback_residual_fl_fsdp_and_hsdp_chunks(four, eight):
    """The residual each rank carries is exactly what top-k and the 2-bit codes dropped
    from its chunk (FL+FSDP: the whole shard; FL+HSDP 2x2x2: replica c's chunk c, 0 on
    the other), and on FL+HSDP the two replicas of a group end every step identical
    (the chunks shared over "dp_replicate")."""
    n4, share4 = _check_sparse_residuals(four("sparse_nesterov"), 1)
    recs = eight("hsdp_sparse")
    n8, share8 = _check_sparse_residuals(recs, 2)
    _assert_replicas_identical_every_step(recs)
    assert share4 > 0.5 and share8 > 0.5  # most of the pseudo-gradient waits for a later sync
    print(f"[sparse EF: {n4} (FL+FSDP) and {n8} (FL+HSDP) residual updates exact; error feedback keeps up to "
          f"{share4:.2f} / {share8:.2f} of a chunk's squared norm]")


def _sparse_model(fl: dict, world: int, steps: int):
    from unit.test_cost_model import estimate_from_config
    from fl_accel.planning.units import units_from_module

    return estimate_from_config(FLConfig(**fl), world, units_from_module(tiny_llama()), total_steps=steps)


def test_sparse_fl_bytes_at_most_005_of_fp32_and_equal_the_cost_model(four, eight):
    """Bytes on "fl" per rank per sync window (4 fragment syncs, the last with
    end_training's full sync, exact: an fp32 all-reduce), measured by the comm accounting:
    the fragment syncs <= 0.05x those of the fp32 exchange of the same fragments
    (wire_fp32), all-gathers, and on shard 0 (the cost model's busiest rank) every window
    equal to fl_accel.planning.cost to the byte, the final exact sync included, on FL+FSDP
    2x2 and on FL+HSDP 2x2x2 (each replica sends its half chunk)."""
    est = _sparse_model(SPARSE_N, 4, STEPS)
    assert set(est.full[0].bytes["fl"]) == {"all_reduce"}  # the model's final sync is the exact one
    ref, ratios = four("wire_fp32"), []
    for rec, base in zip(four("sparse_nesterov"), ref):
        f, _, s = rec["coords"]
        assert set(rec["final_comm"]["fl"]["by_op"]) == {"all_gather", "all_reduce"}
        model = [est.fragments[k % 2][f].of("fl") for k in range(4)]
        model[-1] += est.full[f].of("fl")
        for k, ((lo, hi), want) in enumerate(zip(WINDOWS, model)):
            b = _window_bytes(rec, lo, hi)
            if k < len(WINDOWS) - 1:
                ratios.append(b / _window_bytes(base, lo, hi))
            assert b == want if s == 0 else b <= want, (rec["rank"], lo, b, want)
    assert max(ratios) <= 0.05
    recs8 = eight("hsdp_sparse")
    fl8 = next(sc["fl"] for sc in HSDP_SCENARIOS if sc["name"] == "hsdp_sparse")
    est8 = _sparse_model(fl8, 8, 4)
    for rec in recs8:  # fragment 0 launched at step 2, applied at 3; end_training: the full sync
        f, _, s = rec["coords"]
        first = rec["steps"][2]["comm"]["fl"]["bytes"]
        last = rec["final_comm"]["fl"]["bytes"] - first
        want = (est8.fragments[0][f].of("fl"), est8.full[f].of("fl"))
        assert (first, last) == want if s == 0 else first <= want[0] and last <= want[1], (rec["rank"], first, last)
    print(f"[sparse fl bytes vs fp32 per sync window: {min(ratios):.4f}-{max(ratios):.4f}; cost model equal on "
          f"shard 0 (FL+FSDP, FL+HSDP)]")


def test_sparse_resume_mid_exchange_is_bitwise(four, resumed):
    """sparse + error feedback, "nesterov", inner SGD with momentum: the checkpoint of step
    5 (fragment 1's all-gather launched at step 5, applied at 6) resumed in fresh
    processes gives every later loss, every rank's shards after every step and after
    end_training bitwise equal to the run that saved it."""
    for rec in four("sparse_saved"):
        assert {s["step"]: s for s in rec["saved"]}[5]["sync_state"]["inflight_fragment"] == 1
    res = resumed("sparse_from5")
    for rec in res:
        assert rec["load_error"] is None, rec["load_error"]
        assert rec["start"] == 5 and rec["resumed_sync_state"]["inflight_fragment"] == 1
        assert [st["step"] for st in rec["steps"]] == list(range(6, STEPS + 1))
    got = trajectory(four("sparse_saved"))
    assert max_diff(got[4][0], got[4][1]) > 1e-3  # the groups differed at the checkpoint
    _assert_same_run(four("sparse_saved"), res, 6)
