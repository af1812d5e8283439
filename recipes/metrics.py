"""What a run measures and records: time, throughput, MFU, memory, traffic, evaluations.

One place owns every figure the recipe writes (``metrics.jsonl``, W&B, ``all_results.json``):

* **Time** (:class:`Clock`, seconds, ``time.perf_counter``). A session's wall time, from
  the start of argument parsing to ``all_results.json``, is split into exactly three parts:
  ``startup_seconds`` (data, model, ``prepare``, resume: until the first training step
  starts), ``train_seconds`` (the training steps, with their logging) and
  ``eval_and_checkpoint_seconds`` (evaluations, checkpoints, the final sync, the export).
  ``wall_seconds`` is their sum over every session of the run (a resumed run adds its own).
  Python's start-up and imports before that (about 10 s per launch here) are
  ``session.launch_seconds``, in no other figure. ``host.wall_s`` is the session's wall
  time again, over which ``host.background_cpu_share`` was measured.
* **Throughput**: tokens/s = training tokens / ``train_seconds`` (whole run; in a logged
  step: since the previous logged step), per process = / world size.
* **MFU** = ``model_flops_per_token`` x tokens/s per process / peak FLOPS
  (:mod:`fl_accel.planning.flops`: torchtitan's 6 (N - N_emb) + 12 L h d_head T; the peak from
  ``--peak_tflops`` or the CUDA device's name; null when unknown, e.g. on CPU).
* **Memory** (MiB = 2**20 bytes): ``peak_host_mb`` the largest peak RSS of any rank over the
  whole run (``ru_maxrss``), ``peak_host_mb_after_prepare`` the same right after
  ``prepare`` and initialization, ``peak_accelerator_mb`` the largest
  ``torch.cuda.max_memory_allocated`` of any rank (null on CPU).
* **Traffic** per bucket ("fl", "dp_replicate", "dp_shard", "world"): the bytes, calls and
  seconds of :mod:`fl_accel.comm`, which every rank counts for itself. ``comm`` holds the
  largest figure of any rank, ``comm_sum`` the sum over all ranks and ``comm_by_group[f]``
  the largest of group f's ranks (unequal groups: the groups' ranks differ).
  ``sync_time_share`` = the training thread's wait for inter-group communication
  (``accelerator.federation.sync_wait_seconds``, largest rank) / ``train_seconds``. Of that wait,
  ``sync_arrival_share_by_group[f]`` is the part group f spent waiting for the other ranks
  to arrive at the syncs (``accelerator.federation.sync_arrival_seconds``, the largest of its ranks, over
  ``train_seconds``): what a faster group loses to a slower one, the exchange excluded.
* **Evaluations** record what they scored (``eval/scored``; :func:`scored`).

**Keys** of a record (metrics.jsonl, W&B, TensorBoard), one prefix per kind: the axes
``step``, ``tokens``, ``time_s`` (training seconds), ``wall_s`` (evaluations) and, in the
torchft mode, ``unix_time``; ``train/`` (loss, lr, grad_norm), ``eval/`` (perplexity, loss,
what was scored), ``perf/`` (tokens/s of the window since the previous record, step time,
MFU, peak memory, ``speedup_vs_baseline`` with ``--baseline_tokens_per_s``), ``comm/``
(``comm/<bucket>/<bytes|calls|seconds>`` cumulative for the busiest rank,
``comm/<bucket>/mib_per_step`` since the previous record, ``comm/all_ranks/...`` summed over
ranks) and ``fl/`` (the federation's: ``fl/sync_time_share``, ``fl/rounds/...``). Constants
(FLOPs per token, the layout, every setting) are in the run's config, not in records.
Records written before this scheme used other names (:data:`RENAMED_KEYS`);
:func:`record_value` reads either.

Every record's world figures are one sum over the world's ranks; :mod:`recipes.sync_log`
decides when it is made (with several federation groups: at the next sync, not between).

With ``--fault_tolerance torchft`` each federation group is its own launch: every figure
above is gathered over the group's own ranks (``accelerator.launch_layout``) and is that
group's (its tokens, its tokens/s, its traffic), written into its own folder.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from fractions import Fraction
from typing import Any

FIGURES = ("bytes", "calls", "seconds")
RENAMED_KEYS = {"lr": "train/lr", "tokens_per_s": "perf/tokens_per_s",
                "tokens_per_s_per_process": "perf/tokens_per_s_per_process", "step_time_s": "perf/step_time_s",
                "mfu": "perf/mfu", "peak_host_mb": "perf/peak_host_mb", "peak_accelerator_mb": "perf/peak_accelerator_mb",
                "sync_time_share": "fl/sync_time_share"}
"""A record's key before the key scheme (module docstring) -> its key now; ``comm_sum/...`` is now
``comm/all_ranks/...``, ``rounds/...`` ``fl/rounds/...``, ``counters/...`` ``perf/counters/...``."""
_PREFIXES_BEFORE = (("comm/all_ranks/", "comm_sum/"), ("fl/rounds/", "rounds/"), ("perf/counters/", "counters/"))


def record_value(record: dict, key: str, default: Any = None) -> Any:
    """``record[key]`` under the key scheme's name, else under the name records had before it
    (:data:`RENAMED_KEYS`: bench/results and older runs), else ``default``."""
    if key in record:
        return record[key]
    old = next((o for o, n in RENAMED_KEYS.items() if n == key), None)
    for new, before in _PREFIXES_BEFORE:
        if key.startswith(new):
            old = before + key[len(new):]
    return record.get(old, default) if old is not None else default
PER_RANK = 4  # host MiB, accelerator MiB, sync wait seconds, sync arrival seconds; then FIGURES per comm bucket


# =========================================================================== time
class Clock:
    """The session's time split (see the module docstring); totals add earlier sessions'."""

    def __init__(self, t0: float, restored: dict):
        self.t0 = t0
        self.before = {k: float(restored.get(k, 0.0)) for k in (
            "startup_seconds", "train_seconds", "eval_and_checkpoint_seconds", "wall_seconds")}
        self.session = {"startup_seconds": 0.0, "train_seconds": 0.0, "eval_and_checkpoint_seconds": 0.0}
        self.t_last: float | None = None

    def start_training(self) -> None:
        self.t_last = time.perf_counter()
        self.session["startup_seconds"] = self.t_last - self.t0

    def tick(self, part: str) -> float:
        """Charge the time since the last tick to ``part``; returns the seconds charged."""
        now = time.perf_counter()
        spent, self.t_last = now - self.t_last, now
        self.session[part] += spent
        return spent

    def total(self, part: str) -> float:
        return self.before[part] + self.session[part]

    def wall_now(self) -> float:
        """Wall-clock seconds of the whole run up to now: earlier sessions' and this one's since
        its start (start-up, training, evaluations and checkpoints alike)."""
        return self.before["wall_seconds"] + time.perf_counter() - self.t0

    def totals(self) -> dict[str, float]:
        """Whole-run figures (all sessions); ``wall_seconds`` is the sum of the three parts."""
        out = {k: self.total(k) for k in self.session}
        out["wall_seconds"] = self.before["wall_seconds"] + sum(self.session.values())
        return out


def launch_seconds() -> float | None:
    """Seconds from this process's creation to now (interpreter start-up and imports when
    called at the top of ``main``); None when psutil is unavailable."""
    try:
        import psutil

        return time.time() - psutil.Process().create_time()
    except Exception:
        return None


# =========================================================================== memory
def peak_host_mb() -> float:
    """This process's peak resident memory so far, in MiB (``ru_maxrss``, KiB on Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def peak_accelerator_mb(device) -> float | None:
    """``torch.cuda.max_memory_allocated`` of ``device`` in MiB; None off CUDA."""
    import torch

    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**20


def _max_or_none(*values):
    values = [v for v in values if v is not None]
    return max(values) if values else None


# =========================================================================== traffic
def aggregate(per_rank, layout, buckets) -> dict:
    """Per-rank figures ``[world, PER_RANK + 3 * len(buckets)]`` (a float64 tensor or nested
    list) into the run's figures: ``host_mb``/``accelerator_mb``/``sync_wait_seconds`` (largest
    rank; accelerator None when every rank reported a negative value, i.e. no CUDA),
    ``sync_arrival_by_group`` (the largest arrival wait of each group's ranks), and
    ``comm`` / ``comm_sum`` / ``comm_by_group`` (see the module docstring)."""
    rows = [list(map(float, r)) for r in (per_rank.tolist() if hasattr(per_rank, "tolist") else per_rank)]
    acc = max(r[1] for r in rows)

    def figures(ranks, combine):
        out = {}
        for b, bucket in enumerate(buckets):
            col = PER_RANK + 3 * b
            out[bucket] = {name: combine([rows[k][col + i] for k in ranks]) for i, name in enumerate(FIGURES)}
            out[bucket]["bytes"], out[bucket]["calls"] = int(out[bucket]["bytes"]), int(out[bucket]["calls"])
        return out

    world = range(len(rows))
    return {"host_mb": max(r[0] for r in rows), "accelerator_mb": acc if acc >= 0 else None,
            "sync_wait_seconds": max(r[2] for r in rows),
            "sync_arrival_by_group": [max(rows[k][3] for k in layout.group_ranks(f)) for f in range(layout.num_groups)],
            "comm": figures(world, max), "comm_sum": figures(world, sum),
            "comm_by_group": [figures(layout.group_ranks(f), max) for f in range(layout.num_groups)]}


# =========================================================================== evaluation
def eval_batches(blocks, index: int, count: int, micro_batch: int):
    """Split validation blocks over ``count`` ranks with no duplicates.

    Rank ``index`` takes rows ``index, index+count, ...``. Every rank gets the same
    number of batches (FSDP needs every rank of a group in each forward); missing rows
    are filled with row 0 and a weight of 0. Yields (input_ids [b, L], weight [b]).
    """
    import torch

    mine = list(range(index, len(blocks), count))
    per_rank = math.ceil(len(blocks) / count)
    for b in range(math.ceil(per_rank / micro_batch)):
        idx = mine[b * micro_batch:(b + 1) * micro_batch]
        weight = [1.0] * len(idx) + [0.0] * (micro_batch - len(idx))
        idx = idx + [0] * (micro_batch - len(idx))
        yield torch.tensor([blocks[i] for i in idx]), torch.tensor(weight, dtype=torch.float64)


def evaluate(model, accelerator, blocks, micro_batch: int, per_group: bool = False):
    """Token-weighted perplexity over the whole validation set.

    ppl = exp(sum of token NLL / number of predicted tokens), summed over ranks (not the
    mean of per-batch means). The totals live on ``accelerator.device`` and are
    all-reduced over the world (also at world size 1), so the same code runs on gloo
    and NCCL. ``per_group=False``: the world's ranks split the rows. ``per_group=True``:
    each federation group evaluates every row with its own model, split over its own
    ranks. Returns a list of (perplexity, mean NLL in nats, tokens): one entry, or one
    per group. Collective: :func:`eval_totals` (the group's own collectives only), one
    world all-reduce, :func:`eval_figures`.
    """
    import torch.distributed as dist

    totals = eval_totals(model, accelerator, blocks, micro_batch, per_group)
    dist.all_reduce(totals)  # a group's ranks evaluated disjoint rows: the sum is the group's total
    return eval_figures(totals)


def eval_totals(model, accelerator, blocks, micro_batch: int, per_group: bool = False):
    """This rank's part of :func:`evaluate`: ``[slots, 2]`` float64 (summed token NLL in nats,
    predicted tokens) on ``accelerator.device``, one row per slot (1, or one per group with
    ``per_group``), zero in the other groups' rows. Its sum over the world is the
    evaluation's; the forwards use the group's own collectives (FSDP), none of the world."""
    import torch
    import torch.nn.functional as F

    layout, rank = accelerator.layout, accelerator.process_index
    slots = layout.num_groups if per_group else 1
    slot = accelerator.group_index if per_group else 0
    index, count = ((layout.group_local_rank(rank), layout.group_size_of(accelerator.group_index)) if per_group
                    else (rank, accelerator.num_processes))
    was_training = model.training
    model.eval()
    totals = torch.zeros(slots, 2, dtype=torch.float64, device=accelerator.device)
    with torch.no_grad():
        for ids, weight in eval_batches(blocks, index, count, micro_batch):
            ids, weight = ids.to(accelerator.device), weight.to(accelerator.device)
            logits = model(input_ids=ids, use_cache=False).logits.float()
            nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1),
                                  reduction="none").view(ids.size(0), -1).sum(1).double()
            totals[slot, 0] += (nll * weight).sum()
            totals[slot, 1] += weight.sum() * (ids.size(1) - 1)
    if was_training:
        model.train()
    return totals


def eval_figures(totals) -> list[tuple[float, float, int]]:
    """World-summed :func:`eval_totals` -> (perplexity, mean NLL in nats, tokens) per slot."""
    out = []
    for s in range(totals.size(0)):
        mean_nll = (totals[s, 0] / totals[s, 1]).item()
        out.append((math.exp(mean_nll), mean_nll, int(totals[s, 1].item())))
    return out


SCORED = {
    "synchronized": "the synchronized model (every group holds the same parameters)",
    "single group": "the model (one group spans the world: nothing to synchronize)",
    "own group": "this group's own model: the last sync covered fewer federation groups than the run has "
                 "(torchft: the others had ended or were down), so the groups may end different",
    "own group per rank": "each rank scores its rows with its own group's model (fragments or alpha > 0 leave the "
                          "groups different between full syncs)",
}
"""``eval/scored`` values and their meaning; ``eval/scored_groups`` is always "before sync":
each group's own model, scored right before the sync of that step."""


def groups_differ_after_syncs(fl) -> bool:
    """A mid-run evaluation at a multiple of H scores groups that differ: fragments (P > 1),
    alpha > 0, delayed local steps kept ("keep" with tau > 0), or a warm-up of K steps that is
    not a multiple of H (the syncs fall at K + n H)."""
    return (fl.num_fragments > 1 or bool(fl.fragment_update_alpha) or bool(fl.sync_warmup_steps % fl.sync_every)
            or (fl.delayed_local_steps == "keep" and fl.sync_delay > 0))


def scored(fl, final: bool, groups_in_last_sync: int | None = None) -> str:
    """What an evaluation after the step's sync scores (a key of :data:`SCORED`).

    Mid-run evaluations fall on multiples of H, right after a sync: with one fragment and
    alpha = 0 the groups are then identical; otherwise (:func:`groups_differ_after_syncs`)
    they are not until the final full sync. ``groups_in_last_sync``: the federation groups the last
    sync covered (fewer than ``fl.num_groups``: "own group")."""
    if not fl.is_federated:
        return "single group"
    if groups_in_last_sync is not None and groups_in_last_sync < fl.federation_size:
        return "own group"
    if final or not groups_differ_after_syncs(fl):
        return "synchronized"
    return "own group per rank"


# =========================================================================== per-step figures
class Meter:
    """Windows between logged steps and the whole run's counters (see the module docstring).

    The loop calls :meth:`micro_batch` after each micro-batch, :meth:`set_grad_norm` at each
    optimizer step, :meth:`step_done` after it, :meth:`train_snapshot` at a logging step (its
    figures summed over the world by :mod:`recipes.sync_log`) and wraps evaluations and
    checkpoints in :meth:`outside_training`.
    """

    layout = property(lambda self: getattr(self.accelerator, "launch_layout", self.accelerator.layout),
                      doc="This launch's layout, the accelerator's (torchft mode: this group's ranks).")

    def __init__(self, accelerator, clock: Clock, *, tokens_per_step: int, completed_steps: int,
                 flops_per_token: float, peak_tflops: float | None, restored: dict,
                 baseline_tokens_per_s: float | None = None):
        import torch

        self.accelerator, self.clock = accelerator, clock
        self.tokens_per_step, self.completed_steps = tokens_per_step, completed_steps
        # optimizer steps on this launch's own data (torchft mode: a heal takes over a step count, not data)
        self.data_steps = int(restored.get("data_steps", completed_steps))
        self.tokens = self.data_steps * tokens_per_step
        self.flops_per_token, self.peak_tflops = flops_per_token, peak_tflops
        self.restored = restored
        self.buckets = tuple(accelerator.comm_stats.as_dict())
        dev = accelerator.device
        self.window_loss = torch.zeros((), dtype=torch.float64, device=dev)  # summed on the device
        self.grad_norm = torch.zeros((), dtype=torch.float64, device=dev)
        self.window_n = self.window_tokens = 0
        self.window_train_s = 0.0
        self.sync_wait_before = float(restored.get("rank_sync_wait_seconds", 0.0))
        self.sync_arrival_before = float(restored.get("rank_sync_arrival_seconds", 0.0))
        self.baseline_tokens_per_s = baseline_tokens_per_s
        self._comm_last: tuple[int, dict] = (completed_steps, {})  # this process's counters start at 0

    # ---------------------------------------------------------------- loop callbacks
    def micro_batch(self, loss) -> None:
        self.window_loss += loss.detach().double()
        self.window_n += 1

    def set_grad_norm(self, norm) -> None:
        import torch

        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.grad_norm = torch.as_tensor(norm, device=self.accelerator.device).double()

    def step_done(self) -> int:
        """Count one optimizer step; returns the run's step count. With ``--fault_tolerance
        torchft`` that is ``accelerator.federation.step``: a group that healed took over a
        live group's count (its tokens stay the ones it trained)."""
        self.completed_steps += 1
        federation = getattr(self.accelerator, "federation", None)
        if federation is not None and federation.prepared and federation.config.fault_tolerant:
            self.completed_steps = federation.step
        self.data_steps += 1
        self.tokens += self.tokens_per_step
        self.window_tokens += self.tokens_per_step
        self.window_train_s += self.clock.tick("train_seconds")
        return self.completed_steps

    @contextlib.contextmanager
    def outside_training(self):
        """Time spent inside is ``eval_and_checkpoint_seconds``, not training."""
        self.window_train_s += self.clock.tick("train_seconds")  # logging belongs to training
        try:
            yield
        finally:
            self.clock.tick("eval_and_checkpoint_seconds")

    # ---------------------------------------------------------------- figures
    def sync_wait_seconds(self) -> float:
        """This rank's wait for inter-group communication over the whole run (seconds)."""
        return self.sync_wait_before + float(self.accelerator.federation.sync_wait_seconds)

    def sync_arrival_seconds(self) -> float:
        """Of :meth:`sync_wait_seconds`, this rank's wait for the others to arrive at syncs (seconds)."""
        return self.sync_arrival_before + float(self.accelerator.federation.sync_arrival_seconds)

    def gather(self, head: list[float]):
        """All-reduce ``head`` (summed over ranks) and every rank's own figures in one
        collective on ``accelerator.device``; returns (head summed, :func:`aggregate`)."""
        import torch.distributed as dist

        buf = self.rank_figures(head)
        dist.all_reduce(buf)  # counted in the "world" bucket of comm_stats
        return self.read_figures(buf, len(head))

    def rank_figures(self, head: list[float]):
        """This rank's part of :meth:`gather` (no collective): float64 ``[len(head) + world x
        (PER_RANK + 3 x buckets)]``, ``head`` first, then this rank's figures in its own row
        (zero in the others'), taken now; its sum over the world is what :meth:`read_figures` reads."""
        import torch

        acc, world = self.accelerator, self.accelerator.num_processes
        width = PER_RANK + 3 * len(self.buckets)
        buf = torch.zeros(len(head) + world * width, dtype=torch.float64, device=acc.device)
        buf[:len(head)] = torch.tensor(head, dtype=torch.float64)
        stats = acc.comm_stats.as_dict()
        acc_mb = peak_accelerator_mb(acc.device)
        mine = [peak_host_mb(), -1.0 if acc_mb is None else acc_mb, self.sync_wait_seconds(),
                self.sync_arrival_seconds()]
        mine += [float(stats[b][f]) for b in self.buckets for f in FIGURES]
        start = len(head) + acc.process_index * width
        buf[start:start + width] = torch.tensor(mine, dtype=torch.float64)
        return buf

    def read_figures(self, buf, n_head: int):
        """A world-summed :meth:`rank_figures` -> (head summed, :func:`aggregate`)."""
        width = PER_RANK + 3 * len(self.buckets)
        return buf[:n_head].tolist(), aggregate(buf[n_head:].view(self.accelerator.num_processes, width).cpu(),
                                                self.layout, self.buckets)

    def mfu(self, tokens_per_s_per_process: float | None) -> float | None:
        from fl_accel.planning.flops import mfu

        return mfu(self.flops_per_token, tokens_per_s_per_process, self.peak_tflops) \
            if tokens_per_s_per_process else None

    def train_snapshot(self, lr: float):
        """This step's log record, taken now without a collective: ``(buf, record)``, where
        ``buf`` is this rank's part (:meth:`rank_figures`) and ``record(buf summed over the
        world)`` returns the record: loss and grad norm averaged over the world, tokens/s of the
        window, MFU, memory, sync share, traffic (see module docstring), every figure as of
        now. Starts the next window. The sum may come later (:mod:`recipes.sync_log`)."""
        layout, acc, F_ = self.layout, self.accelerator, self.layout.num_groups
        head = [0.0] * (1 + F_)
        head[0] = (self.window_loss / self.window_n / acc.num_processes).item()
        slot = acc.group_index if F_ > 1 else 0  # torchft mode: this launch holds one group
        head[1 + slot] = (self.grad_norm / layout.group_size_of(slot)).item()
        buf = self.rank_figures(head)
        tps = self.window_tokens / self.window_train_s if self.window_train_s > 0 else None
        per_process = tps / acc.num_processes if tps else None
        train_s = self.clock.total("train_seconds")
        step_time = self.window_train_s / max(1, self.window_n // max(1, self._accumulation()))
        now = {"step": self.completed_steps, "tokens": self.tokens, "time_s": train_s, "lr": lr}
        unix_time = time.time() if acc.run_config.fault_tolerant else None
        self.window_loss.zero_()
        self.window_n = self.window_tokens = 0
        self.window_train_s = 0.0

        def record(summed) -> dict:
            head_sum, run = self.read_figures(summed, 1 + F_)
            out = {**{k: now[k] for k in ("step", "tokens", "time_s")}, "train/loss": head_sum[0],
                   "train/lr": now["lr"], "train/grad_norm": sum(head_sum[1:]) / F_,
                   **{f"train/grad_norm_group{f}": head_sum[1 + f] for f in range(F_) if F_ > 1},
                   "perf/tokens_per_s": tps, "perf/tokens_per_s_per_process": per_process,
                   "perf/step_time_s": step_time, "perf/mfu": self.mfu(per_process),
                   "perf/peak_host_mb": run["host_mb"], "perf/peak_accelerator_mb": run["accelerator_mb"],
                   "fl/sync_time_share": run["sync_wait_seconds"] / train_s if train_s > 0 else None,
                   **_flat("comm", run["comm"]), **_flat("comm/all_ranks", run["comm_sum"]),
                   **self._comm_per_step(run["comm"], now["step"])}
            if tps and self.baseline_tokens_per_s:
                out["perf/speedup_vs_baseline"] = tps / self.baseline_tokens_per_s
            if unix_time is not None:  # groups are separate launches: align them by the clock
                out["unix_time"] = unix_time
            return out

        return buf, record

    def _comm_per_step(self, comm: dict, step: int) -> dict:
        """``comm/<bucket>/mib_per_step``: the busiest rank's MiB (2^20 bytes) on each bucket per
        optimizer step since the previous record (records are made in step order)."""
        steps = step - self._comm_last[0]
        out = {f"comm/{bucket}/mib_per_step": (figs["bytes"] - self._comm_last[1].get(bucket, 0)) / steps / 2**20
               for bucket, figs in comm.items()} if steps > 0 else {}
        self._comm_last = (step, {bucket: figs["bytes"] for bucket, figs in comm.items()})
        return out

    def _accumulation(self) -> int:
        return self.accelerator.gradient_accumulation_steps

    def checkpoint_totals(self, wandb_id) -> dict:
        """What a checkpoint stores for the whole-run figures of a resumed run: the time
        split, the peaks of memory so far (collective) and the W&B run id. Called inside
        :meth:`outside_training`: the evaluation before the save counts."""
        self.clock.tick("eval_and_checkpoint_seconds")
        _, run = self.gather([])
        return {**self.clock.totals(), "wandb_id": wandb_id,
                "peak_host_mb": _max_or_none(self.restored.get("peak_host_mb"), run["host_mb"]),
                "peak_accelerator_mb": _max_or_none(self.restored.get("peak_accelerator_mb"), run["accelerator_mb"])}

    def rank_state(self) -> dict:
        """Per-rank figures a checkpoint stores: the wait for inter-group communication and the
        data position (``data_steps``, this rank's own optimizer steps of data)."""
        return {"rank_sync_wait_seconds": self.sync_wait_seconds(),
                "rank_sync_arrival_seconds": self.sync_arrival_seconds(), "data_steps": self.data_steps}

    def run_figures(self) -> dict:
        """Whole-run time, throughput, MFU, memory and traffic figures of ``all_results.json``
        (collective)."""
        _, run = self.gather([])
        times = self.clock.totals()
        train_s = times["train_seconds"]
        tps = self.tokens / train_s if train_s > 0 else None
        per_process = tps / self.accelerator.num_processes if tps else None
        return {"train_tokens": self.tokens, "steps": self.completed_steps, "tokens_per_step": self.tokens_per_step,
                "tokens_per_s": tps, "tokens_per_s_per_process": per_process, **times,
                "model_flops_per_token": self.flops_per_token, "peak_tflops": self.peak_tflops,
                "mfu": self.mfu(per_process),
                "peak_host_mb": _max_or_none(self.restored.get("peak_host_mb"), run["host_mb"]),
                "peak_accelerator_mb": _max_or_none(self.restored.get("peak_accelerator_mb"), run["accelerator_mb"]),
                "sync_wait_seconds": run["sync_wait_seconds"],
                "sync_time_share": run["sync_wait_seconds"] / train_s if train_s > 0 else None,
                "sync_arrival_share_by_group": [a / train_s if train_s > 0 else None
                                                for a in run["sync_arrival_by_group"]],
                "comm": run["comm"], "comm_sum": run["comm_sum"], "comm_by_group": run["comm_by_group"],
                **({"baseline_tokens_per_s": self.baseline_tokens_per_s,
                    "speedup_vs_baseline": tps / self.baseline_tokens_per_s if tps else None}
                   if self.baseline_tokens_per_s else {})}


def _flat(prefix: str, comm: dict) -> dict:
    return {f"{prefix}/{bucket}/{name}": value for bucket, figs in comm.items() for name, value in figs.items()}


# =========================================================================== small formatting helpers
def weights_text(weights) -> str:
    """Group weights as fractions (``1/3, 2/3``) when they are simple, else decimals."""
    out = []
    for w in weights:
        frac = Fraction(w).limit_denominator(1000)
        out.append(f"{frac.numerator}/{frac.denominator}" if abs(float(frac) - w) < 1e-9 else f"{w:.4g}")
    return ", ".join(out)


def fl_accel_origin() -> dict[str, Any]:
    """The ``fl_accel`` this process imported: its version and folder."""
    import fl_accel

    version = getattr(fl_accel, "__version__", None)
    if version is None:
        try:
            from importlib.metadata import version as dist_version

            version = dist_version("fl_accel")
        except Exception:
            version = "unknown"
    return {"version": version, "path": os.path.dirname(os.path.abspath(fl_accel.__file__))}
