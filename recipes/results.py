"""all_results.json and the run's closing lines: what the recipe assembles once training is over.

The stages :func:`recipes.pretrain.main` ends with, in its order: :func:`finish` (the final
sync, evaluation, checkpoint and export, and the whole-run figures), :func:`add_session_results`
(this session, the host's load, the torchft counters) and :func:`write_results`
(all_results.json, curves.png, the closing lines). The entries are explained in
docs/recipe.md ("What a run records"); their figures come from :class:`recipes.metrics.Meter`
and ``accelerator.federation``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from fl_accel.mesh import ranks_per_node
from recipes.inputs import data_record, stream_note
from recipes.metrics import scored
from recipes.modeling import export_final_model
from recipes.plots import plot_run_curves
from recipes.run_folder import read_metrics

if TYPE_CHECKING:  # annotations only: recipes.run_state imports this module
    from recipes.host_load import HostLoad
    from recipes.run_state import Run


def finish(run: Run, recorded: dict) -> dict:
    """The final sync (all groups end identical), the final evaluation, checkpoint and export,
    and the whole-run figures (collective). Returns all_results.json's dict (without ``host``
    and ``session``, which :func:`add_session_results` adds)."""
    acc, args, fl, layout = run.accelerator, run.args, run.fl, run.layout
    passes = None
    if run.data.stream is not None:  # the most-read shard: ranks read shards of different lengths
        passes = torch.tensor([run.data.stream.epoch], dtype=torch.int64, device=acc.device)
        if dist.is_initialized():
            dist.all_reduce(passes, op=dist.ReduceOp.MAX)
        passes = int(passes.item())
        note = stream_note(passes, run.max_steps)
        if note:
            acc.print(f"[fl_accel] {note}")
    with run.meter.outside_training():
        step = acc.federation.progress_step if run.rounds else run.meter.completed_steps  # the same on every group
        synced = acc.sync_if_pending(final=True)
        end = acc.federation.wait_for_groups()  # torchft: the other groups reach the end (or are given up on)
        covered = run.groups_in_last_sync()
        if end is not None and end["together"] and covered == fl.federation_size:
            acc.print(f"[fl_accel] the run's end: all {covered} federation groups hold the same final model "
                      f"(checksum {end['checksum']:.6e})")
        elif scored(fl, True, covered) == "own group":
            waited = (f" after waiting {end['waited_s']:.0f} s for them (FLConfig.rejoin_timeout_s)"
                      if end is not None else "")
            acc.print(f"[fl_accel] warning: the last sync (step {step}) covered {covered} of the run's "
                      f"{fl.federation_size} federation groups (the others had ended or were down{waited}): this "
                      f"group's final model is its own and may differ from theirs")
        elif synced:
            acc.print(f"[fl_accel] final synchronization: the federation groups synchronized at step {step}")
        elif fl.is_federated:
            acc.print(f"[fl_accel] final synchronization: none needed (the groups synchronized at step {step})")
        ppl, nll, n_tokens = run.evaluate(step, final=True)
        if args.checkpoint_every:
            run.save_checkpoint(step)
        if args.save_final_model:
            export_final_model(run.model, run.config, run.data.tokenizer,
                               os.path.join(args.output_dir, "final_model"), acc.is_main_process)
    S_ = layout.shards
    return {
        "algorithm": fl.algorithm, "world_size": layout.world_size, "num_groups": layout.num_groups,
        "nodes": -(-acc.num_processes // ranks_per_node(acc.num_processes)),  # this launch's (scripts.compare)
        "group_sizes": list(layout.group_sizes),
        "group_size": layout.group_size if layout.is_uniform else list(layout.group_sizes),
        "replicas": layout.replicas if layout.is_uniform else [g // S_ for g in layout.group_sizes], "shards": S_,
        "group_weights": list(layout.weights(fl.group_weighting)) if fl.is_federated else [1.0],
        "sync_every": fl.sync_every if fl.is_federated else None, "fl": fl.to_dict(),
        "eval_perplexity": ppl, "eval_loss": nll, "eval_tokens": n_tokens,
        "eval_scored": scored(fl, final=True, groups_in_last_sync=covered),
        "data": data_record(run.meter.completed_steps, run.steps_per_epoch, passes),
        **run.meter.run_figures(), "model": args.model, **recorded, "run_name": run.plan.run_name,
        "args": dataclasses.asdict(args),
        "final_model": os.path.join(args.output_dir, "final_model") if args.save_final_model else None,
        "wandb_id": run.wandb_id, "counters": counters_scope(run), **(federation_figures(run) if run.rounds else {}),
    }


def add_session_results(results: dict, run: Run, host: HostLoad | None, launched: float | None) -> None:
    """The last stage before :func:`write_results`: all_results.json's ``session`` (this
    session's steps and seconds), ``host`` (the host-load meter's figures; null without
    psutil) and, in the torchft mode, ``fault_tolerance`` (:func:`fault_tolerance_results`)."""
    meter, clock = run.meter, run.meter.clock
    results["session"] = {"resumed_from_step": run.start_step, "steps": meter.completed_steps - run.start_step,
                          "launch_seconds": launched, "wall_seconds": sum(clock.session.values()), **clock.session}
    results["host"] = host.stop() if host is not None else None
    if run.accelerator.run_config.fault_tolerant:
        results["fault_tolerance"] = fault_tolerance_results(run.accelerator, meter)


def groups_ending_alike(end: dict) -> int:
    """Of ``accelerator.federation.end_state`` (torchft mode): how many groups, this one
    included, ended with this group's final model (equal checksums in the last end quorum)."""
    return sum(1 for c in end["checksums"].values() if c == end["checksum"])


END_REPORT_VAR = "FT_LAUNCH_REPORT"
"""A file path (set by ``python -m scripts.ft_launch`` for each group's launch) where the
torchft mode's rank 0 writes :func:`end_report` at the end, for the launcher's summary."""


def end_report(run: Run, results: dict) -> dict:
    """What ``python -m scripts.ft_launch`` compares across groups at the end: the group, its
    steps, the final model's checksum (``federation.end_state``), whether every group ended
    together, the final eval perplexity and loss, and where the final model is."""
    end = run.accelerator.federation.end_state or {}
    return {"group": run.accelerator.group_index, "steps": results.get("steps"), "checksum": end.get("checksum"),
            "together": end.get("together"), "groups": end.get("groups"), "eval_perplexity": results["eval_perplexity"],
            "eval_loss": results["eval_loss"], "final_model": results.get("final_model"),
            "output_dir": run.args.output_dir}


def federation_figures(run: Run) -> dict:
    """all_results.json under ``sync_trigger`` "time"/"speed": ``rounds`` (:func:`round_results`),
    and ``steps``/``train_tokens``/``tokens_per_s`` of the whole federation (the same on every
    group), where :meth:`recipes.metrics.Meter.run_figures` counts this group's own steps."""
    rounds = round_results(run)
    step = run.accelerator.federation.progress_step
    return {"rounds": rounds, "steps": step, "train_tokens": step * run.meter.tokens_per_step,
            "tokens_per_s": rounds["tokens_per_s"]}


def round_results(run: Run) -> dict:
    """all_results.json's ``rounds`` (sync_trigger "time"/"speed"): per group the steps of each
    round, the share of its wall time spent waiting at syncs, its standalone tokens/s (its
    tokens per second of training, no waiting: its timed steps' mean), and the federation's
    tokens/s (every group's tokens over this process's training seconds, syncs included, as
    a "steps" run's ``tokens_per_s``) against their sum."""
    rounds = run.accelerator.federation.rounds
    summary = rounds.summary()
    per_rank_step = run.meter.tokens_per_step / run.layout.world_size
    standalone = [g * per_rank_step / t if t > 0 else None for g, t in
                  zip(rounds.sizes, [s / n if n else 0.0 for s, n in zip(rounds.train_s_total, rounds.timed_total)])]
    train_s = run.meter.clock.totals()["train_seconds"]  # this process's training time, syncs included
    federation = summary["rank_steps"] * per_rank_step / train_s if train_s else None
    known = [r for r in standalone if r is not None]
    return {**summary, "standalone_tokens_per_s": standalone, "tokens_per_s": federation,
            "of_standalone_sum": federation / sum(known) if federation and known else None}


def fault_tolerance_results(accelerator, meter) -> dict:
    """all_results.json's ``fault_tolerance`` entry (``--fault_tolerance torchft``): this
    launch's federation group and world size, how often it healed from a live group and
    each heal (``heal_log``: source group, step, bytes, seconds, transfer and load seconds;
    :func:`recipes.pretrain.report_heals`), the sync's counters
    (``accelerator.federation.counters()``: global_step, num_syncs, ...), the optimizer steps
    this launch trained itself (``steps`` minus those taken over in a heal), rank 0's host
    seconds in torchft's quorums and commit votes, and ``end``: how the run ended
    (``federation.end_state``: whether every group reached the end together, and their
    checksums). ``heals``, ``heal_log`` and ``torchft_seconds`` cover the whole run: a group
    resumed from its checkpoint adds the counts stored there (:func:`ft_counters`)."""
    counters = ft_counters(accelerator, meter.restored)
    return {"mode": accelerator.fl_config.fault_tolerance, "group_index": accelerator.group_index,
            "group_world_size": accelerator.num_processes, **counters, "sync": accelerator.federation.counters(),
            "steps_trained": meter.tokens // meter.tokens_per_step, "end": accelerator.federation.end_state}


def ft_counters(accelerator, restored: dict) -> dict:
    """``heals``, ``heal_log`` and ``torchft_seconds`` of the whole run: this session's (the
    torchft transport's) added to those a resumed checkpoint stored (``restored
    ["fault_tolerance"]``, written by :meth:`recipes.run_state.Run.save_checkpoint`); {} outside the
    torchft mode."""
    if not accelerator.run_config.fault_tolerant:
        return {}
    federation = accelerator.federation
    before = restored.get("fault_tolerance") or {}
    log = [{k: h.get(k) for k in ("source_group", "step", "bytes", "wire_bytes", "seconds", "transfer_seconds",
                                  "load_seconds")}
           for h in federation.heal_log]
    seconds = dict(before.get("torchft_seconds") or {})
    for k, v in federation.membership_seconds.items():
        seconds[k] = seconds.get(k, 0) + v
    return {"heals": int(before.get("heals", 0)) + federation.heals,
            "heal_log": list(before.get("heal_log") or []) + log, "torchft_seconds": seconds}


def counters_scope(run: Run) -> dict:
    """all_results.json's ``counters``: what the whole-run counters (tokens, seconds, bytes,
    calls and seconds by mesh axis, sync waits, torchft heals) cover. ``since``: "the run's
    start" (a fresh run, or one resumed from a checkpoint, which carried them over:
    ``carried_over_from``), or "this process's start" (an earlier session trained in this
    folder and ended before its first checkpoint, e.g. a torchft group killed and restarted:
    that session's counts are lost); ``steps_counted``: the optimizer steps they cover, this
    launch's own (a torchft group that healed took over ``steps`` it did not train)."""
    lost = bool(run.meter.restored.get("earlier_session_lost"))
    return {"since": "this process's start" if lost else "the run's start",
            "carried_over_from": run.plan.resume_path, "steps_counted": run.meter.data_steps}


def write_results(run: Run, results: dict) -> None:
    """all_results.json and curves.png (main process; without matplotlib no curves.png, one
    note instead), end of training, the closing lines."""
    acc, args, fl = run.accelerator, run.args, run.fl
    curves = False
    if results.get("rounds") and args.report_to != "none":  # the round figures on the W&B run too
        r = results["rounds"]
        acc.log({"fl/rounds/num_rounds": r["num_rounds"], "fl/rounds/tokens_per_s": r["tokens_per_s"] or 0.0,
                 **{f"fl/rounds/wait_share_group{f}": w for f, w in enumerate(r["wait_share"])},
                 **{f"fl/rounds/arrival_share_group{f}": a for f, a in
                    enumerate(results.get("sync_arrival_share_by_group") or []) if a is not None},
                 **{f"fl/rounds/steps_group{f}": n for f, n in enumerate(r["group_steps"])}})
    counters = results["counters"]
    if args.report_to != "none":  # what the whole-run counters cover, on the W&B run too
        acc.log({"perf/counters/since_process_start": int(counters["since"] == "this process's start"),
                 "perf/counters/steps_counted": counters["steps_counted"]})
    if acc.is_main_process:
        with open(os.path.join(args.output_dir, "all_results.json"), "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=1)
        if acc.run_config.fault_tolerant and os.environ.get(END_REPORT_VAR):
            with open(os.environ[END_REPORT_VAR], "w", encoding="utf-8") as fh:
                json.dump(end_report(run, results), fh)
        try:
            import matplotlib  # noqa: F401  (optional: the recipe trains without it)
        except ImportError:
            print("[fl_accel] note: matplotlib is not installed: no curves.png (pip install matplotlib draws it)",
                  file=sys.stderr)
        else:
            try:  # the whole history, also after a resume
                plot_run_curves(read_metrics(run.metrics_path), os.path.join(args.output_dir, "curves.png"),
                                f"{run.plan.run_name} ({args.model})", sync_every=fl.sync_every if fl.is_federated
                                else None, num_fragments=fl.num_fragments)
                curves = True
            except Exception as exc:  # a plot must never fail a training run
                print(f"[fl_accel] could not draw curves.png: {exc}", file=sys.stderr)
    acc.end_training()
    if acc.is_main_process:
        wandb_dir = os.path.join(args.output_dir, "wandb")
        mfu = results["mfu"]
        print(f"[fl_accel] done: eval perplexity {results['eval_perplexity']:.2f} (loss {results['eval_loss']:.4f}) "
              f"after {results['steps']} steps, {results['tokens_per_s'] or 0:,.0f} tokens/s (the whole run's tokens over "
              f"its training time; the progress bar shows the last window's)"
              + (f", MFU {100 * mfu:.1f}%" if mfu is not None else "") + "\n"
              f"[fl_accel] results: {os.path.join(args.output_dir, 'all_results.json')}, metrics.jsonl"
              + (", curves.png" if curves else "")
              + (", final_model/" if args.save_final_model else "")
              + (f"\n[fl_accel] W&B offline run under {wandb_dir} (upload: wandb sync {wandb_dir}/offline-run-*)"
                 if args.report_to in ("wandb", "all") else "")
              + (f"\n[fl_accel] TensorBoard: tensorboard --logdir {os.path.join(args.output_dir, 'tensorboard')}"
                 if args.report_to in ("tensorboard", "all") else "") + arrival_line(results, fl.is_federated)
              + rounds_line(results.get("rounds")) + counters_line(counters))


def counters_line(counters: dict) -> str:
    """The closing line saying what tokens, time and traffic cover after a resume or restart
    (:func:`counters_scope`); "" for a run of one session."""
    if counters["since"] == "this process's start":
        return (f"\n[fl_accel] note: tokens, time and traffic count since this process started ("
                f"{counters['steps_counted']} steps): an earlier session in this folder ended before its first "
                f"checkpoint, and its counts are lost")
    if counters["carried_over_from"]:
        return (f"\n[fl_accel] tokens, time and traffic cover the whole run: the sessions before "
                f"{counters['carried_over_from']} carried over from it")
    return ""


def arrival_line(results: dict, federated: bool) -> str:
    """The closing line of a federated run: the share of each group's training time spent waiting
    for the other groups to arrive at the syncs (the exchange itself excluded)."""
    shares = results.get("sync_arrival_share_by_group") or []
    if not federated or len(shares) < 2 or any(a is None for a in shares):
        return ""
    return ("\n[fl_accel] waiting for the other groups at syncs (exchange excluded): "
            + ", ".join(f"group {f} {100 * a:.0f}%" for f, a in enumerate(shares)) + " of training time")


def rounds_line(rounds: dict | None) -> str:
    """The closing line of a ``sync_trigger`` "time"/"speed" run: per group its steps, its mean
    steps per round and its share of wall time in syncs (exchange included); the federation's
    tokens/s against the standalone sum."""
    if not rounds:
        return ""
    groups = "; ".join(f"group {f}: {n} steps ({n / max(1, rounds['num_rounds']):.1f}/round), in syncs "
                       f"{100 * w:.0f}%" for f, (n, w) in enumerate(zip(rounds["group_steps"], rounds["wait_share"])))
    share = rounds.get("of_standalone_sum")
    return (f"\n[fl_accel] {rounds['num_rounds']} rounds by {rounds['trigger']}: {groups}"
            + (f"; {rounds['tokens_per_s']:.0f} tokens/s = {100 * share:.0f}% of the groups' standalone sum"
               if share else ""))
