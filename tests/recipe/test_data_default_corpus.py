"""recipes/data.py on the recipe's default corpus and in other processes: golden digests pin the
blocks of the embedded Shakespeare (map style and streaming, the recipe's 8k BPE, 256-token
blocks: about 15 CPU-s to prepare), a new process reuses the packed cache, and packing in two
processes (num_proc=2) gives the blocks of two contiguous halves. The rest of recipes/data.py,
in-process on a small corpus: tests/unit/test_data.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest

from recipes import data as D
from unit.test_data import SEQ_LEN, _no_download_counts, _reference_map_blocks, _take, corpus  # noqa: F401


# --------------------------------------------------------------------------- map-style cache in two processes
def test_packing_in_two_processes_gives_the_same_blocks(corpus, tmp_path):
    """num_proc=2 (the recipe's --preprocessing_num_workers): the blocks of 2 contiguous halves."""
    import datasets

    raw = datasets.DatasetDict({"train": datasets.load_dataset("json", data_files=corpus.files, split="train")})
    packed = D.tokenize_and_pack_cached(raw, corpus.tokenizer, "text", SEQ_LEN, str(tmp_path), num_proc=2)
    half = (len(raw["train"]) + 1) // 2
    texts = raw["train"]["text"]
    expected = [b for part in (texts[:half], texts[half:]) for b in _reference_map_blocks(corpus.tokenizer, part,
                                                                                            SEQ_LEN)]
    assert packed.dataset["train"]["input_ids"] == expected and not packed.hit
    assert D.tokenize_and_pack_cached(raw, corpus.tokenizer, "text", SEQ_LEN, str(tmp_path), num_proc=2).hit



# --------------------------------------------------------------------------- golden blocks
# The blocks the default corpus gives (embedded Shakespeare, the recipe's 8k BPE, 256-token
# blocks), so that runs stay comparable whatever the data code becomes. Computed with
# recipes/data.py at main 17f35df (before the rewrite onto datasets' own machinery); a
# change here changes every benchmark's data: only ever update it on purpose.
GOLDEN = {
    "map_train": ("8aeb53ee88a437420f937b2c2b37f5eb", 5355),
    "map_validation": ("5c81a67cb6ee3123d445fdf239e509a1", 261),
    "stream_train": ("53c417d40408fb66b1d4cd7ef3c764c9", 64),
    "stream_validation": ("3227de239f35b58fb0df7bdff36da23c", 32),
    "vocab": ("6f97b860214dd2cd555a22e25c72ab78", 1),  # the same BPE on both paths
}


def _digest(blocks) -> tuple[str, int]:
    import hashlib

    blocks = [list(map(int, b)) for b in blocks]
    return hashlib.sha256(json.dumps(blocks).encode()).hexdigest()[:32], len(blocks)


@pytest.fixture(scope="module")
def golden_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("golden_cache"))


def _default_args(**kw):
    base = dict(dataset_name="shakespeare", dataset_config_name=None, train_file=None, validation_file=None,
                text_column="text", validation_split_percentage=5.0, validation_holdout_docs=1000,
                tokenizer="bpe", vocab_size=8192, seed=42, seq_len=256)
    return types.SimpleNamespace(**(base | kw))


def _map_style_digests(cache_dir: str) -> dict:
    """The recipe's map-style data preparation on the default corpus; digests, cache hit, seconds."""
    args = _default_args()
    raw = D.load_raw(args, cache_dir)
    tokenizer = D.get_tokenizer(args, raw, cache_dir)
    packed = D.tokenize_and_pack_cached(raw, tokenizer, "text", args.seq_len, cache_dir)
    return {"map_train": _digest(packed.dataset["train"]["input_ids"]),
            "map_validation": _digest(packed.dataset["validation"]["input_ids"]),
            "vocab": _digest([[i for _, i in sorted(tokenizer.get_vocab().items())]]),
            "hit": packed.hit, "seconds": packed.seconds}


@pytest.fixture(scope="module")
def golden_map(golden_cache):
    return _map_style_digests(golden_cache)


def test_default_corpus_blocks_are_unchanged_map_style(golden_map):
    """Map-style (the recipe's default): every training and validation block of the embedded corpus."""
    got = {k: tuple(v) for k, v in golden_map.items() if k in GOLDEN}
    assert got == {k: GOLDEN[k] for k in got}


def test_a_second_run_reuses_the_packed_cache(golden_map, golden_cache):
    """A new process (a rerun of the recipe) with the same cache folder loads the packed blocks
    (datasets' map cache) instead of tokenizing: same digests, hit=True."""
    here = os.path.dirname(os.path.abspath(__file__))
    root, tests = os.path.dirname(os.path.dirname(here)), os.path.dirname(here)
    code = (f"import json, sys; sys.path[:0] = [{root!r}, {tests!r}, {here!r}]; import test_data_default_corpus as t; "
            f"print(json.dumps(t._map_style_digests({golden_cache!r})))")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_DATASETS_DISABLE_PROGRESS_BARS="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rerun = json.loads(proc.stdout.strip().splitlines()[-1])
    assert golden_map["hit"] is False and rerun["hit"] is True
    assert {k: tuple(rerun[k]) for k in GOLDEN if k in rerun} == {k: tuple(golden_map[k]) for k in GOLDEN
                                                                   if k in golden_map}
    print(f"packing: {golden_map['seconds']:.1f} s, from the cache: {rerun['seconds']:.1f} s")


def test_default_corpus_blocks_are_unchanged_streaming(golden_cache):
    """--streaming: the first 64 training blocks of one shard (seed 42) and the first 32 validation blocks."""
    args = _default_args()
    source = D.stream_source(args, golden_cache)
    tokenizer = D.get_stream_tokenizer(args, source, golden_cache)
    stream = D.build_train_stream(source, tokenizer, args.seq_len, 1, 0, seed=42)
    got = {"stream_train": _digest(_take(stream, 64)),
           "stream_validation": _digest(D.build_validation_blocks(source, tokenizer, args.seq_len, 32)),
           "vocab": _digest([[i for _, i in sorted(tokenizer.get_vocab().items())]])}
    print(json.dumps(got))
    assert got == {k: GOLDEN[k] for k in got}
