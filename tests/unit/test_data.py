"""recipes/data.py with real components: jsonl shards, the recipe's own BPE tokenizer, datasets.

Streaming: blocks of exactly seq_len that follow the packing rule, disjoint shards over
4 simulated ranks ("global") and per federation group with the group seed ("group"),
epoch wrap on short shards, exact resume from a JSON state, the held-out validation
documents never trained on, and one-line errors. Map style: the packed blocks follow the
rule written out, and datasets' map cache hits and misses on the right keys. Hub: offline
(HF_HUB_OFFLINE) failures in one line, and loads from a local directory and from a populated
Hub cache. No process is started: the default corpus's golden blocks, the cache reused by a new
process and packing in two processes are in tests/recipe/test_data_default_corpus.py.

Every test runs under each setting of :data:`ENV_SETTINGS` (the variables clusters without
internet commonly set: ``HF_HUB_OFFLINE``, ``HF_DATASETS_OFFLINE``, ``TRANSFORMERS_OFFLINE``,
``WANDB_MODE``), and with none of them set, whatever the shell that started pytest set: the
tests do not depend on them (issue 42). A test that needs the Hub reachable or unreachable says
so with the ``online`` or ``offline`` fixture.
"""

from __future__ import annotations

import json
import os
import re
import types

import pytest
import torch

from recipes import data as D

# Uneven shards: 5 files with 3, 10, 1, 7 and 4 documents; every document is tagged.
SHARD_SIZES = (3, 10, 1, 7, 4)
SEQ_LEN = 16
TAG = re.compile(r"\[d(\d{3})\]")


ENV_SETTINGS = {
    "none set": {},
    "HF_HUB_OFFLINE=1": {"HF_HUB_OFFLINE": "1"},
    "HF_DATASETS_OFFLINE=1": {"HF_DATASETS_OFFLINE": "1"},
    "TRANSFORMERS_OFFLINE=1": {"TRANSFORMERS_OFFLINE": "1"},
    "WANDB_MODE=offline": {"WANDB_MODE": "offline"},
}
"""The environments every test of this file runs in (ids of the ``env_setting`` parameter)."""
ENV_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "WANDB_MODE")


def _set_hub_mode(mp, hub_offline: bool, datasets_offline: bool) -> None:
    """The offline switches huggingface_hub and datasets read at import (and transformers
    through huggingface_hub's ``is_offline_mode``), set on ``mp`` (a ``pytest.MonkeyPatch``)."""
    import datasets
    import huggingface_hub.constants as constants

    mp.setattr(constants, "HF_HUB_OFFLINE", hub_offline)
    mp.setattr(datasets.config, "HF_HUB_OFFLINE", datasets_offline)
    mp.setattr(datasets.config, "HF_DATASETS_OFFLINE", datasets_offline)


@pytest.fixture(scope="module", autouse=True, params=list(ENV_SETTINGS))
def env_setting(request):
    """Each test under one of :data:`ENV_SETTINGS`, as if the shell had set it before Python
    started: the variables of :data:`ENV_VARS` unset, the setting's set, and the switches
    the libraries derive from them at import recomputed by their own rules (huggingface_hub
    ``constants.py``: HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE; datasets ``config.py``:
    HF_DATASETS_OFFLINE when set, else the hub's)."""
    with pytest.MonkeyPatch.context() as mp:
        for var in ENV_VARS:
            mp.delenv(var, raising=False)
        for var, value in ENV_SETTINGS[request.param].items():
            mp.setenv(var, value)
        true = {"1", "ON", "YES", "TRUE"}  # both libraries' ENV_VARS_TRUE_VALUES
        hub = (os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or "").upper() in true
        ds = os.environ.get("HF_DATASETS_OFFLINE")
        _set_hub_mode(mp, hub, hub if ds is None else ds.upper() in true)
        yield request.param


@pytest.fixture(autouse=True)
def _no_download_counts(monkeypatch):
    """datasets pings the Hub to count every load_dataset("json"/"text"); offline that costs seconds."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_UPDATE_DOWNLOAD_COUNTS", False)


def _doc(k: int) -> str:
    words = " ".join(["alpha", "beta", "gamma", "delta", "epsilon"][(k + i) % 5] for i in range(3 + 5 * (k % 4)))
    return f"[d{k:03d}] {words}.\n"


def _write_jsonl(path, docs):
    with open(path, "w", encoding="utf-8") as fh:
        for k, text in docs:
            fh.write(json.dumps({"id": k, "text": text}) + "\n")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Five uneven jsonl training shards, a validation file, and the recipe's BPE on them."""
    root = tmp_path_factory.mktemp("corpus")
    files, k = [], 0
    for s, n in enumerate(SHARD_SIZES):
        path = root / f"train-{s}.jsonl"
        _write_jsonl(path, [(k + i, _doc(k + i)) for i in range(n)])
        files.append(str(path))
        k += n
    val = root / "validation.jsonl"
    _write_jsonl(val, [(1000 + i, f"validation text number {i}, alpha beta.\n") for i in range(40)])
    texts = [_doc(i) for i in range(k)] + [f"validation text number {i}, alpha beta.\n" for i in range(40)]
    tokenizer = D.train_bpe_tokenizer(texts, 320, str(root))
    return types.SimpleNamespace(root=root, files=files, validation=str(val), n_docs=k, tokenizer=tokenizer,
                                 cache=str(root / "cache"))


def _args(corpus, **kw):
    base = dict(train_file=corpus.files, validation_file=corpus.validation, text_column="text",
                validation_holdout_docs=None, dataset_name=None, dataset_config_name=None)
    base.update(kw)
    return types.SimpleNamespace(**base)


def _source(corpus, **kw):
    return D.stream_source(_args(corpus, **kw), corpus.cache)


def _take(stream, n):
    it = iter(stream)
    return [next(it)["input_ids"].tolist() for _ in range(n)]


def _epoch_docs(stream, epoch):
    """The documents of one epoch of a stream's shard, in reading order (from its source)."""
    stream.source.set_epoch(epoch)
    stream.source.load_state_dict(None)
    return [ex["text"] for ex in stream.source]


def _reference_blocks(corpus, stream, n):
    """Map-path packing rule written out: tokenize each document, concatenate, cut."""
    ids, epoch = [], 0
    while len(ids) < n * SEQ_LEN:
        for text in _epoch_docs(stream, epoch):
            ids.extend(corpus.tokenizer(text, add_special_tokens=False)["input_ids"])
        epoch += 1
    return [ids[i * SEQ_LEN:(i + 1) * SEQ_LEN] for i in range(n)]


def _tags(tokenizer, blocks) -> list[int]:
    return [int(m) for m in TAG.findall(tokenizer.decode([t for b in blocks for t in b]))]


# --------------------------------------------------------------------------- streaming
def test_blocks_are_seq_len_and_follow_the_packing_rule(corpus):
    source = _source(corpus)
    stream = D.build_train_stream(source, corpus.tokenizer, SEQ_LEN, 4, 1, seed=3)
    got = _take(stream, 40)  # far past this rank's first epoch
    assert all(len(b) == SEQ_LEN for b in got)
    reference = D.build_train_stream(source, corpus.tokenizer, SEQ_LEN, 4, 1, seed=3)
    assert got == _reference_blocks(corpus, reference, 40)
    # the map path adds no special token either: no EOS id anywhere
    assert corpus.tokenizer.convert_tokens_to_ids(D.EOS) not in {t for b in got for t in b}


def test_dataloader_batches_are_long_tensors(corpus):
    stream = D.build_train_stream(_source(corpus), corpus.tokenizer, SEQ_LEN, 1, 0, seed=0)
    batch = next(iter(torch.utils.data.DataLoader(stream, batch_size=3)))
    assert batch["input_ids"].shape == (3, SEQ_LEN) and batch["input_ids"].dtype == torch.long


@pytest.mark.parametrize("num_shards", [4, 5])  # 4: documents split over ranks; 5: whole files per rank
def test_global_sharding_is_disjoint_across_ranks(corpus, num_shards):
    source = _source(corpus)
    docs, tags, later = [], [], []
    for rank in range(num_shards):
        stream = D.build_train_stream(source, corpus.tokenizer, SEQ_LEN, num_shards, rank, seed=11)
        docs.append({int(TAG.search(t).group(1)) for t in _epoch_docs(stream, 0)})
        later.append({int(TAG.search(t).group(1)) for t in _epoch_docs(stream, 1)})
        fresh = D.build_train_stream(source, corpus.tokenizer, SEQ_LEN, num_shards, rank, seed=11)
        n_tokens = sum(len(corpus.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in _epoch_docs(fresh, 0))
        tags.append(set(_tags(corpus.tokenizer, _take(fresh, n_tokens // SEQ_LEN))))
        assert tags[-1] <= docs[-1], f"rank {rank} packed documents of another shard"
    for epoch in (docs, later):
        assert sum(len(d) for d in epoch) == corpus.n_docs and set().union(*epoch) == set(range(corpus.n_docs))
    for a in range(num_shards):
        for b in range(a + 1, num_shards):
            assert not docs[a] & docs[b] and not tags[a] & tags[b]


def test_short_shard_wraps_into_next_epochs(corpus):
    # seed None keeps the file order of epoch 0; 5 shards for 5 files: rank 2 holds the 1-document file.
    # Later epochs reshuffle which files each rank reads (datasets' set_epoch), still disjointly.
    stream = D.build_train_stream(_source(corpus), corpus.tokenizer, SEQ_LEN, 5, 2, seed=None)
    assert [int(TAG.search(t).group(1)) for t in _epoch_docs(stream, 0)] == [13]
    fresh = D.build_train_stream(_source(corpus), corpus.tokenizer, SEQ_LEN, 5, 2, seed=None)
    blocks = _take(fresh, 30)  # the 1-document shard holds less than 2 blocks
    assert len(blocks) == 30 and all(len(b) == SEQ_LEN for b in blocks)
    assert _tags(corpus.tokenizer, blocks)[0] == 13
    assert fresh.epoch >= 2 and fresh.state_dict()["epoch"] == fresh.epoch
    assert blocks == _reference_blocks(corpus, stream, 30)


@pytest.mark.parametrize("cut", [3, 9])  # mid-epoch, and after the shard wrapped once
def test_resume_from_state_dict_is_exact(corpus, cut):
    source = _source(corpus)
    whole = _take(D.build_train_stream(source, corpus.tokenizer, SEQ_LEN, 4, 2, seed=5), cut + 12)
    first = D.build_train_stream(source, corpus.tokenizer, SEQ_LEN, 4, 2, seed=5)
    head = _take(first, cut)
    state = json.loads(json.dumps(first.state_dict()))  # what the checkpoint stores
    second = D.build_train_stream(source, corpus.tokenizer, SEQ_LEN, 4, 2, seed=5)
    second.load_state_dict(state)
    tail = _take(second, 12)
    assert head + tail == whole
    assert second.blocks_yielded == cut + 12
    # within the first epoch every document of the shard appears exactly once
    epoch0 = _epoch_docs(D.build_train_stream(source, corpus.tokenizer, SEQ_LEN, 4, 2, seed=5), 0)
    n0 = sum(len(corpus.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in epoch0)
    tokens = [t for b in head + tail for t in b][:n0]
    if len(tokens) == n0:
        seen = [int(m) for m in TAG.findall(corpus.tokenizer.decode(tokens))]
        assert sorted(seen) == sorted(int(TAG.search(t).group(1)) for t in epoch0)


def test_resume_through_a_dataloader(corpus):
    source = _source(corpus)

    def loader(stream):
        return iter(torch.utils.data.DataLoader(stream, batch_size=2))

    ref = loader(D.build_train_stream(source, corpus.tokenizer, SEQ_LEN, 2, 0, seed=1))
    expected = [next(ref)["input_ids"] for _ in range(7)]
    stream = D.build_train_stream(source, corpus.tokenizer, SEQ_LEN, 2, 0, seed=1)
    it = loader(stream)
    got = [next(it)["input_ids"] for _ in range(4)]
    state = stream.state_dict()
    resumed = D.build_train_stream(source, corpus.tokenizer, SEQ_LEN, 2, 0, seed=1)
    resumed.load_state_dict(state)
    it = loader(resumed)
    got += [next(it)["input_ids"] for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_group_sharding_uses_the_group_seed(corpus):
    """2 federation groups x 2 ranks: (num_shards=G, index=group-local rank, seed + group)."""
    source, seed, G = _source(corpus), 42, 2
    orders = {}
    for group in range(2):
        docs = []
        for local in range(G):
            stream = D.build_train_stream(source, corpus.tokenizer, SEQ_LEN, G, local, seed=seed + group)
            orders[group, local] = [int(TAG.search(t).group(1)) for t in _epoch_docs(stream, 0)]
            docs.append(set(orders[group, local]))
        assert not docs[0] & docs[1] and docs[0] | docs[1] == set(range(corpus.n_docs))  # each group reads all
    assert orders[0, 0] != orders[1, 0]  # the group seed changes what a group-local rank reads
    again = D.build_train_stream(source, corpus.tokenizer, SEQ_LEN, G, 0, seed=seed + 1)
    assert [int(TAG.search(t).group(1)) for t in _epoch_docs(again, 0)] == orders[1, 0]
    g0 = D.build_train_stream(source, corpus.tokenizer, SEQ_LEN, G, 0, seed=seed)
    _take(g0, 2)
    g1 = D.build_train_stream(source, corpus.tokenizer, SEQ_LEN, G, 0, seed=seed + 1)
    with pytest.raises(D.DataError, match="seed: saved 42, now 43"):
        g1.load_state_dict(g0.state_dict())


@pytest.mark.parametrize("other", [dict(shard_index=1), dict(num_shards=2, shard_index=0), dict(seq_len=8)])
def test_state_of_another_stream_is_refused(corpus, other):
    source = _source(corpus)
    stream = D.build_train_stream(source, corpus.tokenizer, SEQ_LEN, 4, 0, seed=0)
    _take(stream, 2)
    kw = dict(seq_len=SEQ_LEN, num_shards=4, shard_index=0, seed=0) | other
    with pytest.raises(D.DataError, match="belongs to another stream"):
        D.build_train_stream(source, corpus.tokenizer, **kw).load_state_dict(stream.state_dict())


def test_empty_shard_raises_one_clear_error(corpus, tmp_path):
    files = list(corpus.files)
    files[3] = str(tmp_path / "blank.jsonl")
    _write_jsonl(files[3], [(900, ""), (901, "")])
    stream = D.build_train_stream(_source(corpus, train_file=files), corpus.tokenizer, SEQ_LEN, 5, 3, seed=None)
    with pytest.raises(D.DataError, match="shard 3 of 5 .* has no text"):
        _take(stream, 1)


def test_missing_text_column_is_named(corpus):
    stream = D.build_train_stream(_source(corpus, text_column="body"), corpus.tokenizer, SEQ_LEN, 1, 0, seed=0)
    with pytest.raises(D.DataError, match=r"no text column 'body'; columns: \['id', 'text'\]"):
        _take(stream, 1)


def test_validation_from_file_is_map_style_blocks(corpus):
    blocks = D.build_validation_blocks(_source(corpus), corpus.tokenizer, SEQ_LEN, max_blocks=5)
    assert len(blocks) == 5 and all(len(b) == SEQ_LEN for b in blocks)
    assert corpus.tokenizer.decode(blocks[0]).startswith("validation text number 0")


def test_holdout_validation_is_never_trained_on(corpus):
    source = _source(corpus, validation_file=None, validation_holdout_docs=4)
    blocks = D.build_validation_blocks(source, corpus.tokenizer, SEQ_LEN)
    held = {0, 1, 2, 3}  # the first 4 documents of the files in their given order
    assert set(_tags(corpus.tokenizer, blocks)) <= held and 0 in _tags(corpus.tokenizer, blocks)
    for rank in range(2):
        stream = D.build_train_stream(source, corpus.tokenizer, SEQ_LEN, 2, rank, seed=0)
        assert not set(_tags(corpus.tokenizer, _take(stream, 30))) & held
    with pytest.raises(D.DataError, match="too few to hold out 99"):
        D.build_validation_blocks(_source(corpus, validation_file=None, validation_holdout_docs=99),
                                  corpus.tokenizer, SEQ_LEN)


def test_data_file_errors_name_the_flag(corpus, tmp_path):
    with pytest.raises(D.DataError, match="--train_file '.*nothing-\\*.jsonl' matches no file"):
        _source(corpus, train_file=str(tmp_path / "nothing-*.jsonl"))
    (tmp_path / "a.txt").write_text("some text\n")
    with pytest.raises(D.DataError, match="mix formats"):
        _source(corpus, train_file=[corpus.files[0], str(tmp_path / "a.txt")])
    assert D.resolve_data_files(str(corpus.root / "train-*.jsonl")) == corpus.files  # globs are sorted
    assert D.resolve_data_files(f"{corpus.files[3]}, {corpus.root}/train-[01].jsonl") == \
        [corpus.files[3], *corpus.files[:2]]  # a comma list keeps its order
    with pytest.raises(D.DataError, match="--validation_file .*/nope.jsonl does not exist"):
        D.resolve_data_files(str(tmp_path / "nope.jsonl"), "validation_file")


def test_bpe_tokenizer_for_a_stream_is_cached(corpus):
    args = _args(corpus, tokenizer="bpe", vocab_size=300)
    first = D.get_stream_tokenizer(args, _source(corpus), corpus.cache)
    again = D.get_stream_tokenizer(args, _source(corpus), corpus.cache)
    assert len(first) == 300 and first.name_or_path == again.name_or_path
    # the one BPE entry point: the same texts give the same cached tokenizer
    texts = [ex["text"] for ex in _source(corpus).open("train")]
    assert D.train_bpe_tokenizer(texts, 300, corpus.cache).name_or_path == first.name_or_path
    held = _source(corpus, validation_file=None, validation_holdout_docs=4)
    without = D.get_stream_tokenizer(args, held, corpus.cache)  # held-out documents are not trained on
    assert without.name_or_path == D.train_bpe_tokenizer(texts[4:], 300, corpus.cache).name_or_path
    assert without.name_or_path != first.name_or_path


# --------------------------------------------------------------------------- map-style cache
def _reference_map_blocks(tokenizer, texts, seq_len):
    """The map-style packing rule written out: per PACK_BATCH documents, tokenize, concatenate,
    cut, drop the tail."""
    blocks = []
    for i in range(0, len(texts), D.PACK_BATCH):
        ids = [t for text in texts[i:i + D.PACK_BATCH] for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
        blocks += [ids[j:j + seq_len] for j in range(0, len(ids) - seq_len + 1, seq_len)]
    return blocks


def test_packed_cache_hits_and_misses_on_its_key(corpus, tmp_path):
    import datasets

    raw = datasets.load_dataset("json", data_files={"train": corpus.files, "validation": corpus.validation})
    cache = str(tmp_path / "cache")
    miss = D.tokenize_and_pack_cached(raw, corpus.tokenizer, "text", SEQ_LEN, cache)
    hit = D.tokenize_and_pack_cached(raw, corpus.tokenizer, "text", SEQ_LEN, cache)
    assert (miss.hit, hit.hit) == (False, True) and miss.path == hit.path
    for split in ("train", "validation"):
        expected = _reference_map_blocks(corpus.tokenizer, raw[split]["text"], SEQ_LEN)
        assert hit.dataset[split]["input_ids"] == miss.dataset[split]["input_ids"] == expected and expected
        assert all(f["filename"].startswith(hit.path) for f in hit.dataset[split].cache_files)  # datasets' map cache
    assert not D.tokenize_and_pack_cached(raw, corpus.tokenizer, "text", SEQ_LEN // 2, cache).hit  # seq_len
    other_tok = D.train_bpe_tokenizer(raw["train"]["text"], 300, str(tmp_path))
    assert not D.tokenize_and_pack_cached(raw, other_tok, "text", SEQ_LEN, cache).hit  # tokenizer
    edited = datasets.DatasetDict({"train": raw["train"].map(lambda ex: {"text": ex["text"] + " "}),
                                   "validation": raw["validation"]})
    assert not D.tokenize_and_pack_cached(edited, corpus.tokenizer, "text", SEQ_LEN, cache).hit  # corpus
    assert D.tokenize_and_pack_cached(raw, corpus.tokenizer, "text", SEQ_LEN, cache).hit  # the first still there
    assert len(os.listdir(os.path.join(cache, "packed"))) == 4


def test_corpus_digest_is_kept_per_datasets_fingerprint(corpus, tmp_path):
    """The cache keys' SHA-256 over a column is computed once per ``datasets`` fingerprint and
    read back after that (the other ranks, later runs); a rewritten file (new modification
    time, so a new fingerprint) is hashed again; a plain list is never kept."""
    import datasets

    path = tmp_path / "train.jsonl"
    _write_jsonl(path, [(i, _doc(i)) for i in range(30)])
    cache = str(tmp_path / "cache")
    ds = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=str(tmp_path / "hf"))
    texts = ds["text"]
    want = D._digest(texts)
    assert D._digest(D._Column(ds, "text"), cache) == want
    [memo] = os.listdir(os.path.join(cache, "digests"))
    assert memo.startswith(ds._fingerprint)
    # read back, not recomputed: a planted value comes out
    with open(os.path.join(cache, "digests", memo), "w") as fh:
        fh.write("0123456789abcdef")
    assert D._digest(D._Column(ds, "text"), cache) == "0123456789abcdef"
    # the file rewritten with other text: datasets gives it a new fingerprint, so it is hashed again
    _write_jsonl(path, [(i, _doc(i + 1)) for i in range(30)])
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
    ds2 = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=str(tmp_path / "hf"))
    assert ds2._fingerprint != ds._fingerprint
    assert D._digest(D._Column(ds2, "text"), cache) == D._digest(ds2["text"]) != want
    assert len(os.listdir(os.path.join(cache, "digests"))) == 2
    D._digest(texts, str(tmp_path / "other"))  # a list: no fingerprint, nothing kept
    assert not os.path.exists(tmp_path / "other")


def test_a_split_shorter_than_a_block_packs_to_zero_blocks(corpus, tmp_path):
    """The recipe reports "validation split has 0 blocks" from an empty input_ids column."""
    import datasets

    raw = datasets.DatasetDict({"train": datasets.load_dataset("json", data_files=corpus.files, split="train"),
                                "validation": datasets.Dataset.from_dict({"text": ["Brief.\n"]})})
    for _ in range(2):  # tokenized, then from the cache
        packed = D.tokenize_and_pack_cached(raw, corpus.tokenizer, "text", SEQ_LEN, str(tmp_path)).dataset
        assert packed["validation"]["input_ids"] == [] and len(packed["train"]) > 0


def test_tokenizer_fingerprint_sees_the_definition(corpus, tmp_path):
    corpus.tokenizer.save_pretrained(tmp_path / "copy")
    copy = D.load_tokenizer(str(tmp_path / "copy"))
    assert D.tokenizer_fingerprint(copy) == D.tokenizer_fingerprint(corpus.tokenizer)  # loaded from elsewhere
    copy.add_tokens(["<extra>"])
    assert D.tokenizer_fingerprint(copy) != D.tokenizer_fingerprint(corpus.tokenizer)


# --------------------------------------------------------------------------- hub
@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hub cache of our own."""
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


@pytest.fixture
def offline(monkeypatch):
    """HF_HUB_OFFLINE=1, as set in the environment (huggingface_hub and datasets read it at import)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _set_hub_mode(monkeypatch, True, True)


@pytest.fixture
def online(monkeypatch):
    """No offline switch, whatever the environment says: the Hub counts as reachable (a test
    with this fixture must not reach it for real)."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    _set_hub_mode(monkeypatch, False, False)


def _populate(cache, repo_type: str, repo_id: str, files: dict[str, bytes]) -> None:
    """Lay files out as huggingface_hub's cache does after a download."""
    base = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)
    for name, data in files.items():
        path = base / "snapshots" / commit / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


@pytest.mark.parametrize("kind,load,name", [
    ("tokenizer", D.load_tokenizer, "meta-llama/Llama-3.1-8B"),
    ("model config", D.load_model_config, "meta-llama/Llama-3.1-8B"),
])
def test_uncached_hub_object_fails_in_one_line_offline(hub_cache, offline, kind, load, name):
    with pytest.raises(D.DataError) as info:
        load(name)
    msg = str(info.value)
    assert "\n" not in msg and isinstance(info.value, ValueError)
    assert msg.startswith(f"cannot load {kind} '{name}': not in the local cache and the Hugging Face Hub is "
                          f"unreachable (offline: HF_HUB_OFFLINE=1)")
    assert f"hf download {name}" in msg and "or pass a local path" in msg


def test_failed_download_is_one_line_naming_the_download(online, monkeypatch):
    """Control flow only (the real offline failure is above): a loader that finds nothing in the
    cache and whose download raises gives one line with the library's first line. The download
    is only tried online (``online``: under HF_HUB_OFFLINE=1 the code rightly skips it, and the
    offline message is tested above)."""
    calls = []

    def loader(name, local_files_only=False):
        calls.append(local_files_only)
        raise OSError("We couldn't connect to 'https://huggingface.co'.\nCheck your internet connection.")

    monkeypatch.setattr(D, "_hub_resolves", lambda: True)  # the Hub's name resolves; the download fails

    with pytest.raises(D.DataError) as info:
        D._load_hub_object("tokenizer", "someone/tok", loader, "hf download someone/tok")
    assert calls == [True, False]  # the cache first, then the Hub
    assert str(info.value) == ("cannot load tokenizer 'someone/tok': not in the local cache and not downloadable "
                               "(OSError: We couldn't connect to 'https://huggingface.co'.). Download it once with "
                               "network access (hf download someone/tok) or pass a local path.")


def test_an_unresolvable_hub_fails_at_once_without_download_retries(online, hub_cache, monkeypatch):
    """Where the Hub's host name does not resolve (no network), the recipe does not start a
    download: huggingface_hub would retry it 5 times, 1 to 8 s apart, printing a warning each, on
    every rank (a newcomer saw about 40 lines and 40 s before the error). A real lookup of a name
    that cannot resolve (RFC 2606's .invalid), and the control flow with a recording loader."""
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "ENDPOINT", "https://hub.fl-accel.invalid")
    assert D._hub_resolves() is False
    calls = []

    def loader(name, local_files_only=False):
        calls.append(local_files_only)
        raise OSError("not in the cache")

    with pytest.raises(D.DataError) as info:
        D._load_hub_object("model config", "someone/model", loader, "hf download someone/model config.json")
    assert calls == [True]  # the cache only: no download attempt
    assert str(info.value) == ("cannot load model config 'someone/model': not in the local cache and the Hugging "
                               "Face Hub's address does not resolve (no network?). Download it once with network "
                               "access (hf download someone/model config.json) or pass a local path.")
    with pytest.raises(D.DataError, match="address does not resolve"):
        D.load_model_config("someone/uncached-model")  # the real loader, the same way


def test_tokenizer_and_config_load_from_a_local_dir_and_the_hub_cache(corpus, hub_cache, tmp_path):
    from transformers import LlamaConfig

    local = tmp_path / "saved"
    corpus.tokenizer.save_pretrained(local)
    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=len(corpus.tokenizer)).save_pretrained(local)
    tok = D.load_tokenizer(str(local))
    assert tok("alpha beta")["input_ids"] == corpus.tokenizer("alpha beta")["input_ids"]
    assert D.load_model_config(str(local)).hidden_size == 32
    assert D.load_model_config(str(local / "config.json")).hidden_size == 32
    # the same files as a downloaded hub repo: loads with the Hub unreachable
    _populate(hub_cache, "model", "fl-accel/tiny-llama", {p.name: p.read_bytes() for p in local.iterdir()})
    assert len(D.load_tokenizer("fl-accel/tiny-llama")) == len(corpus.tokenizer)
    assert D.load_model_config("fl-accel/tiny-llama").num_hidden_layers == 1
    with pytest.raises(D.DataError, match="cannot load tokenizer from local path"):
        D.load_tokenizer(str(tmp_path))  # a directory without a tokenizer


def test_paper_dataset_offline_names_it_and_the_download(corpus, hub_cache, offline):
    args = _args(corpus, train_file=None, validation_file=None, dataset_name="gsarti/clean_mc4_it",
                 dataset_config_name="tiny")
    with pytest.raises(D.DataError) as info:
        D.stream_source(args, corpus.cache)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith("cannot load dataset 'gsarti/clean_mc4_it (config tiny)': not in the local cache")
    assert "hf download gsarti/clean_mc4_it --repo-type dataset --include" in msg
    source = D.stream_source(_args(corpus, train_file=None, dataset_name="someone/some-corpus"), corpus.cache)
    with pytest.raises(D.DataError, match="cannot load dataset 'someone/some-corpus': not in the local cache"):
        D.build_train_stream(source, corpus.tokenizer, SEQ_LEN, 1, 0, seed=0)  # opens the hub dataset
    url = "hf://datasets/someone/some-corpus/data/*.jsonl"
    with pytest.raises(D.DataError, match=f"cannot load data files '{re.escape(url)}': not in the local cache") as info:
        D.stream_source(_args(corpus, train_file=url, validation_file=None), corpus.cache)
    assert "hf download someone/some-corpus --repo-type dataset --include 'data/*.jsonl'" in str(info.value)


def test_paper_dataset_streams_from_the_hub_cache(corpus, hub_cache, offline):
    """The 101 files of clean_mc4_it 'tiny' (tiny stand-ins here) cached: streams offline."""
    import gzip

    known = D.KNOWN_HUB_FILES["gsarti/clean_mc4_it", "tiny"]
    files = {}
    for i, name in enumerate(known["train"] + known["validation"]):
        lines = [json.dumps({"text": f"[d{i:03d}] testo italiano numero {i}.\n", "url": "u", "timestamp": "t"})]
        files[name] = gzip.compress(("\n".join(lines) + "\n").encode())
    _populate(hub_cache, "dataset", "gsarti/clean_mc4_it", files)
    source = D.stream_source(_args(corpus, train_file=None, validation_file=None,
                                   dataset_name="gsarti/clean_mc4_it", dataset_config_name="tiny"), corpus.cache)
    assert len(source.train_files) == 100 and all(os.path.isfile(p) for p in source.train_files)
    stream = D.build_train_stream(source, corpus.tokenizer, SEQ_LEN, 4, 3, seed=0)
    assert len(_take(stream, 3)) == 3
    assert set(_tags(corpus.tokenizer, _take(D.build_train_stream(source, corpus.tokenizer, SEQ_LEN, 4, 3, 0), 5)))
    assert D.build_validation_blocks(source, corpus.tokenizer, SEQ_LEN)


def test_paper_configs_stream_clean_mc4_it():
    import yaml

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for name in ("paper_fl_fsdp", "paper_fl_hsdp", "paper_fsdp", "paper_hsdp"):
        with open(os.path.join(root, "recipes", "configs", f"{name}.yaml"), encoding="utf-8") as fh:
            cfg = yaml.safe_load(fh)
        assert cfg["streaming"] is True and cfg["max_steps"] == 64, name
        assert (cfg["dataset_name"], cfg["dataset_config_name"]) in D.KNOWN_HUB_FILES, name
        assert cfg["tokenizer"] == "meta-llama/Llama-3.1-8B" and cfg["seq_len"] == 2048, name


def test_embedded_corpus_holds_out_the_tempest_and_twelfth_night(tmp_path):
    files = D.write_shakespeare(str(tmp_path))
    train, val = (open(files[split], encoding="utf-8").read() for split in ("train", "validation"))
    assert val.startswith("Twelfth Night") and "\n\nThe Tempest\n" in val  # the two plays, in file order
    for name in ("PROSPERO", "MALVOLIO", "VIOLA", "CALIBAN"):  # their characters: only in validation
        assert name in val and name not in train, name
    assert "HAMLET" in train and "**" not in train and "\n#" not in train
    assert D.write_shakespeare(str(tmp_path)) == files  # idempotent
