"""The peers suite (issue 46 item 5): fl_accel beside torchft's DiLoCo / Streaming DiLoCo and
Accelerate's LocalSGD, on emulated slow links, in one sitting, interleaved.

Every row trains the recipe's ``tiny`` Llama on its tokenized Shakespeare blocks with its AdamW
and LR schedule, 2 emulated nodes x 2 processes (``scripts/netemu.py``), one federation group
(torchft: one replica group) per node, H, the outer optimizer and the fragments as the row says
(:data:`ROWS`, one line each):

* **fl_accel**: ``recipes/pretrain.py`` (one torchrun world over both nodes, ``--init_device cpu``
  so that its weights are the peers' to the bit);
* **torchft** 0.2: ``bench/peers_workers/torchft_diloco.py`` as a torchft user writes it: a
  Lighthouse on node 0, one torchrun per replica group, a ``Manager`` per rank, FSDP2 inside the
  group, ``torchft.local_sgd.DiLoCo`` (Streaming DiLoCo with fragments and a delay);
* **accelerate**: ``bench/peers_workers/accelerate_localsgd.py``, Accelerate's ``LocalSGD``, which
  refuses FSDP (``NotImplementedError`` for any distributed type but DDP's), so it runs DDP: every
  rank a whole replica, the parameters averaged over the world every H steps.

With the same data order, initial weights, optimizer and schedule, fl_accel blocking fp32 and
torchft's DiLoCo compute the same model (their eval losses agree to the printed digits; the
table's "agreement" column shows the difference): a row differs from its peer in how the
exchange runs, not in what is trained.

**Sitting.** For every link (one emulator each, ``--links``) the rows run ``--reps`` times,
interleaved: rep 1 of every row in :data:`ROWS` order, then rep 2, ... (ABCABC...). Each launch
is metered: the load average (``/proc/loadavg``) at its start and end, the CPU other processes
used meanwhile (:class:`recipes.host_load.HostLoad`), and the bytes each node's veth sent and
received (``/sys/class/net/<veth>/statistics/{tx,rx}_bytes`` read inside the node namespaces
before and after). Figures per row are medians over the repetitions with their ranges
(:mod:`bench.peers_report`).

**Resumable.** Each launch keeps its raw record in ``bench/work/<name>/<link>/<row>/rep<k>/``
(the worker's or recipe's files, ``launch.log``, and the bench's ``record.json``). Rerunning the
same command skips finished launches and reruns the others; ``--report-only`` rebuilds the
results from the work folder, else from the committed ``bench/results/<name>/`` (``peers.json``
and ``curves.csv``). Results: ``table.md`` (with the command), ``peers.json``, ``curves.csv``,
``loss_vs_seconds.png``, ``command.txt``. Needs root (network namespaces and tc)::

    sudo python -m bench.peers --name <date>-peers              # the sitting: 10 and 100 Mbit/s, 3 reps
    sudo python -m bench.peers --smoke                          # every row once at 100 Mbit/s, 32 steps
    python -m bench.peers --dry-run                             # the launch order and every command
    python -m bench.peers --name <date>-peers --report-only     # rebuild the results (no root)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

from bench import plan as bp
from bench.launch import SITTINGS, DryEmulator, _read_json, _write_json, measure_link
from bench.launch import save_sitting as _save_sitting
from recipes.host_load import HostLoad
from scripts import launch as sl
from scripts import netemu
from scripts.ft_launch import lighthouse_argv

WORKERS = os.path.join(bp.REPO, "bench", "peers_workers")
TOOLS = {"fl_accel": "fl_accel", "torchft": "torchft", "accelerate": "Accelerate"}
NODES, NPROC = 2, 2
"""2 emulated nodes x 2 processes: one federation group (torchft: replica group) of 2 per node."""
LIGHTHOUSE = {"min_replicas": NODES, "quorum_tick_ms": 100, "join_timeout_ms": 2000, "heartbeat_timeout_ms": 60000}
"""The Lighthouse's options: every quorum waits for both groups (a benchmark without faults: no
group trains alone while the other starts); a heartbeat missed for 60 s (torchft's default), not
3 s, so that heartbeats queued behind a sync on a 10 Mbit/s link do not drop a group."""
FULL = dict(steps=64, eval_every=8, reps=3, links="10mbit,100mbit", eval_blocks=64)
SMOKE = dict(steps=32, eval_every=8, reps=1, links="100mbit", eval_blocks=32)
RECORD = "record.json"


class PeersError(RuntimeError):
    """A bad option, an inconsistent plan or a failed launch (the message says which)."""


@dataclass(frozen=True)
class PeerRow:
    """One configuration of the suite (a line of :data:`ROWS`)."""

    id: str
    tool: str
    """"fl_accel", "torchft" or "accelerate" (:data:`TOOLS`)."""
    sync_every: int
    """H: inner optimizer steps per round (with P fragments, one fragment syncs every H/P steps)."""
    num_fragments: int = 1
    sync_delay: int = 0
    """tau: steps between launching a fragment's exchange and applying it (torchft: fragment_sync_delay)."""
    sync_dtype: str = "fp32"
    error_feedback: bool = False
    sync_collectives: str = "all_to_all"
    """"bf16"/"int8" fl_accel rows: ``--sync_collectives`` (:attr:`bench.plan.RunSpec.sync_collectives`)."""
    outer_optimizer: str = "nesterov"
    """"nesterov": SGD(lr=outer_lr, momentum=outer_momentum, nesterov=True) on the pseudo-gradient
    (DiLoCo); "avg": the plain average."""
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    fragment_update_alpha: float = 0.0
    extra_flags: tuple[str, ...] = ()
    """More recipe flags of an fl_accel row (FLConfig fields), e.g. a future overlap mode's."""

    @property
    def label(self) -> str:
        """e.g. ``torchft Streaming DiLoCo H=8 P=2 tau=2 fp32 nesterov(0.7, 0.9)``."""
        name = {"fl_accel": "fl_accel", "torchft": "torchft " + ("Streaming DiLoCo" if self.num_fragments > 1
                                                                   else "DiLoCo"),
                "accelerate": "Accelerate LocalSGD (DDP)"}[self.tool]
        if self.is_limit:
            return f"{name} no sync (the limit: H = 10^6, one full sync at the end)"
        text = f"{name} H={self.sync_every}"
        if self.num_fragments > 1 or self.sync_delay:
            text += f" P={self.num_fragments} tau={self.sync_delay}"
        text += f" {self.sync_dtype}" + ("+EF" if self.error_feedback else "")
        text += " all-gather" if self.sync_collectives == "all_gather" and self.sync_dtype in ("bf16", "int8") else ""
        text += f" {self.outer_optimizer}({self.outer_lr:g}, {self.outer_momentum:g})" \
            if self.outer_optimizer == "nesterov" else " avg"
        if self.fragment_update_alpha:
            text += f" alpha={self.fragment_update_alpha:g}"
        if self.extra_flags:
            text += " " + " ".join(f.lstrip("-") for f in self.extra_flags)
        return text

    is_limit = property(lambda self: self.sync_every >= bp.LIMIT_SYNC_EVERY,
                        doc="The no-sync limit row (fl_accel, H = 10^6): the tokens/s no exchange setting can beat.")

    def check(self) -> None:
        """PeersError naming the row: what its tool cannot run."""
        if self.tool not in TOOLS:
            raise PeersError(f"row {self.id}: tool must be one of {sorted(TOOLS)}, got {self.tool!r}")
        if self.sync_every < 1 or self.num_fragments < 1 or self.sync_every % self.num_fragments:
            raise PeersError(f"row {self.id}: H={self.sync_every} must be a positive multiple of "
                             f"P={self.num_fragments}")
        if self.tool != "fl_accel" and not 0 <= self.sync_delay < self.sync_every // self.num_fragments:
            raise PeersError(f"row {self.id}: tau={self.sync_delay} must be in [0, H/P) (torchft's rule)")
        if self.is_limit and (self.tool != "fl_accel" or self.num_fragments > 1 or self.sync_delay):
            raise PeersError(f"row {self.id}: the no-sync limit is an fl_accel row with P=1, tau=0")
        if self.tool == "fl_accel" and not 0 <= self.sync_delay <= self.sync_every:
            raise PeersError(f"row {self.id}: tau={self.sync_delay} must be in [0, H] (fl_accel's rule)")
        if self.outer_optimizer not in ("nesterov", "avg"):
            raise PeersError(f"row {self.id}: outer_optimizer must be nesterov or avg")
        if self.tool != "fl_accel" and (self.sync_dtype != "fp32" or self.error_feedback or self.extra_flags):
            raise PeersError(f"row {self.id}: {self.tool} rows exchange fp32 (torchft's quantization is CUDA-only) "
                             f"and take no recipe flags")
        if self.tool == "accelerate" and (self.num_fragments > 1 or self.sync_delay or self.outer_optimizer != "avg"):
            raise PeersError(f"row {self.id}: Accelerate's LocalSGD averages the whole model (P=1, tau=0, avg)")


ROWS: tuple[PeerRow, ...] = (
    PeerRow("torchft-h8", "torchft", 8),
    PeerRow("fl_accel-h8", "fl_accel", 8),
    PeerRow("torchft-h8-p2-tau2", "torchft", 8, num_fragments=2, sync_delay=2),
    PeerRow("fl_accel-h8-p2-tau2", "fl_accel", 8, num_fragments=2, sync_delay=2),
    PeerRow("torchft-h16-p2-tau2", "torchft", 16, num_fragments=2, sync_delay=2),
    # fl_accel at its best today (issue 40's fast row: the grid's outer step for it, the plain average)
    PeerRow("fl_accel-h16-p2-tau2-int8-ef", "fl_accel", 16, num_fragments=2, sync_delay=2, sync_dtype="int8",
            error_feedback=True, outer_optimizer="avg"),
    # issue 46 item 2: the same exchange hidden behind a whole round (tau = H), the local steps kept
    PeerRow("fl_accel-h16-p2-tau16-keep-int8-ef", "fl_accel", 16, num_fragments=2, sync_delay=16, sync_dtype="int8",
            error_feedback=True, outer_optimizer="avg", extra_flags=("--delayed_local_steps", "keep")),
    # the fast row with its delay's local steps kept instead of overwritten (the ablation put its quality cost
    # on the discard rule): the same bytes and overlap as fl_accel-h16-p2-tau2-int8-ef
    PeerRow("fl_accel-h16-p2-tau2-keep-int8-ef", "fl_accel", 16, num_fragments=2, sync_delay=2, sync_dtype="int8",
            error_feedback=True, outer_optimizer="avg", extra_flags=("--delayed_local_steps", "keep")),
    # the same with the exchange behind 4 of a fragment's 8 steps: at 10 Mbit/s one fragment's int8 exchange
    # (about 1.5 MB on the link) outlasts 2 steps of this CPU's compute
    PeerRow("fl_accel-h16-p2-tau4-keep-int8-ef", "fl_accel", 16, num_fragments=2, sync_delay=4, sync_dtype="int8",
            error_feedback=True, outer_optimizer="avg", extra_flags=("--delayed_local_steps", "keep")),
    # half the exchanges per step. The first sitting of 2026-12-06 kept tau 2 and 4 at 0.86 and 0.88 of the no-sync
    # limit; its cause was not the codec's CPU time but the all-gather's launch one step after the all-to-all's, whatever
    # tau (the exposed wait was the same at tau 2 and 4); the schedule now launches it halfway through the window
    PeerRow("fl_accel-h32-p2-tau2-keep-int8-ef", "fl_accel", 32, num_fragments=2, sync_delay=2, sync_dtype="int8",
            error_feedback=True, outer_optimizer="avg", extra_flags=("--delayed_local_steps", "keep")),
    # the keep row at tau 2 (the grid's quality within noise of blocking fp32) with one all-gather of every group's int8
    # payload: at F = 2 the same bytes as the all-to-all + all-gather, and the whole 2-step window for one collective
    PeerRow("fl_accel-h16-p2-tau2-keep-int8-gather-ef", "fl_accel", 16, num_fragments=2, sync_delay=2,
            sync_dtype="int8", error_feedback=True, sync_collectives="all_gather", outer_optimizer="avg",
            extra_flags=("--delayed_local_steps", "keep")),
    PeerRow("accelerate-localsgd-h8", "accelerate", 8, outer_optimizer="avg"),
    # the no-sync limit of the same layout (bench.plan.LIMIT_SYNC_EVERY; issue 46's share of the limit)
    PeerRow("fl_accel-limit", "fl_accel", bp.LIMIT_SYNC_EVERY, outer_optimizer="avg"),
)
"""The rows, in launch order within a repetition. Peers first, each fl_accel row after the peer
it is compared with; a new fl_accel setting (e.g. an overlap mode's ``--sync_delay`` up to H) is
one more line, and one more :data:`COMPARISONS` entry."""
COMPARISONS: tuple[tuple[str, str, str], ...] = (
    ("fl_accel-h8", "torchft-h8", "equal settings: blocking fp32 DiLoCo"),
    ("fl_accel-h8-p2-tau2", "torchft-h8-p2-tau2", "equal settings: Streaming DiLoCo, 2 fragments, delay 2, fp32"),
    ("fl_accel-h16-p2-tau2-int8-ef", "torchft-h8-p2-tau2", "fl_accel at its best vs torchft's Streaming DiLoCo"),
    ("fl_accel-h16-p2-tau2-int8-ef", "torchft-h16-p2-tau2", "fl_accel at its best vs torchft's at the same H"),
    ("fl_accel-h16-p2-tau16-keep-int8-ef", "torchft-h16-p2-tau2",
     "fl_accel overlapped (tau = H, local steps kept) vs torchft's Streaming DiLoCo at the same H"),
    ("fl_accel-h16-p2-tau2-keep-int8-ef", "torchft-h16-p2-tau2",
     "fl_accel's fast row with the local steps kept vs torchft's Streaming DiLoCo at the same H"),
    ("fl_accel-h16-p2-tau4-keep-int8-ef", "torchft-h16-p2-tau2",
     "fl_accel, the exchange behind 4 steps, local steps kept, vs torchft's Streaming DiLoCo at the same H"),
    ("fl_accel-h32-p2-tau2-keep-int8-ef", "torchft-h16-p2-tau2",
     "fl_accel at H=32, local steps kept, vs torchft's Streaming DiLoCo at H=16"),
    ("fl_accel-h16-p2-tau2-keep-int8-gather-ef", "torchft-h16-p2-tau2",
     "fl_accel's fast row, local steps kept, one int8 all-gather, vs torchft's Streaming DiLoCo at the same H"),
    ("fl_accel-h8", "accelerate-localsgd-h8", "blocking fp32 vs Accelerate's LocalSGD (DDP, avg)"),
)
"""``(row, peer row, what)``: the ratios the table gives (tokens/s, bytes, time to the peer's target)."""


@dataclass(frozen=True)
class Launch:
    """One run of one row at one link (its repetition ``rep``, from 1)."""

    link: str
    row: str
    rep: int

    @property
    def key(self) -> str:
        return f"{self.link}/{self.row}/rep{self.rep}"


def rows_by_id(plan: dict) -> dict[str, PeerRow]:
    """The plan's rows (saved in plan.json), by id."""
    return {r["id"]: PeerRow(**{**r, "extra_flags": tuple(r.get("extra_flags", ()))}) for r in plan["rows"]}


def launch_order(plan: dict) -> list[Launch]:
    """Every launch in the order of the sitting: link by link; within a link repetition by
    repetition, each repetition every row in order (ABC ABC ABC: interleaved, so that a slow
    spell of the shared machine falls on every row alike)."""
    ids = [r["id"] for r in plan["rows"]]
    return [Launch(link, row, rep) for link in plan["links"] for rep in range(1, plan["reps"] + 1) for row in ids]


# ---------------------------------------------------------------------- plan
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Rows: " + "; ".join(f"{r.id} = {r.label}" for r in ROWS))
    p.add_argument("--name", default=None, help="results/work folder name (default: <today>-peers; smoke: smoke-peers)")
    p.add_argument("--links", default=None, help=f"tc rates, comma-separated (default {FULL['links']}; smoke "
                   f"{SMOKE['links']})")
    p.add_argument("--reps", type=int, default=None, help=f"repetitions per row and link (default {FULL['reps']}; "
                   "medians need at least 3)")
    p.add_argument("--rows", default=None, help="row ids, comma-separated (default: every row of bench.peers.ROWS)")
    p.add_argument("--steps", type=int, default=None, help=f"optimizer steps per launch (default {FULL['steps']}; "
                   f"smoke {SMOKE['steps']}); a multiple of every row's H")
    p.add_argument("--eval-every", dest="eval_every", type=int, default=None,
                   help="steps between evaluations (8); a row evaluates at multiples of its H, as the recipe does")
    p.add_argument("--eval-blocks", dest="eval_blocks", type=int, default=None,
                   help=f"validation blocks per evaluation ({FULL['eval_blocks']})")
    p.add_argument("--learning-rate", dest="learning_rate", type=float, default=None,
                   help="AdamW peak LR of every row (default: the recipe's, 3e-4)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--smoke", action="store_true", help=f"every row once at {SMOKE['links']}, {SMOKE['steps']} steps")
    p.add_argument("--dry-run", dest="dry_run", action="store_true",
                   help="print the launches and commands, run nothing")
    p.add_argument("--report-only", dest="report_only", action="store_true",
                   help="run nothing; rebuild the results from bench/work/<name>, else from bench/results/<name>")
    p.add_argument("--run-timeout", dest="run_timeout", type=float, default=None,
                   help="seconds before a launch is killed (default 600 + 30 per step)")
    p.add_argument("--work-root", dest="work_root", default=os.path.join(bp.REPO, "bench", "work"))
    p.add_argument("--results-root", dest="results_root", default=os.path.join(bp.REPO, "bench", "results"))
    p.add_argument("--cache-dir", dest="cache_dir", default=None, help="corpus cache (default bench/work/cache)")
    return p


def make_plan(args) -> dict:
    """The plan (saved as the work folder's plan.json) from the parsed arguments.

    Raises:
        PeersError: naming the bad option: an unknown row, a link tc cannot parse, steps not a
            multiple of every row's H, a value < 1, too few evaluation blocks, a bad name.
    """
    from recipes.args import RecipeArguments

    base = SMOKE if args.smoke else FULL
    s = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in base.items()}
    links = [x.strip() for x in str(s["links"]).split(",") if x.strip()]
    if not links:
        raise PeersError("--links is empty")
    for link in links:
        try:
            netemu.parse_rate(link)
        except ValueError as exc:
            raise PeersError(f"--links: {exc}") from None
        if not re.fullmatch(r"[A-Za-z0-9.]+", link):
            raise PeersError(f"--links: {link!r} must be like 100mbit")
    by_id = {r.id: r for r in ROWS}
    ids = [x.strip() for x in args.rows.split(",") if x.strip()] if args.rows else list(by_id)
    unknown = [i for i in ids if i not in by_id]
    if unknown or not ids:
        raise PeersError(f"--rows: unknown row(s) {unknown or ids}; the rows are {list(by_id)}")
    rows = [by_id[i] for i in dict.fromkeys(ids)]
    for row in rows:
        row.check()
    for key in ("steps", "eval_every", "reps", "eval_blocks"):
        if s[key] < 1:
            raise PeersError(f"--{key.replace('_', '-')} must be >= 1, got {s[key]}")
    bad = sorted({r.sync_every for r in rows if s["steps"] % r.sync_every and not r.is_limit})
    if bad:
        raise PeersError(f"--steps {s['steps']} must be a multiple of every row's H ({bad}): each run then ends on a "
                         f"sync and every row is evaluated at the same token counts")
    micro_batch, seq_len = 4, 256
    if s["eval_blocks"] < NODES * NPROC * micro_batch:
        raise PeersError(f"--eval-blocks must be >= {NODES * NPROC * micro_batch} (one micro-batch per rank)")
    lr = args.learning_rate if args.learning_rate is not None else \
        RecipeArguments.__dataclass_fields__["learning_rate"].default
    if not lr > 0:
        raise PeersError(f"--learning-rate must be > 0, got {lr}")
    name = args.name or ("smoke-peers" if args.smoke else f"{datetime.date.today().isoformat()}-peers")
    if not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        raise PeersError(f"--name {name!r}: use letters, digits, '.', '_', '-'")
    return dict(
        name=name, links=links, reps=s["reps"], steps=s["steps"], eval_every=s["eval_every"],
        eval_blocks=s["eval_blocks"], learning_rate=lr, seed=args.seed, micro_batch_size=micro_batch,
        seq_len=seq_len, nodes=NODES, nproc_per_node=NPROC, smoke=bool(args.smoke), lighthouse=dict(LIGHTHOUSE),
        rows=[dataclasses.asdict(r) for r in rows], comparisons=[list(c) for c in COMPARISONS
                                                                   if c[0] in ids and c[1] in ids],
        run_timeout=args.run_timeout or 600.0 + 30.0 * s["steps"],
        work=os.path.join(os.path.abspath(args.work_root), name),
        results=os.path.join(os.path.abspath(args.results_root), name),
        cache_dir=os.path.abspath(args.cache_dir or os.path.join(args.work_root, "cache")),
        command=" ".join(shlex.quote(a) for a in ["python", "-m", "bench.peers"] + _argv_of(args)))


def _argv_of(args) -> list[str]:
    return list(getattr(args, "_argv", sys.argv[1:]))


SAME_SITTING = ("links", "reps", "steps", "eval_every", "eval_blocks", "learning_rate", "seed", "rows")
"""What a continued sitting must share with the saved plan (else its launches would not compare)."""


def check_resumable(plan: dict) -> dict | None:
    """The work folder's saved plan, or None for a new one.

    Raises:
        PeersError: the saved plan differs from this one in :data:`SAME_SITTING` (give another --name).
    """
    saved = _read_json(os.path.join(plan["work"], "plan.json"), None)
    if saved is None:
        return None
    differs = [k for k in SAME_SITTING if saved.get(k) != json.loads(json.dumps(plan.get(k)))]
    if differs:
        raise PeersError(f"{plan['work']} holds a sitting with other settings ({', '.join(differs)}): continue it with "
                         f"its own command (`sudo {saved.get('command')}`) or give another --name")
    return saved


# ---------------------------------------------------------------------- commands
def common_flags(plan: dict, row: PeerRow, out_dir: str) -> list[str]:
    """The flags every peer worker takes (:mod:`bench.peers_workers.common`)."""
    return ["--seed", str(plan["seed"]), "--seq_len", str(plan["seq_len"]), "--micro_batch_size",
            str(plan["micro_batch_size"]), "--max_steps", str(plan["steps"]), "--learning_rate",
            f"{plan['learning_rate']:g}", "--sync_every", str(row.sync_every), "--outer_optimizer",
            row.outer_optimizer, "--outer_lr", f"{row.outer_lr:g}", "--outer_momentum", f"{row.outer_momentum:g}",
            "--eval_every", str(plan["eval_every"]), "--max_eval_blocks", str(plan["eval_blocks"]), "--log_every",
            str(plan["eval_every"]),
            "--cache_dir", plan["cache_dir"], "--output_dir", out_dir]


def fl_accel_args(plan: dict, row: PeerRow, out_dir: str, link: str) -> list[str]:
    """The recipe's command line (script first) of an fl_accel row: :func:`bench.plan.recipe_args`
    with FL+FSDP F=2 x G=2, the row's federation flags, ``--init_device cpu`` (the peers' weights)
    and the suite's learning rate."""
    spec = bp.RunSpec(
        id=row.id, phase="peers", suite="peers", link=link, algorithm="fl_fsdp", nproc_per_node=NPROC,
        num_groups=NODES, shard_size=NPROC, sync_every=row.sync_every, steps=plan["steps"],
        eval_every=plan["eval_every"], report_to="none", num_fragments=row.num_fragments, sync_delay=row.sync_delay,
        sync_dtype=row.sync_dtype, error_feedback=row.error_feedback, sync_collectives=row.sync_collectives,
        outer_optimizer=row.outer_optimizer,
        outer_lr=row.outer_lr if row.outer_optimizer != "avg" else None,
        outer_momentum=row.outer_momentum if row.outer_optimizer != "avg" else None,
        extra_flags=("--init_device", "cpu", "--learning_rate", f"{plan['learning_rate']:g}",
                     *(("--fragment_update_alpha", f"{row.fragment_update_alpha:g}")
                       if row.fragment_update_alpha else ()), *row.extra_flags))
    recipe_plan = {"seq_len": plan["seq_len"], "micro_batch_size": plan["micro_batch_size"], "seed": plan["seed"],
                   "eval_blocks": plan["eval_blocks"], "cache_dir": plan["cache_dir"], "name": plan["name"],
                   "log_every": plan["eval_every"]}
    return bp.recipe_args(recipe_plan, spec, out_dir)


def torchft_args(plan: dict, row: PeerRow, out_dir: str, group: int, hostname: str) -> list[str]:
    """The torchft worker's command line (script first) of replica group ``group``."""
    group_dir = os.path.join(out_dir, f"group{group}")
    return [os.path.join(WORKERS, "torchft_diloco.py"), *common_flags(plan, row, group_dir),
            "--replica_group", str(group), "--num_replica_groups", str(NODES), "--hostname", hostname,
            "--num_fragments", str(row.num_fragments), "--sync_delay", str(row.sync_delay),
            "--fragment_update_alpha", f"{row.fragment_update_alpha:g}"]


def localsgd_args(plan: dict, row: PeerRow, out_dir: str) -> list[str]:
    """The LocalSGD worker's command line (script first)."""
    return [os.path.join(WORKERS, "accelerate_localsgd.py"), *common_flags(plan, row, out_dir)]


def commands(plan: dict, row: PeerRow, out_dir: str, emu, port: int, link: str) -> dict[str, list[str]]:
    """What one launch starts, by name (``lighthouse``, ``node0``, ``node1``): one torchrun per
    node (fl_accel and Accelerate: one world over both nodes, static rendezvous on node 0;
    torchft: one world per replica group on its own node) and torchft's Lighthouse."""
    if row.tool == "torchft":
        lh_port = port + 1
        out = {"lighthouse": lighthouse_argv(lh_port, emu.address(0), **plan["lighthouse"])}
        for k in range(NODES):
            out[f"node{k}"] = sl.torchrun_argv(NPROC, *torchft_args(plan, row, out_dir, k, emu.address(k)), port=port,
                                               master_addr=emu.address(k))
        return out
    args = fl_accel_args(plan, row, out_dir, link) if row.tool == "fl_accel" else localsgd_args(plan, row, out_dir)
    return {f"node{k}": sl.torchrun_argv(NPROC, *args, port=port, master_addr=emu.address(0), nnodes=NODES,
                                         node_rank=k) for k in range(NODES)}


# ---------------------------------------------------------------------- running
def veth_bytes(emu) -> dict[str, dict[str, int]]:
    """``{node: {"tx_bytes", "rx_bytes"}}``: each node's veth counters, read from
    ``/sys/class/net/<veth>/statistics/`` inside its namespace (everything on the wire: payload,
    headers, rendezvous, store, Lighthouse and evaluation traffic).

    Raises:
        netemu.NetEmuError: a read failed.
    """
    out = {}
    for k in range(emu.nodes):
        stats = f"/sys/class/net/{emu.ifname(k)}/statistics"
        proc = subprocess.run(["ip", "netns", "exec", emu.namespace(k), "cat", f"{stats}/tx_bytes",
                               f"{stats}/rx_bytes"], capture_output=True, text=True, timeout=30)
        values = proc.stdout.split()
        if proc.returncode != 0 or len(values) != 2:
            raise netemu.NetEmuError(f"reading {stats} in {emu.namespace(k)} failed: {proc.stderr.strip()}")
        out[str(k)] = {"tx_bytes": int(values[0]), "rx_bytes": int(values[1])}
    return out


_PROBE = r"""
import socket, sys, time
host, port, limit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
end = time.monotonic() + limit
while True:
    try:
        socket.create_connection((host, port), timeout=1).close(); break
    except OSError:
        if time.monotonic() > end:
            sys.exit(1)
        time.sleep(0.2)
"""


def wait_listening(emu, node: int, host: str, port: int, limit: float = 120.0) -> bool:
    """Whether ``host:port`` accepts a connection from inside ``node`` within ``limit`` seconds."""
    proc = emu.popen(node, [sys.executable, "-c", _PROBE, host, str(port), str(limit)])
    try:
        return proc.wait(timeout=limit + 30) == 0
    except subprocess.TimeoutExpired:
        return False
    finally:
        sl.terminate(proc)


def wait_all(procs: list, timeout: float, grace: float = 30.0) -> int:
    """Wait for every process: 0 when all exit 0; 124 on timeout (all killed); else the largest
    exit code of those that ended by themselves (the others get ``grace`` seconds, then are killed:
    they wait on a failed peer)."""
    start, failed_at = time.monotonic(), None
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = now
            if now - start > timeout:
                return 124
            if failed_at is not None and now - failed_at > grace:
                break
            time.sleep(0.2)
        own = [sl.exit_code(p.returncode) for p in procs if p.poll() is not None]
        return max(own, default=0) if any(own) else 0
    finally:
        for p in procs:
            sl.terminate(p)


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _now() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")


def finished(plan: dict, launch: Launch) -> bool:
    rec = _read_json(os.path.join(plan["work"], launch.key, RECORD), None)
    return bool(rec and rec.get("ok"))


def run_launch(plan: dict, emu, launch: Launch, port: int, sitting: str) -> dict:
    """Run one launch inside ``emu`` (its folder emptied first) and write its record.json:
    sitting, start and end, load average at both, the share of the CPUs other processes used,
    exit code, wall seconds, each node's veth bytes before and after. ``ok`` is True when every
    process exited 0 and the run's results exist."""
    row = rows_by_id(plan)[launch.row]
    out_dir = os.path.join(plan["work"], launch.key)
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    cmds = commands(plan, row, out_dir, emu, port, launch.link)
    env = bp.run_env(plan)
    logs, procs = [], []
    record = {"link": launch.link, "row": launch.row, "rep": launch.rep, "tool": row.tool, "sitting": sitting,
              "started": _now(), "loadavg_start": _loadavg(), "commands": {k: shlex.join(v) for k, v in cmds.items()}}
    before = veth_bytes(emu)
    load = HostLoad().start()
    rc = None
    try:
        with open(os.path.join(out_dir, "launch.log"), "w", encoding="utf-8") as log:
            if row.tool == "torchft":
                lh_host, lh_port = emu.address(0), port + 1
                procs.append(emu.popen(0, cmds["lighthouse"], env=env, stdout=log, stderr=subprocess.STDOUT))
                if not wait_listening(emu, 1, lh_host, lh_port):
                    rc = 125
                else:
                    env = {**env, "TORCHFT_LIGHTHOUSE": f"http://{lh_host}:{lh_port}"}
            if rc is None:
                for k in range(NODES):
                    logs.append(open(os.path.join(out_dir, f"node{k}.log"), "w", encoding="utf-8"))
                    procs.append(emu.popen(k, cmds[f"node{k}"], env=env, stdout=logs[-1], stderr=subprocess.STDOUT))
                lighthouse = procs[:1] if row.tool == "torchft" else []
                rc = wait_all(procs[len(lighthouse):], plan["run_timeout"])
    finally:
        for p in procs:
            sl.terminate(p)
        for f in logs:
            f.close()
        load.stop()
    after = veth_bytes(emu)
    record.update(ended=_now(), loadavg_end=_loadavg(), rc=rc, wall_s=load.wall_s, host=load.as_dict(),
                  background_cpu_share=load.background_cpu_share, veth_before=before, veth_after=after,
                  veth={k: {b: after[k][b] - before[k][b] for b in ("tx_bytes", "rx_bytes")} for k in after})
    record["ok"] = rc == 0 and results_exist(out_dir, row)
    _write_json(os.path.join(out_dir, RECORD), record)
    return record


def results_exist(out_dir: str, row: PeerRow) -> bool:
    """The run's all_results.json (torchft: every replica group's) exists."""
    folders = [os.path.join(out_dir, f"group{k}") for k in range(NODES)] if row.tool == "torchft" else [out_dir]
    return all(os.path.isfile(os.path.join(f, "all_results.json")) for f in folders)


def warm_cache(plan: dict) -> None:
    """Fill the corpus and tokenizer cache once, before any launch (workers then only read it).

    Raises:
        PeersError: the preparation failed (its output in the message).
    """
    os.makedirs(plan["cache_dir"], exist_ok=True)
    res = sl.run([sys.executable, "-m", "bench.peers_workers.common", "--cache_dir", plan["cache_dir"], "--seq_len",
                  str(plan["seq_len"]), "--seed", str(plan["seed"])], timeout=1800, env=bp.run_env(plan), cwd=bp.REPO)
    if res.returncode != 0:
        raise PeersError(f"preparing the corpus cache failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
    print(res.stdout.strip().splitlines()[-1] if res.stdout.strip() else "[peers] corpus cache ready", flush=True)


def dry_run(plan: dict) -> None:
    """Print every launch, in order, with its command lines (addresses shown as <nodeK>)."""
    emu = DryEmulator(NODES, None)
    rows = rows_by_id(plan)
    for i, launch in enumerate(launch_order(plan), 1):
        row = rows[launch.row]
        print(f"[peers] {i:3d} {launch.key} [{row.label}]")
        for name, argv in commands(plan, row, os.path.join(plan["work"], launch.key), emu, 29500, launch.link).items():
            print(f"        {name}: {shlex.join(argv)}")


def main(argv: list[str] | None = None) -> int:
    from bench import peers_report

    parser = build_parser()
    args = parser.parse_args(argv)
    args._argv = list(sys.argv[1:] if argv is None else argv)
    try:
        plan = make_plan(args)
    except PeersError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        dry_run(plan)
        return 0
    if args.report_only:
        try:
            out = peers_report.report_only(plan)
        except peers_report.ReportError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"[peers] results: {out}")
        return 0
    try:
        saved = check_resumable(plan)
    except PeersError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    ok, reason = netemu.check_privileges()
    if not ok:
        print(f"error: the launches train across emulated nodes (network namespaces + tc) and {reason}; run as root "
              f"(sudo {sys.executable} -m bench.peers ...)", file=sys.stderr)
        return 1
    for key in [k for k in os.environ if k.startswith("FL_ACCEL_")]:
        del os.environ[key]
    plan = saved or plan
    os.makedirs(plan["work"], exist_ok=True)
    _write_json(os.path.join(plan["work"], "plan.json"), plan)
    order = launch_order(plan)
    todo = [x for x in order if not finished(plan, x)]
    print(f"[peers] {plan['name']}: {len(order)} launches ({len(plan['rows'])} rows x {plan['reps']} reps x "
          f"{len(plan['links'])} links), {len(order) - len(todo)} finished earlier\n[peers] work: {plan['work']}\n"
          f"[peers] to continue after an interruption: sudo {plan['command']}", flush=True)
    try:
        warm_cache(plan)
    except PeersError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    sitting = _now()
    _save_sitting(plan, sitting, started=sitting, command=plan["command"], loadavg_start=_loadavg(), links={})
    failed, port = [], 29500
    netemu._install_signal_handlers()  # SIGTERM/SIGHUP unwind the emulator: no namespace or rank left behind
    try:
        for link in plan["links"]:
            mine = [x for x in todo if x.link == link]
            if not mine:
                continue
            with netemu.Emulator(NODES, link) as emu:
                measured = measure_link(emu, 2.0)
                _save_sitting(plan, sitting, links={**_read_json(os.path.join(plan["work"], SITTINGS), {})
                                                    .get(sitting, {}).get("links", {}), link: measured})
                for x in mine:
                    port += 10
                    n = order.index(x) + 1
                    print(f"[peers] {n}/{len(order)} {x.key} [{rows_by_id(plan)[x.row].label}]", flush=True)
                    rec = run_launch(plan, emu, x, port, sitting)
                    mb = sum(v["tx_bytes"] for v in rec["veth"].values()) / 1e6
                    bg = rec.get("background_cpu_share")
                    print(f"[peers] {x.key}: {'ok' if rec['ok'] else 'FAILED (exit ' + str(rec['rc']) + ')'} after "
                          f"{rec['wall_s']:.0f} s, {mb:.1f} MB over the link, load avg {rec['loadavg_start']} -> "
                          f"{rec['loadavg_end']}" + (f", other processes {100 * bg:.0f}% of the CPUs" if bg is not None
                                                     else ""), flush=True)
                    if not rec["ok"]:
                        failed.append(f"{x.key}: exit {rec['rc']}; logs in {os.path.join(plan['work'], x.key)}")
                peers_report.report(plan)
    except KeyboardInterrupt:
        _save_sitting(plan, sitting, ended=_now(), loadavg_end=_loadavg(), interrupted=True)
        peers_report.report(plan)
        print(f"[peers] interrupted; the emulator is down. Continue with: sudo {plan['command']}", file=sys.stderr)
        return 130
    _save_sitting(plan, sitting, ended=_now(), loadavg_end=_loadavg())
    out = peers_report.report(plan)
    print(f"[peers] results: {out}", flush=True)
    for f in failed:
        print(f"error: {f}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
