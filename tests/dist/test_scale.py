"""The recipe at the paper's scale, proven on 4 CPU gloo processes (2 federation groups x 2 shards).

What is checked, and by which launch (launches are shared by the tests; about 100 s in all
on 2 cores):

* ``tests/workers/scale_worker.py init`` (FLAccelerator with the recipe's presets and
  builders): meta-device init vs CPU init, bitwise-equal groups after ``materialize``,
  the error when a user seeds per rank, tied embeddings through prepare/materialize/sync,
  "nesterov" (outer lr 1, momentum 0) vs "avg", and a mid-round checkpoint at step 3;
  ``... resume``: the tied run resumed from it in fresh processes.
* ``recipes/pretrain.py --streaming`` over 5 local jsonl shards of 3/10/1/7/4 documents
  of uneven length (FL+FSDP, H=2, 6 steps, ``--eval_groups``, a checkpoint every step),
  and a second launch resumed from its step_3 (mid-round and mid-epoch). The recipe's
  ``FL_ACCEL_TEST_RECORD_BLOCKS`` hook records the token ids of every block each rank trained on;
  every word of document d is tagged ``k<d>x<j>``, so the decoded blocks name the
  documents a rank read.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from _launch import REPO_ROOT, WORKERS, run_torchrun
from recipes.run_folder import read_metrics

WORKER = WORKERS / "scale_worker.py"
RECIPE = REPO_ROOT / "recipes" / "pretrain.py"
F = 2                       # federation groups in every launch here
SHARD_DOCS = (3, 10, 1, 7, 4)
WORDS = ("the", "king", "queen", "sword", "crown", "night", "love", "death", "honour", "storm")
STEPS, SEQ_LEN, MICRO_BATCH, MAX_EVAL_BLOCKS, RESUME_STEP = 6, 32, 2, 16, 3


# ============================================================================ worker launches
def load(out: Path, name: str) -> list[dict]:
    return [torch.load(out / f"{name}-rank{r}.pt", weights_only=False) for r in range(4)]


@pytest.fixture(scope="module")
def worker_init(tmp_path_factory):
    out = tmp_path_factory.mktemp("scale_worker")
    result = run_torchrun(4, WORKER, "init", str(out), timeout=300)
    assert result.returncode == 0, result.tail()
    return out


@pytest.fixture(scope="module")
def worker_resume(worker_init):
    result = run_torchrun(4, WORKER, "resume", str(worker_init), timeout=300)
    assert result.returncode == 0, result.tail()
    return worker_init


def test_meta_init_matches_cpu_init_in_distribution(worker_init):
    """"tiny" built on meta and materialized shard by shard has the distribution of the CPU
    init: every weight matrix has mean within 10% of initializer_range (0.02) of 0 and std
    within 10% of it, on both paths, and the two paths' std agree within 10% of it; every
    RMSNorm weight is exactly 1 on both paths."""
    recs = load(worker_init, "init-meta")
    rec = recs[0]
    assert rec["was_meta"]
    ir = rec["initializer_range"]
    assert ir == pytest.approx(0.02)
    matrices = norms = 0
    for name, (mean, std) in rec["meta_stats"].items():
        cpu_mean, cpu_std = rec["cpu_stats"][name]
        if "norm" in name:
            assert (mean, std) == (1.0, 0.0) and (cpu_mean, cpu_std) == (1.0, 0.0), (name, mean, std, cpu_mean, cpu_std)
            norms += 1
            continue
        matrices += 1
        for path, (m, s) in (("meta", (mean, std)), ("cpu", (cpu_mean, cpu_std))):
            assert abs(m) <= 0.1 * ir and abs(s - ir) <= 0.1 * ir, (path, name, m, s)
        assert abs(std - cpu_std) <= 0.1 * ir, (name, std, cpu_std)
    # 4 layers x 7 projections + embedding + lm_head; 4 x 2 layer norms + the final norm
    assert (matrices, norms) == (30, 9), (matrices, norms)
    for other in recs[1:]:  # the full tensors are the same on every rank
        assert other["meta_stats"] == rec["meta_stats"]


def test_meta_init_groups_start_bitwise_equal(worker_init):
    """After materialize the two groups hold bitwise-equal shards at each shard coordinate
    (rank r of group 0 and rank r+2 of group 1), and the two shards of a group differ."""
    recs = load(worker_init, "init-meta")
    assert [r["coords"] for r in recs] == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]
    for a, b in ((0, 2), (1, 3)):
        for name, t in recs[a]["shards"].items():
            assert torch.equal(t, recs[b]["shards"][name]), (a, b, name)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert recs[0]["shards"][q].shape == recs[1]["shards"][q].shape
    assert not torch.equal(recs[0]["shards"][q], recs[1]["shards"][q])


def test_per_rank_seed_fails_on_every_rank_naming_the_group(worker_init):
    """torch.manual_seed(rank) before building the model: prepare's check_groups_identical
    raises ValueError on all 4 ranks, naming group 1 and telling the fix (set_seed)."""
    errors = [r["error"] for r in load(worker_init, "init-per_rank_seed")]
    for e in errors:
        assert e and e.startswith("ValueError:"), errors
        assert "group(s) [1]" in e and "set_seed" in e, e


def _mean_of_groups(pre: list, rank: int) -> list[torch.Tensor]:
    """fp32 mean of the pre-sync shards of ``rank``'s coordinate in both groups."""
    return [(a.float() + b.float()) / 2 for a, b in zip(pre[rank % 2], pre[rank % 2 + 2])]


def test_tied_embeddings_through_materialize_and_sync(worker_init):
    """"tiny-tied", F=2, H=2, AdamW, 4 steps: lm_head is the embedding's tensor after
    materialize, after every step and after both syncs (steps 2 and 4); after each sync
    every shard (the shared embedding/lm_head included) is the fp32 mean of the two
    groups' pre-sync shards within 1e-6, and the groups did differ before it."""
    recs = load(worker_init, "init-tied_avg")
    names = recs[0]["names"]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names  # one tensor, listed once
    embed = names.index("model.embed_tokens.weight")
    for rec in recs:
        assert rec["tied_after_materialize"] and all(rec["tied"].values()) and len(rec["tied"]) == 4
        assert rec["sync_steps"] == [2, 4] and rec["tied_after_sync"] == [True, True]
    for k in range(2):
        pre = [rec["pre_sync"][k] for rec in recs]
        assert not torch.equal(pre[0][embed], pre[2][embed])  # the groups diverged in the round
        for r, rec in enumerate(recs):
            for i, (got, want) in enumerate(zip(rec["post_sync"][k], _mean_of_groups(pre, r))):
                assert (got.float() - want).abs().max().item() <= 1e-6, (k, r, names[i])


def test_forward_after_a_pre_sync_evaluation_sees_the_synchronized_model(worker_init):
    """A pre-sync hook that runs a forward (an evaluation, as --eval_groups does) leaves
    FSDP2's root unit (embedding, lm_head, final norm) unsharded; the sync writes only the
    shards. The first forward after the sync must give the same probe loss as after an
    explicit reshard (a fresh all-gather), at both syncs on every rank, and that loss must
    differ from the pre-sync one (the sync changed the model)."""
    for name in ("init-tied_avg", "init-tied_nesterov"):
        for r, rec in enumerate(load(worker_init, name)):
            assert len(rec["probe_after_sync"]) == len(rec["probe_before_sync"]) == 2, (name, r)
            for before, (as_is, fresh) in zip(rec["probe_before_sync"], rec["probe_after_sync"]):
                assert as_is == fresh, (name, r, as_is, fresh)
                assert before != fresh, (name, r, before)


def test_nesterov_with_lr1_momentum0_equals_avg(worker_init):
    """The "nesterov" outer optimizer with outer_lr 1 and outer_momentum 0 computes
    anchor - (anchor - mean) = mean: right after the first sync its shards equal "avg"'s
    within 1e-7 (one fp32 rounding); the losses of all 4 steps and the final shards, after
    AdamW ran on those one-ulp differences, within 1e-5."""
    avg, nest = load(worker_init, "init-tied_avg"), load(worker_init, "init-tied_nesterov")
    for a, n in zip(avg, nest):
        assert n["sync_steps"] == [2, 4] and all(n["tied"].values())
        assert max((x - y).abs().max().item() for x, y in zip(a["post_sync"][0], n["post_sync"][0])) <= 1e-7
        for step in range(1, 5):
            assert abs(a["losses"][step] - n["losses"][step]) <= 1e-5, step
        assert max((x - y).abs().max().item() for x, y in zip(a["final"], n["final"])) <= 1e-5
    # non-vacuous: the groups trained on different data and the sync moved the shards
    assert avg[0]["losses"][4] != avg[2]["losses"][4]
    assert not all(torch.equal(x, y) for x, y in zip(avg[0]["pre_sync"][0], avg[0]["post_sync"][0]))


def test_tied_resume_from_mid_round_checkpoint(worker_resume):
    """Resume the tied run from step_3 (mid-round) in fresh processes: still tied after the
    load, after step 4 and after its sync; the step-4 loss and the final shards equal the
    uninterrupted run's within 1e-6."""
    full, resumed = load(worker_resume, "init-tied_avg"), load(worker_resume, "resume-tied_avg")
    for f, r in zip(full, resumed):
        assert r["tied_after_load"] and r["tied"] == {4: True} and r["tied_after_sync"] == [True]
        assert abs(r["losses"][4] - f["losses"][4]) <= 1e-6
        assert max((x - y).abs().max().item() for x, y in zip(r["final"], f["final"])) <= 1e-6


# ============================================================================ recipe launches
def _doc(k: int, prefix: str = "k") -> str:
    """Document k: 3 to 21 tagged words (``k<k>x<j>``) interleaved with plain words."""
    return " ".join(f"{prefix}{k}x{j} {WORDS[(k + j) % len(WORDS)]}" for j in range(3 + (k * 23) % 19)) + "."


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("scale_corpus")
    k = 0
    for s, n in enumerate(SHARD_DOCS):
        with open(root / f"train-{s}.jsonl", "w", encoding="utf-8") as fh:
            for _ in range(n):
                fh.write(json.dumps({"text": _doc(k)}) + "\n")
                k += 1
    with open(root / "validation.jsonl", "w", encoding="utf-8") as fh:
        for v in range(30):
            fh.write(json.dumps({"text": _doc(v, "v")}) + "\n")
    return {"train_file": str(root / "train-*.jsonl"), "validation_file": str(root / "validation.jsonl"),
            "cache": str(root / "cache"), "docs": k}


def _recipe(corpus, out: Path, *extra: str):
    args = ["--model", "tiny", "--streaming", "--train_file", corpus["train_file"],
            "--validation_file", corpus["validation_file"], "--seq_len", str(SEQ_LEN),
            "--micro_batch_size", str(MICRO_BATCH), "--max_steps", str(STEPS), "--log_every", "1",
            "--eval_every", "2", "--eval_groups", "--max_eval_blocks", str(MAX_EVAL_BLOCKS),
            "--algorithm", "fl_fsdp", "--num_groups", str(F), "--sync_every", "2", "--report_to", "none",
            "--cache_dir", corpus["cache"], "--output_dir", str(out), *extra]
    # forked ranks (tests/_forkserver.py): a rank ends as an interpreter does (threading._shutdown first, which
    # lets the streaming reader's idle executor threads end; a hang fails the launch's timeout)
    return run_torchrun(4, RECIPE, *args, timeout=600, env={"FL_ACCEL_TEST_RECORD_BLOCKS": str(out / "blocks")})


@pytest.fixture(scope="module")
def stream_run(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("stream_run")
    proc = _recipe(corpus, out, "--checkpoint_every", "1", "--checkpoints_total_limit", "0")  # all: read below
    assert proc.returncode == 0, proc.tail()
    return out, proc


@pytest.fixture(scope="module")
def stream_resumed(tmp_path_factory, corpus, stream_run):
    out = tmp_path_factory.mktemp("stream_resumed")
    ckpt = stream_run[0] / "checkpoints" / f"step_{RESUME_STEP}"
    proc = _recipe(corpus, out, "--resume_from_checkpoint", str(ckpt), "--save_final_model", "false")
    assert proc.returncode == 0, proc.tail()
    return out, proc


def _results(out: Path) -> dict:
    return json.loads((out / "all_results.json").read_text())


def _blocks(out: Path) -> list[list[dict]]:
    """Per rank, the recorded micro-batches: {"step", "epoch", "input_ids"}."""
    return [[json.loads(line) for line in (out / "blocks" / f"rank{r}.jsonl").read_text().splitlines()]
            for r in range(4)]


def _epoch0_text(records: list[dict], tokenizer) -> str:
    """The decoded text of a rank's blocks read in its first pass (the contiguous prefix of
    micro-batches recorded at stream epoch 0: the packing drops nothing, so it is exact)."""
    ids = []
    for rec in records:
        if rec["epoch"] != 0:
            break
        ids.extend(t for block in rec["input_ids"] for t in block)
    return tokenizer.decode(ids)


def _docs_in(text: str) -> set[int]:
    return {int(d) for d in re.findall(r"k(\d+)x", text)}


@pytest.fixture(scope="module")
def tokenizer(stream_run):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(stream_run[0] / "final_model")


def test_streaming_uneven_shards_all_ranks_finish_without_hang(stream_run):
    """Uneven shards: every rank trains exactly 6 optimizer steps (one micro-batch each) and the
    launch ends with exit 0; at least one rank ran out of its shard and started a new epoch
    while another did not (the "no hang" rule is exercised, not avoided)."""
    out, proc = stream_run
    assert not proc.timed_out and _results(out)["steps"] == STEPS
    blocks = _blocks(out)
    for r, records in enumerate(blocks):
        assert [rec["step"] for rec in records] == list(range(1, STEPS + 1)), r
        assert all(len(rec["input_ids"]) == MICRO_BATCH and len(rec["input_ids"][0]) == SEQ_LEN for rec in records)
    wrapped = [max(rec["epoch"] for rec in records) >= 1 for records in blocks]
    assert any(wrapped) and not all(wrapped), wrapped


def test_streaming_global_sharding_is_disjoint(stream_run, corpus, tokenizer):
    """Under "global" data sharding the documents the 4 ranks read in their first pass are
    pairwise disjoint; together they cover most of the corpus (non-vacuous)."""
    docs = [_docs_in(_epoch0_text(records, tokenizer)) for records in _blocks(stream_run[0])]
    assert all(docs), docs
    for a in range(4):
        for b in range(a + 1, 4):
            assert not docs[a] & docs[b], (a, b, docs[a] & docs[b])
    union = set().union(*docs)
    assert union <= set(range(corpus["docs"])) and len(union) >= corpus["docs"] // 2, docs


def test_streaming_resume_mid_epoch_is_the_same_run(stream_run, stream_resumed, tokenizer):
    """Resume from step_3 (mid-round and, on every rank, mid-epoch: stream epoch 0, 6 blocks
    read): each rank trains on exactly the blocks of the uninterrupted run's steps 4-6; the
    logged losses and the final eval loss match within 1e-6; and no document's first word
    appears twice in what a rank read in its first pass across the two launches."""
    (out, _), (out2, proc2) = stream_run, stream_resumed
    assert f"at step {RESUME_STEP}" in proc2.stdout
    for r in range(4):
        state = json.loads((out / "checkpoints" / f"step_{RESUME_STEP}" / "rank_state" / f"rank{r}.json").read_text())
        assert state["data"]["epoch"] == 0 and state["data"]["blocks"] == RESUME_STEP * MICRO_BATCH, state["data"]
    full, resumed = _blocks(out), _blocks(out2)
    for r in range(4):
        assert [rec["step"] for rec in resumed[r]] == list(range(RESUME_STEP + 1, STEPS + 1))
        assert [rec["input_ids"] for rec in resumed[r]] == [rec["input_ids"] for rec in full[r][RESUME_STEP:]], r
        seen = _epoch0_text(full[r][:RESUME_STEP] + resumed[r], tokenizer)
        firsts = re.findall(r"k(\d+)x0 ", seen)
        assert firsts and len(firsts) == len(set(firsts)), (r, firsts)
    a = {m["step"]: m for m in read_metrics(out / "metrics.jsonl") if "train/loss" in m}
    b = {m["step"]: m for m in read_metrics(out2 / "metrics.jsonl") if "train/loss" in m}
    assert sorted(b) == list(range(RESUME_STEP + 1, STEPS + 1))
    for step in b:
        assert abs(a[step]["train/loss"] - b[step]["train/loss"]) <= 1e-6, (step, a[step], b[step])
    assert abs(_results(out)["eval_loss"] - _results(out2)["eval_loss"]) <= 1e-6


def test_eval_groups_differ_mid_round_and_agree_after_sync(stream_run):
    """--eval_groups: at the evaluation steps 2 and 4 (evaluated right before their sync) the
    two groups' perplexities differ; at the final evaluation (after the final sync) they are
    equal to each other and to the synchronized model's eval/perplexity (rel. 1e-6).
    Per-group gradient norms are logged at every step."""
    out, _ = stream_run
    evals = {m["step"]: m for m in read_metrics(out / "metrics.jsonl") if "eval/perplexity" in m}
    assert sorted(evals) == [2, 4, STEPS]
    for step in (2, 4):
        g0, g1 = evals[step]["eval/perplexity_group0"], evals[step]["eval/perplexity_group1"]
        assert math.isfinite(g0) and abs(g0 - g1) > 1e-6 * g0, (step, g0, g1)
    final = evals[STEPS]
    assert final["eval/perplexity_group0"] == final["eval/perplexity_group1"]
    assert final["eval/perplexity_group0"] == pytest.approx(final["eval/perplexity"], rel=1e-6)
    assert final["eval/perplexity"] == pytest.approx(_results(out)["eval_perplexity"], rel=1e-12)
    train = [m for m in read_metrics(out / "metrics.jsonl") if "train/loss" in m]
    assert len(train) == STEPS and all(f"train/grad_norm_group{f}" in m for m in train for f in range(F))
    assert any(m["train/grad_norm_group0"] != m["train/grad_norm_group1"] for m in train)


def _dcp_bytes(path: Path) -> dict[str, int]:
    """Tensor bytes in a checkpoint's DCP metadata by top-level part ("model", "optimizer")."""
    import torch.distributed.checkpoint as dcp

    out = {"model": 0, "optimizer": 0}
    for key, md in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata.items():
        if hasattr(md, "size"):
            part = key.split(".")[1] if key.startswith("group") else key.split(".")[0]
            kind = part.rsplit("_", 1)[0]
            if kind in out:
                out[kind] += math.prod(md.size) * md.properties.dtype.itemsize
    return out


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_checkpoint_at_sync_boundary_stores_the_model_once(stream_run):
    """H=2, a checkpoint every step: at a sync boundary (steps 2, 4) the model is stored once
    (scope "shared"), mid-round (steps 1, 3) once per group, so the model part is exactly 1/F
    of a mid-round one. AdamW state stays per group (F copies of 2 moments in both), so the
    whole directory is (1 + 2F) / (3F) = 5/6 of a mid-round one, measured within 0.03."""
    out, _ = stream_run
    ckpts = out / "checkpoints"
    n_params = _results(out)["n_params"]
    for mid, boundary in ((1, 2), (3, 4)):
        m, b = ckpts / f"step_{mid}", ckpts / f"step_{boundary}"
        assert json.loads((m / "fl_accel_checkpoint.json").read_text())["scopes"]["model"] == "group"
        assert json.loads((b / "fl_accel_checkpoint.json").read_text())["scopes"]["model"] == "shared"
        mb, bb = _dcp_bytes(m), _dcp_bytes(b)
        assert mb["model"] == F * 4 * n_params and bb["model"] == 4 * n_params, (mb, bb, n_params)
        assert bb["optimizer"] == mb["optimizer"] >= F * 2 * 4 * n_params, (mb, bb)
        ratio = _dir_bytes(b) / _dir_bytes(m)
        assert abs(ratio - (1 + 2 * F) / (3 * F)) <= 0.03, (ratio, _dir_bytes(b), _dir_bytes(m))


def test_final_model_loads_and_matches_synchronized_eval(stream_run, corpus, tokenizer):
    """final_model/ loads with AutoModelForCausalLM.from_pretrained and, evaluated here on the
    run's validation blocks (token-weighted NLL, as the recipe's evaluate()), gives the
    synchronized model's eval loss from all_results.json within 1e-5."""
    import types

    from transformers import AutoModelForCausalLM

    from recipes import data as data_lib

    out, _ = stream_run
    model = AutoModelForCausalLM.from_pretrained(out / "final_model").eval()
    args = types.SimpleNamespace(train_file=corpus["train_file"], validation_file=corpus["validation_file"])
    source = data_lib.stream_source(args, corpus["cache"])
    blocks = data_lib.build_validation_blocks(source, tokenizer, SEQ_LEN, MAX_EVAL_BLOCKS)
    assert len(blocks) == MAX_EVAL_BLOCKS
    ids = torch.tensor(blocks)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1),
                                            reduction="sum").double().item()
    tokens = ids[:, 1:].numel()
    results = _results(out)
    assert results["eval_tokens"] == tokens
    assert abs(nll / tokens - results["eval_loss"]) <= 1e-5, (nll / tokens, results["eval_loss"])
