"""The recipe's test hooks, switched on from the environment and kept out of the training loop.

* ``FL_ACCEL_TEST_FAULT_INJECT=<kind>:<rank>:<step>`` acts on one rank at one optimizer
  step: ``kill`` sends SIGKILL to the process after that step (a crashed rank), ``stop``
  sends SIGSTOP (a hung rank), ``nan`` makes that rank's training loss NaN at that step
  (the NaN then flows through the gradients into the optimizer state). Only in the first
  attempt of a torchrun job (``TORCHELASTIC_RESTART_COUNT`` 0), so ``--max-restarts``
  runs recover.
* ``FL_ACCEL_TEST_RECORD_BLOCKS=<dir>`` makes every rank append one JSON line per training
  micro-batch to ``<dir>/rank<k>.jsonl``: ``{"step": the optimizer step it belongs to,
  "epoch": the data stream's epoch after this micro-batch (None for map-style data),
  "input_ids": the blocks as lists of token ids}``. Tests read which samples each rank
  trained on (disjoint shards, nothing seen twice after a resume).
* ``FL_ACCEL_TEST_STEP_SLEEP=<s_0>,<s_1>,...`` makes every rank of federation group f sleep
  after each optimizer step: s_f seconds, or ``x<k>`` k times the time since its previous
  step ended (a slowdown by a factor k + 1 whatever the machine's load): a group made slow
  for tests of ``sync_trigger`` (the bench slows groups with a CPU quota instead:
  bench/speed_bench.py).
* ``FL_ACCEL_TEST_RECORD_WORLD=<dir>`` makes every rank append to ``<dir>/rank<k>.jsonl`` the
  count of collectives on the default (world) process group so far (the comm meter's "world"
  bucket, :mod:`fl_accel.comm`): ``{"at": "sync", "step": s, "world": n}`` when a sync event
  starts (the first pre-sync hook, before the recipe's own) and ``{"at": "step", "step": s,
  "world": n}`` after each optimizer step (after its sync, if any). A sync event spans a
  "sync" record and the "step" record of the same step; tests check that no world collective
  falls outside them.

:func:`install` attaches them as callbacks: a forward pre-hook and a forward hook on the
prepared model (training forwards only: grad enabled and ``model.training``) and a step
post-hook on the inner optimizer, which fires once per real optimizer step, also under
gradient accumulation, after the federated sync's own hook. Unset variables install
nothing.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from .args import RecipeError

FAULT_ENV = "FL_ACCEL_TEST_FAULT_INJECT"
RECORD_ENV = "FL_ACCEL_TEST_RECORD_BLOCKS"
SLEEP_ENV = "FL_ACCEL_TEST_STEP_SLEEP"
WORLD_ENV = "FL_ACCEL_TEST_RECORD_WORLD"


def parse_fault(spec: str, rank: int) -> tuple[str | None, int | None]:
    """``(kind, step)`` of a ``FL_ACCEL_TEST_FAULT_INJECT`` spec for ``rank`` ((None, None) when
    it targets another rank).

    Raises:
        RecipeError: a malformed spec or an unknown kind.
    """
    try:
        kind, fault_rank, step = spec.split(":")
        fault_rank, step = int(fault_rank), int(step)
    except ValueError:
        raise RecipeError(f"{FAULT_ENV}={spec!r} must be <kill|stop|nan>:<rank>:<step>") from None
    if kind not in ("kill", "stop", "nan"):
        raise RecipeError(f"{FAULT_ENV} kind must be kill, stop or nan, got {kind!r}")
    return (kind, step) if fault_rank == rank else (None, None)


class _Steps:
    """Optimizer steps done so far (from ``start`` after a resume): the step a micro-batch
    belongs to is ``done + 1``."""

    def __init__(self, start: int):
        self.done = start

    def count(self, *_) -> None:
        self.done += 1


def parse_sleep(spec: str, group_index: int) -> tuple[float, bool]:
    """``(value, relative)`` for group ``group_index`` from a ``FL_ACCEL_TEST_STEP_SLEEP`` spec:
    seconds, or (``x<k>``) a factor of the step's own time; (0, False) for a group it does not
    list. RecipeError: not a comma list of seconds or factors >= 0."""
    try:
        values = [(float(v[1:]), True) if v.startswith("x") else (float(v), False) for v in spec.split(",")]
    except ValueError:
        raise RecipeError(f"{SLEEP_ENV}={spec!r} must be seconds or x<factor> per group, e.g. 0,0.25 or 0,x2") \
            from None
    if any(v < 0 for v, _ in values):
        raise RecipeError(f"{SLEEP_ENV}={spec!r}: values must be >= 0")
    return values[group_index] if group_index < len(values) else (0.0, False)


def install(model, optimizer, rank: int, start_step: int, epoch_fn=None, environ=None, group_index: int = 0,
            accelerator=None) -> list:
    """Attach the hooks the environment asks for; returns their handles (empty if none).

    Args:
        model: the prepared model (its training forwards are observed).
        optimizer: the prepared optimizer (the hook goes on the inner ``optimizer.optimizer``).
        rank: this process's rank in the world.
        start_step: optimizer steps already done (a resumed run's checkpoint step).
        epoch_fn: returns the data stream's epoch (``--streaming``), or None.
        group_index: this rank's federation group (``FL_ACCEL_TEST_STEP_SLEEP``).
        accelerator: the FLAccelerator (``FL_ACCEL_TEST_RECORD_WORLD``: its comm counters and
            pre-sync hooks; ignored before ``prepare(model, optimizer)``).

    Raises:
        RecipeError: a malformed ``FL_ACCEL_TEST_FAULT_INJECT``.
    """
    import torch

    environ = os.environ if environ is None else environ
    spec, folder = environ.get(FAULT_ENV, ""), environ.get(RECORD_ENV)
    kind, fault_step = parse_fault(spec, rank) if spec else (None, None)
    if environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        kind = None
    sleep, relative = parse_sleep(environ[SLEEP_ENV], group_index) if environ.get(SLEEP_ENV) else (0.0, False)
    federation = getattr(accelerator, "federation", None)
    world_dir = environ.get(WORLD_ENV) if federation is not None and federation.prepared else None
    if kind is None and not folder and not sleep and not world_dir:
        return []
    steps = _Steps(start_step)
    inner = getattr(optimizer, "optimizer", optimizer)
    handles = [inner.register_step_post_hook(steps.count)]
    if sleep:
        import time

        last = [time.perf_counter()]

        def slow_down(*_):
            now = time.perf_counter()
            time.sleep(sleep * (now - last[0]) if relative else sleep)
            last[0] = time.perf_counter()

        handles.append(inner.register_step_post_hook(slow_down))

    def training(module) -> bool:
        return torch.is_grad_enabled() and module.training

    if folder:
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{rank}.jsonl")

        def record(module, args, kwargs):
            if training(module):
                ids = kwargs.get("input_ids", args[0] if args else None)
                with open(path, "a", encoding="utf-8") as fh:
                    fh.write(json.dumps({"step": steps.done + 1, "epoch": epoch_fn() if epoch_fn else None,
                                         "input_ids": ids.tolist()}) + "\n")

        handles.append(model.register_forward_pre_hook(record, with_kwargs=True))
    if world_dir:
        handles += _record_world(accelerator, inner, steps, os.path.join(world_dir, f"rank{rank}.jsonl"))
    if kind == "nan":
        def poison(module, args, output):
            if training(module) and steps.done + 1 == fault_step:
                output.loss = output.loss * float("nan")
            return output

        handles.append(model.register_forward_hook(poison))
    elif kind in ("kill", "stop"):
        def act(*_):
            if steps.done == fault_step:
                sys.stderr.write(f"[fl_accel] {FAULT_ENV}: {kind} rank {rank} at step {fault_step}\n")
                sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)

        handles.append(inner.register_step_post_hook(act))
    return handles


def _record_world(accelerator, inner, steps: _Steps, path: str) -> list:
    """``FL_ACCEL_TEST_RECORD_WORLD``: a pre-sync hook at the head of the list and a step post-hook."""
    os.makedirs(os.path.dirname(path), exist_ok=True)

    def write(at: str, step: int) -> None:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"at": at, "step": step, "world": accelerator.comm_stats["world"].calls}) + "\n")

    def at_sync(_synchronizer, full) -> None:
        write("sync", steps.done + 1)  # inside optimizer.step(): its step is not counted yet

    sync_handle = accelerator.register_pre_sync_hook(at_sync, first=True)
    inner_handle = inner.register_step_post_hook(lambda *_: write("step", steps.done))
    return [inner_handle, sync_handle]
