"""One run's state, :class:`Run`: what the training loops, the logging and the final phase share.

Built by :func:`recipes.pretrain.start_run`; read by the loops of :mod:`recipes.pretrain` and
by :mod:`recipes.results`. Its methods write the run's records: metrics.jsonl and the trackers
(:meth:`Run.log`, :meth:`Run.log_train`), evaluations (:meth:`Run.evaluate`) and checkpoints
(:meth:`Run.save_checkpoint`). With several groups in this launch, the log and evaluation
records wait for the next sync, where their figures are summed over the world (:mod:`recipes.sync_log`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import sys
import time
from typing import Any

from tqdm.auto import tqdm

from recipes.metrics import SCORED, eval_figures, eval_totals, evaluate, scored
from recipes.results import ft_counters, groups_ending_alike
from recipes.run_folder import save_checkpoint
from recipes.sync_log import SyncLog, wait_text


def tracker_config(config: dict) -> dict:
    """The run's config as every tracker takes it: TensorBoard's hyperparameters accept only
    numbers, strings and booleans, so other values (lists, None, dicts) become their JSON text."""
    return {k: v if isinstance(v, (bool, int, float, str)) else json.dumps(v) for k, v in config.items()}



@dataclasses.dataclass
class Run:
    """The objects the loop, the logging and the final phase share."""

    plan: Any
    accelerator: Any
    model: Any
    optimizer: Any
    scheduler: Any
    data: Any
    meter: Any
    eval_every: int
    config: Any
    wandb_id: str | None = None
    batches: Any = None
    progress: Any = None
    group_evals: dict = dataclasses.field(default_factory=dict)
    sync_log: Any = None  # recipes.sync_log.SyncLog: records whose world figures wait for the next sync
    heals_reported: int = 0  # torchft mode: heals already announced (recipes.pretrain.report_heals)
    steps_per_epoch: int | None = None  # map-style data (None: a stream)
    start_step: int = 0  # the step this session started from (resumed; under rounds: the federation's)

    @property
    def args(self):
        return self.plan.args

    fl = property(lambda self: self.accelerator.fl_config, doc="The run's FLConfig (the accelerator's run_config).")
    max_steps = property(lambda self: self.accelerator.max_steps, doc="The run's length (the accelerator's).")
    layout = property(lambda self: self.accelerator.layout, doc="The federation's layout (the accelerator's).")

    @property
    def rounds(self) -> bool:
        """A ``sync_trigger`` other than "steps": groups count their own steps
        (:func:`recipes.pretrain.train_rounds`)."""
        return self.accelerator.federation.triggered

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.args.output_dir, "metrics.jsonl")

    def start_trackers(self, **extra) -> None:
        """W&B (offline unless WANDB_MODE says otherwise; the run id survives resumes), the progress bar
        and the log (``sync_log``: with several groups in this launch, figures summed at syncs)."""
        args, acc, layout = self.args, self.accelerator, self.layout
        if args.report_to != "none":
            self.wandb_id = self.wandb_id or secrets.token_hex(4)  # the main process's is used (it owns the tracker)
            ignored = set(self.fl.ignored_fields())  # e.g. num_groups for the baselines: not what ran
            run_config = {**dataclasses.asdict(args),
                          **{f"fl/{k}": v for k, v in self.fl.to_dict().items() if k not in ignored},
                          "fl/num_groups": layout.num_groups,  # the effective F (1 for the baselines)
                          "world_size": layout.world_size, "num_groups": layout.num_groups,
                          "group_sizes": list(layout.group_sizes), "shards": layout.shards,
                          "max_steps": self.max_steps, "model_flops_per_token": self.meter.flops_per_token, **extra}
            init_kwargs = {"wandb": {"group": args.experiment, "name": self.plan.run_name, "dir": args.output_dir,
                                     "tags": [self.fl.algorithm], "id": self.wandb_id, "resume": "allow"}}
            acc.init_trackers(args.wandb_project, config=tracker_config(run_config), init_kwargs=init_kwargs)
        self.progress = tqdm(total=self.max_steps, initial=self.meter.completed_steps, unit="step",
                             disable=not acc.is_local_main_process, desc=self.plan.run_name, dynamic_ncols=True)
        self.sync_log = SyncLog(  # several groups in this launch's world: they meet only at syncs
            deferred=acc.launch_layout.num_groups > 1, progress=self.progress,
            until=lambda step: wait_text(acc.federation, step, self.max_steps, args.checkpoint_every,
                                         self.rounds))

    def log(self, record: dict) -> None:
        """One record to W&B (numbers only) and metrics.jsonl (main process)."""
        if self.args.report_to != "none":
            self.accelerator.log({k: v for k, v in record.items() if isinstance(v, (int, float))},
                                 step=record["step"])
        if self.accelerator.is_main_process:
            with open(self.metrics_path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(record) + "\n")

    def log_train(self) -> None:
        """This step's train record: taken now, summed over the world and written by ``sync_log``."""
        part, record = self.meter.train_snapshot(self.scheduler.get_last_lr()[0])
        fed = self.accelerator.federation.progress_step if self.rounds else None  # one step axis for every group

        def write(summed):
            rec = record(summed)
            if fed is not None:
                rec.update(step=fed, group_step=rec["step"])
            self.log(rec)
            self.sync_log.show(f"loss={rec['train/loss']:.3f}, {rec['perf/tokens_per_s'] or 0:,.0f} tokens/s over the "
                               f"last {self.args.log_every} steps")

        self.sync_log.add(self.meter.completed_steps if fed is None else fed, part, write)

    def evaluate_groups_before_sync(self, _synchronizer, full) -> None:
        """Pre-sync hook: each group's own model, scored right before the sync of an evaluation step."""
        step = self.accelerator.federation.step
        if self.rounds:  # groups at different steps: --eval_groups scores at the end only
            return
        if self.eval_every and step % self.eval_every == 0 and step < self.max_steps:
            self.group_evals[step] = evaluate(self.model, self.accelerator, self.data.val_blocks,
                                              self.args.micro_batch_size, per_group=True)

    def groups_in_last_sync(self) -> int | None:
        """The federation groups the last sync covered (None before any; torchft: the quorum's,
        and after the run's end, the groups ending with this group's model: :func:`groups_ending_alike`)."""
        end = self.accelerator.federation.end_state
        return groups_ending_alike(end) if end is not None else self.accelerator.federation.last_num_groups

    def evaluate(self, step: int, final: bool = False) -> tuple | None:
        """Score the model (and, with ``--eval_groups``, each group's), log and print what was scored
        (mid-run: when ``sync_log`` has summed it over the world). Returns the overall (perplexity,
        mean NLL, tokens) when written now (always when ``final``), else None."""
        args, layout, fl = self.args, self.layout, self.fl
        if final:
            self.sync_log.flush()  # the records of earlier steps first
        totals = eval_totals(self.model, self.accelerator, self.data.val_blocks, args.micro_batch_size)
        groups = self.group_evals.pop(step, [])
        if final and args.eval_groups and layout.num_groups > 1:
            groups = evaluate(self.model, self.accelerator, self.data.val_blocks, args.micro_batch_size, True)
        what = scored(fl, final, self.groups_in_last_sync())
        # ``step`` under rounds is the federation's: every group's tokens, not this group's own
        now = {"step": step, "tokens": step * self.meter.tokens_per_step if self.rounds else self.meter.tokens,
               "time_s": self.meter.clock.total("train_seconds"), "wall_s": self.meter.clock.wall_now(),
               "unix_time": time.time()}  # when: a restarted torchft group's sessions share step numbers
        done = []

        def write(summed):
            ppl, nll, tokens = eval_figures(summed)[0]
            record = {**now, "eval/perplexity": ppl, "eval/loss": nll, "eval/scored": what}
            if groups:
                record.update({f"eval/perplexity_group{f}": r[0] for f, r in enumerate(groups)})
                record.update({f"eval/loss_group{f}": r[1] for f, r in enumerate(groups)})
                record["eval/scored_groups"] = "after the final sync" if final else "before the sync"
            self.log(record)
            if self.accelerator.is_main_process:  # above the progress bar (tqdm.write clears and redraws it)
                self.progress.write(
                    f"[fl_accel] step {step}: eval perplexity {ppl:.2f} ({SCORED[what].split(' (')[0]})"
                    + (f"; each group's own model {record['eval/scored_groups']}: "
                       + ", ".join(f"group {f} {r[0]:.2f}" for f, r in enumerate(groups)) if groups else ""),
                    file=sys.stdout)
            done.append((ppl, nll, tokens))

        self.sync_log.add(step, totals, write)
        if final:
            self.sync_log.flush()
        return done[0] if done else None

    def save_checkpoint(self, step: int) -> None:
        """A checkpoint of the run at ``step`` (:func:`recipes.run_folder.save_checkpoint`), with the
        whole-run figures so far and the torchft counters."""
        self.sync_log.flush()  # a checkpoint is a world event: metrics.jsonl then holds every record up to it
        totals = {**self.meter.checkpoint_totals(self.wandb_id), "fault_tolerance": ft_counters(self.accelerator,
                                                                                               self.meter.restored)}
        save_checkpoint(self.accelerator, self.plan, step, self.max_steps, totals, self.data.stream,
                        rank_extra=self.meter.rank_state)
