"""The start-up banner: what this run is, in the words of the README, printed once by the main process.

Every line starts with ``[fl_accel]``. It names the ``fl_accel`` that was imported (a
stale editable install elsewhere shows up here), explains the layout letters once, shows
the group weights, every FLConfig value that is not a default (or that a file, variable
or flag set) with where it came from, marking those the algorithm ignores, the model, the
precision policy, activation checkpointing and compile, the batch arithmetic, the tokenizer
(trained on the run's text, and where it is cached, or which), and where checkpoints and the
final export go, about how large they are and how many checkpoints are kept.
"""

from __future__ import annotations

import os

from fl_accel.wire import SPARSE_BLOCK, sparse_k

from .args import describe_sources
from .metrics import weights_text

LETTERS = ("F federation groups of G ranks each; a group is R replicas x S shards (HSDP; R=1: FSDP); "
           "H optimizer steps between syncs; P fragments; a block is seq_len tokens")


def fl_line(parsed, fl=None) -> str:
    """``FLConfig: name=value (where); ...`` of ``fl`` (default ``parsed.fl``; the banner's:
    the resolved config), each value the algorithm and modes ignore marked with why
    (``FLConfig.ignored_fields``, the library's rule), whatever its value."""
    fl = parsed.fl if fl is None else fl
    return f"FLConfig: {'; '.join(describe_sources(parsed, fl.ignored_fields(), fl)) or 'all defaults'}"


def sparse_text(fl) -> str:
    """The effective top-k of "sparse": k of every 4096 values (``sync_density`` rounded up to
    whole bytes of codes), the bits, the aggregation, the error-feedback decay, the final sync."""
    k = sparse_k(fl.sync_density, fl.sync_value_bits)
    return (f"k={k} of every {SPARSE_BLOCK} values = density {k / SPARSE_BLOCK:.4g} (asked {fl.sync_density:.4g}), "
            f"{fl.sync_value_bits}-bit values, mean over the {fl.sparse_aggregation}, error feedback decay "
            f"{fl.residual_decay:g}, final sync {fl.final_sync}")


def precision_text(policy: dict, mixed: str) -> str:
    return (f"param {policy['param']}, reduce {policy['reduce']}, output {policy.get('output') or 'as computed'} "
            f"(mixed_precision {mixed})")


def size_text(nbytes: float) -> str:
    """``57.6 MB`` / ``1.23 GB`` / ``812 kB`` (decimal units)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}" if nbytes < 100 * scale else f"{nbytes / scale:,.0f} {unit}"
    return f"{nbytes / 1e3:.0f} kB"


def tokenizer_line(args, tokenizer) -> str:
    """What tokenizes the data: with ``--tokenizer bpe`` the recipe's byte-level BPE trained on
    this run's training text and the folder it is cached in (``recipes.data.train_bpe_tokenizer``:
    ``<cache_dir>/bpe<vocab_size>-<digest of the text>``, reused by any run on the same text and
    vocabulary size); else the named tokenizer."""
    if args.tokenizer == "bpe":
        return (f"tokenizer: a byte-level BPE of {len(tokenizer)} tokens trained on this run's training text "
                f"(--tokenizer bpe; a hub tokenizer: --tokenizer <name>), cached in {tokenizer.name_or_path}")
    return f"tokenizer: {args.tokenizer} ({len(tokenizer)} tokens), loaded from {tokenizer.name_or_path}"


def storage_line(args, fl, num_groups: int, n_params: int, param_bytes: int) -> str:
    """Where checkpoints and the final export go and about how large they are
    (:func:`recipes.run_folder.checkpoint_bytes`; mid-round checkpoints hold every group's
    model), and how many checkpoints are kept (``--checkpoints_total_limit``)."""
    from .run_folder import checkpoint_bytes, checkpoints_mid_round

    export = (f"final model: {os.path.join(args.output_dir, 'final_model')} (about {size_text(n_params * param_bytes)})"
              if args.save_final_model else "final model: not exported (--save_final_model false)")
    if not args.checkpoint_every:
        return f"checkpoints: none (--checkpoint_every 0); {export}"
    synced = checkpoint_bytes(n_params, param_bytes, num_groups, fl, mid_round=False)
    size = f"about {size_text(synced)} each"
    if checkpoints_mid_round(fl, num_groups, args.checkpoint_every):
        size += f" ({size_text(checkpoint_bytes(n_params, param_bytes, num_groups, fl, mid_round=True))} mid-round)"
    keep = args.checkpoints_total_limit
    kept = ("every one kept (--checkpoints_total_limit 0)" if not keep else
            f"the newest {keep} kept (--checkpoints_total_limit; 0 keeps all)")
    every = f"every {args.checkpoint_every} steps" if args.checkpoint_every > 1 else "every step"
    return (f"checkpoints: {every} to "
            f"{os.path.join(args.output_dir, 'checkpoints', 'step_<step>')}, {size}, {kept}; {export}")


def banner_lines(*, plan, fl, layout, origin: dict, model_name: str, model_type: str, n_params: int, vocab: int,
                 vocab_note: str, flops_per_token: float, policy: dict, activation_checkpointing: bool,
                 compiled: bool, peak_mb: float, tokens_per_rank_step: int, tokens_per_step: int,
                 data_line: str, tokenizer=None, param_bytes: int = 4) -> list[str]:
    """The banner, one string per line (without the ``[fl_accel]`` prefix). ``tokenizer``:
    the run's (a line says what it is and, when trained on the run's text, where it is
    cached); ``param_bytes``: bytes per stored parameter (for the checkpoint sizes). ``fl``,
    ``layout``: the accelerator's (its ``run_config``)."""
    args = plan.args
    streaming_fl = fl.is_federated and (fl.num_fragments > 1 or fl.sync_delay or fl.fragment_update_alpha
                                        or fl.sync_dtype != "fp32")
    layout_line = f"{layout.describe(fl.sync_every)}, outer={fl.outer_optimizer if fl.is_federated else '-'}"
    if streaming_fl:
        layout_line += (f", fragments P={fl.num_fragments} sync delay={fl.sync_delay} alpha={fl.fragment_update_alpha}"
                        f"{' (delayed local steps kept)' if fl.sync_delay and fl.delayed_local_steps == 'keep' else ''}"
                        f" exchange={fl.sync_dtype}{' +error feedback' if fl.error_feedback else ''}")
        if fl.sync_dtype == "sparse":
            layout_line += f" ({sparse_text(fl)})"
    if fl.is_federated and fl.sync_warmup_steps:
        layout_line += f", synchronous warm-up of {fl.sync_warmup_steps} steps (gradients averaged across groups)"
    if layout.num_groups > 1:
        layout_line += f", group weights {weights_text(layout.weights(fl.group_weighting))} ({fl.group_weighting})"
    sources = plan.sources
    return [
        f"fl_accel {origin['version']} from {origin['path']}",
        layout_line,
        f"  ({LETTERS})",
        fl_line(plan.parsed, fl),
        f"model {model_name} ({model_type}): {n_params / 1e6:.2f}M params, vocab {vocab}"
        + (f" ({vocab_note})" if vocab_note else "")
        + f", seq_len {args.seq_len}, {flops_per_token / 1e6:,.1f} MFLOP/token, init on {args.init_device} "
          f"(peak host memory {peak_mb:.0f} MiB per rank after prepare)",
        f"precision: {precision_text(policy, plan.mixed_precision)}; activation checkpointing "
        f"{'full' if activation_checkpointing else 'none'} ({sources['activation_checkpointing']}); compile "
        f"{'regional' if compiled else 'off'} ({sources['compile']})",
        f"micro-batch {args.micro_batch_size} blocks/rank x accumulation {args.gradient_accumulation_steps} = "
        f"{tokens_per_rank_step} tokens/rank/step; {tokens_per_step} tokens/step in total (global batch "
        f"{tokens_per_step // args.seq_len} blocks)",
        data_line,
        *([tokenizer_line(args, tokenizer)] if tokenizer is not None else []),
        storage_line(args, fl, layout.num_groups, n_params, param_bytes),
    ]
