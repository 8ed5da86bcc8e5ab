"""A retrieval datastore for the `rest` drafter: corpus tokens + a suffix array, memory-mapped.

Layout of a datastore directory:
    tokens.npy          int32 [n]  token ids of every document, documents separated by -1
    suffix_array.npy    int32 [n]  start positions, sorted by the first `sorted_depth` tokens
    manifest.json       format version, tokenizer fingerprint (model name, vocab size, vocab
                        sha256), counts, sorted_depth, source files

The suffix array is built by prefix doubling with numpy (log2(sorted_depth) argsort rounds over
int64 keys, ~1 GB of temporaries per 25M tokens = ~100 MB of text). It is sorted only by the
first `sorted_depth` tokens: lookups only ever ask for patterns that short, and full sorting
costs a round per doubling of the longest repeat (duplicate documents make that huge).

Ordering convention: a suffix that ends (array end) sorts before everything, a separator (-1)
before every token; Python list comparison of `tokens[s:s + m].tolist()` against a pattern
follows the same order, which is what the binary search relies on.

CLI: `specdec datastore build FILES... -o DIR --model NAME` (add_datastore_arguments / run_datastore).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from .files import check_output_dir, open_output_dir

FORMAT_VERSION = 1
SEPARATOR = -1  # between documents: no match or continuation crosses it
DEFAULT_SORTED_DEPTH = 64
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".jsonl", ".json")
_CHUNK_CHARS = 1 << 20  # tokenize long plain-text files in ~1 MB pieces cut at line ends
_BATCH_CHARS = 8 << 20  # ~8 MB of text per tokenizer call


class DatastoreError(ValueError):
    """A datastore that cannot be built or used (missing, empty, wrong tokenizer, bad files)."""


# ----------------------------------------------------------------------------- tokenizer identity


def tokenizer_fingerprint(tokenizer) -> dict:
    """What must match between a datastore and a target: vocabulary size and a hash of the vocab."""
    vocab = tokenizer.get_vocab()  # token string -> id (added tokens included)
    by_id = sorted(vocab.items(), key=lambda item: item[1])
    digest = hashlib.sha256(json.dumps(by_id, ensure_ascii=False).encode("utf-8")).hexdigest()
    return {"vocab_size": len(vocab), "vocab_sha256": digest}


# ----------------------------------------------------------------------------- suffix array


def build_suffix_array(tokens: np.ndarray, sorted_depth: int = DEFAULT_SORTED_DEPTH, progress=None) -> np.ndarray:
    """int32 [n] start positions sorted by their first `sorted_depth` tokens (prefix doubling).

    tokens: int [n], ids >= 0 or SEPARATOR. `progress(step)` is called after each round.
    """
    if sorted_depth < 1:
        raise ValueError(f"sorted_depth must be >= 1, got {sorted_depth}")
    num_tokens = len(tokens)
    if num_tokens == 0:
        return np.zeros(0, dtype=np.int32)
    # rank 0 = "past the end", 1 = separator, token id + 2 otherwise
    rank = tokens.astype(np.int64) + 2  # [n]
    suffix_array = np.argsort(rank, kind="stable")
    sorted_by = 1  # rank orders suffixes by their first `sorted_by` tokens
    while sorted_by < sorted_depth:
        next_rank = np.zeros(num_tokens, dtype=np.int64)  # [n] rank of the suffix `sorted_by` later
        next_rank[: num_tokens - sorted_by] = rank[sorted_by:]
        key = rank * (int(rank.max()) + 1) + next_rank  # < (n + 2)^2: fits int64 for any real corpus
        del next_rank
        suffix_array = np.argsort(key, kind="stable")
        sorted_key = key[suffix_array]
        del key
        # new rank = 1 + number of distinct keys before (kept >= 1 so 0 still means past the end)
        new_rank_sorted = np.empty(num_tokens, dtype=np.int64)
        new_rank_sorted[0] = 1
        np.cumsum(sorted_key[1:] != sorted_key[:-1], out=new_rank_sorted[1:])
        new_rank_sorted[1:] += 1
        del sorted_key
        rank[suffix_array] = new_rank_sorted
        distinct = int(new_rank_sorted[-1])
        del new_rank_sorted
        sorted_by *= 2
        if progress is not None:
            progress(1)
        if distinct == num_tokens:  # every suffix already unique: fully sorted
            break
    return suffix_array.astype(np.int32 if num_tokens < 2**31 else np.int64)


def num_sort_rounds(sorted_depth: int) -> int:
    """Prefix-doubling rounds needed to sort by `sorted_depth` tokens (upper bound)."""
    rounds, depth = 0, 1
    while depth < sorted_depth:
        depth, rounds = depth * 2, rounds + 1
    return rounds


# ----------------------------------------------------------------------------- the datastore


class Datastore:
    """A memory-mapped token corpus with a suffix array: find where a token pattern occurs."""

    def __init__(self, tokens: np.ndarray, suffix_array: np.ndarray, manifest: dict, path: Path | None = None):
        self.tokens = tokens  # int32 [n]
        self.suffix_array = suffix_array  # int32 [n]
        self.manifest = manifest
        self.path = path
        self.sorted_depth = int(manifest.get("sorted_depth", DEFAULT_SORTED_DEPTH))

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def open(cls, path: str | os.PathLike) -> Datastore:
        """Memory-map a datastore directory written by build_datastore (clear errors otherwise)."""
        directory = Path(path).expanduser()
        if not directory.is_dir():
            raise DatastoreError(
                f"datastore directory {directory} does not exist; build one with "
                "`specdec datastore build FILES... -o DIR --model NAME`"
            )
        manifest_path = directory / "manifest.json"
        required = ("manifest.json", "tokens.npy", "suffix_array.npy")
        missing = [name for name in required if not (directory / name).is_file()]
        if missing:
            raise DatastoreError(f"{directory} is not a datastore: missing {', '.join(missing)}")
        try:
            manifest = json.loads(manifest_path.read_text())
        except json.JSONDecodeError as error:
            raise DatastoreError(f"{manifest_path} is not valid JSON: {error}") from error
        if manifest.get("format_version") != FORMAT_VERSION:
            raise DatastoreError(
                f"{directory}: datastore format {manifest.get('format_version')!r}, this specdec reads "
                f"format {FORMAT_VERSION}; rebuild it"
            )
        tokens = np.load(directory / "tokens.npy", mmap_mode="r")
        suffix_array = np.load(directory / "suffix_array.npy", mmap_mode="r")
        if len(tokens) == 0 or int(manifest.get("num_tokens", 0)) == 0:
            raise DatastoreError(f"datastore {directory} is empty (no tokens): rebuild it from non-empty text files")
        if len(suffix_array) != len(tokens) or len(tokens) != manifest["num_tokens"]:
            raise DatastoreError(
                f"datastore {directory} is inconsistent: {len(tokens)} tokens, {len(suffix_array)} suffix-array "
                f"entries, manifest says {manifest['num_tokens']}; rebuild it"
            )
        return cls(tokens, suffix_array, manifest, directory)

    def check_tokenizer(self, tokenizer, target_name: str = "the target") -> None:
        """Raise DatastoreError unless the datastore was built with this tokenizer's vocabulary."""
        built_with = self.manifest.get("tokenizer", {})
        have = tokenizer_fingerprint(tokenizer)
        if built_with.get("vocab_sha256") != have["vocab_sha256"] or built_with.get("vocab_size") != have["vocab_size"]:
            raise DatastoreError(
                f"datastore {self.path} was built with the tokenizer of {built_with.get('model')!r} "
                f"(vocab size {built_with.get('vocab_size')}, sha256 {str(built_with.get('vocab_sha256'))[:12]}), "
                f"but {target_name} uses a different one (vocab size {have['vocab_size']}, sha256 "
                f"{have['vocab_sha256'][:12]}); rebuild it with `specdec datastore build ... --model {target_name}`"
            )

    def _prefix(self, start: int, length: int) -> list[int]:
        return self.tokens[start : start + length].tolist()

    def find(self, pattern: Sequence[int]) -> tuple[int, int]:
        """Suffix-array range [lo, hi) of the suffixes that start with `pattern` (binary search)."""
        pattern = [int(token) for token in pattern]
        length = len(pattern)
        if not 1 <= length <= self.sorted_depth:
            raise ValueError(
                f"pattern length must be in [1, {self.sorted_depth}] (the datastore's sorted_depth), got {length}"
            )
        suffix_array, size = self.suffix_array, len(self.suffix_array)
        lo, hi = 0, size
        while lo < hi:  # first suffix whose prefix >= pattern
            mid = (lo + hi) // 2
            if self._prefix(int(suffix_array[mid]), length) < pattern:
                lo = mid + 1
            else:
                hi = mid
        first, hi = lo, size
        while lo < hi:  # first suffix whose prefix > pattern
            mid = (lo + hi) // 2
            if self._prefix(int(suffix_array[mid]), length) <= pattern:
                lo = mid + 1
            else:
                hi = mid
        return first, lo

    def count(self, pattern: Sequence[int]) -> int:
        lo, hi = self.find(pattern)
        return hi - lo

    def occurrences(self, pattern: Sequence[int]) -> np.ndarray:
        """Sorted start positions of every occurrence of `pattern` (int64 [k])."""
        lo, hi = self.find(pattern)
        return np.sort(np.asarray(self.suffix_array[lo:hi], dtype=np.int64))

    def continuations(self, starts: np.ndarray, length: int) -> np.ndarray:
        """int64 [k, length]: tokens from each start, SEPARATOR-padded past a document's or the corpus' end."""
        offsets = starts[:, None] + np.arange(length)[None, :]  # [k, length]
        inside = offsets < len(self.tokens)
        rows = np.where(inside, np.asarray(self.tokens[np.minimum(offsets, len(self.tokens) - 1)]), SEPARATOR)
        after_separator = np.cumsum(rows == SEPARATOR, axis=1) > 0  # nothing after a document end
        return np.where(after_separator, SEPARATOR, rows).astype(np.int64)


# ----------------------------------------------------------------------------- building


def _texts_of_json(record, field: str | None) -> Iterator[str]:
    """The text of one JSON record: `field` if given, else "text", else every string in it."""
    if field is not None:
        value = record.get(field) if isinstance(record, dict) else None
        if value is None:
            return
        record = value
    elif isinstance(record, dict) and isinstance(record.get("text"), str):
        record = record["text"]
    if isinstance(record, str):
        yield record
    elif isinstance(record, dict):
        for value in record.values():
            yield from _texts_of_json(value, None)
    elif isinstance(record, list):
        for value in record:
            yield from _texts_of_json(value, None)


def iter_documents(path: Path, field: str | None = None) -> Iterator[tuple[str, int]]:
    """(text, bytes consumed) pieces of one file: JSONL/JSON records, or plain text in ~1 MB chunks.

    Consecutive chunks of one plain-text file belong to the same document."""
    suffix = path.suffix.lower()
    with open(path, encoding="utf-8", errors="replace") as handle:
        if suffix == ".jsonl":
            for line_number, line in enumerate(handle, 1):
                size = len(line.encode("utf-8", errors="replace"))
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise DatastoreError(f"{path}:{line_number}: not a JSON line ({error})") from error
                yield "\n".join(_texts_of_json(record, field)), size
        elif suffix == ".json":
            text = handle.read()
            try:
                records = json.loads(text)
            except json.JSONDecodeError as error:
                raise DatastoreError(f"{path}: not valid JSON ({error})") from error
            records = records if isinstance(records, list) else [records]
            for record in records:
                yield "\n".join(_texts_of_json(record, field)), 0
            yield "", len(text.encode("utf-8", errors="replace"))
        else:
            while True:
                chunk = handle.read(_CHUNK_CHARS)
                if not chunk:
                    break
                chunk += handle.readline()  # end the piece at a line end
                yield chunk, len(chunk.encode("utf-8", errors="replace"))


def expand_inputs(inputs: Iterable[str | os.PathLike]) -> list[Path]:
    """Files as given, directories expanded to their text files (sorted); clear errors otherwise."""
    files: list[Path] = []
    for item in inputs:
        path = Path(item).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
            if not found:
                raise DatastoreError(f"directory {path} has no text files ({', '.join(TEXT_SUFFIXES)})")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise DatastoreError(f"input {path} does not exist")
    if not files:
        raise DatastoreError("no input files given")
    return files


def build_datastore(
    inputs: Sequence[str | os.PathLike],
    output_dir: str | os.PathLike,
    tokenizer,
    model_name: str,
    field: str | None = None,
    sorted_depth: int = DEFAULT_SORTED_DEPTH,
    progress: bool = True,
) -> Datastore:
    """Tokenize text files with `tokenizer` and write tokens + suffix array + manifest to `output_dir`.

    .jsonl: one document per line (its "text" field, or `field`, or all its strings);
    .json: a record or a list of records; anything else: one plain-text document per file.
    """
    from tqdm.auto import tqdm

    files = expand_inputs(inputs)
    total_bytes = sum(path.stat().st_size for path in files)
    pieces: list[np.ndarray] = []
    num_documents = 0
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", disable=not progress) as bar:
        for path in files:
            file_pieces: list[np.ndarray] = []
            plain_text = path.suffix.lower() not in (".jsonl", ".json")
            batch: list[str] = []

            def flush() -> None:
                if batch:  # one call per batch: fast tokenizers encode a batch in parallel
                    encoded = tokenizer(batch, add_special_tokens=False)["input_ids"]
                    file_pieces.extend(np.asarray(ids, dtype=np.int32) for ids in encoded)
                    batch.clear()

            batch_chars = 0
            for text, size in iter_documents(path, field):
                if text:
                    batch.append(text)
                    batch_chars += len(text)
                    if len(batch) >= 256 or batch_chars >= _BATCH_CHARS:  # bounds the Python-int lists
                        flush()
                        batch_chars = 0
                bar.update(size)
            flush()
            # a plain-text file is one document; each JSON record is its own document
            documents = [np.concatenate(file_pieces)] if plain_text and file_pieces else file_pieces
            for document in documents:
                if len(document):
                    pieces.extend((document, np.array([SEPARATOR], dtype=np.int32)))
                    num_documents += 1
    if not pieces:
        raise DatastoreError(f"no text found in {', '.join(map(str, files))}: the datastore would be empty")
    tokens = np.concatenate(pieces[:-1])  # [n] (no trailing separator)
    del pieces
    vocab_limit = len(tokenizer.get_vocab())
    if int(tokens.max()) >= vocab_limit:
        raise DatastoreError(f"tokenizer produced id {int(tokens.max())} outside its vocabulary of {vocab_limit}")
    with tqdm(total=num_sort_rounds(sorted_depth), desc="suffix array", unit="round", disable=not progress) as bar:
        suffix_array = build_suffix_array(tokens, sorted_depth, progress=bar.update)
        bar.update(bar.total - bar.n)  # rounds skipped once all suffixes were distinct
    manifest = {
        "format_version": FORMAT_VERSION,
        "tokenizer": {"model": model_name, **tokenizer_fingerprint(tokenizer)},
        "num_tokens": int(len(tokens)),
        "num_documents": num_documents,
        "sorted_depth": sorted_depth,
        "separator": SEPARATOR,
        "sources": [str(path) for path in files],
    }
    return write_datastore(output_dir, tokens, suffix_array, manifest)


def write_datastore(output_dir, tokens: np.ndarray, suffix_array: np.ndarray, manifest: dict) -> Datastore:
    """Write the three files (manifest last, so a half-written directory never opens) and open it."""
    directory = open_output_dir(output_dir, "datastore", flag="--output")
    (directory / "manifest.json").unlink(missing_ok=True)
    np.save(directory / "tokens.npy", tokens.astype(np.int32))
    np.save(directory / "suffix_array.npy", suffix_array)
    temporary = directory / "manifest.json.tmp"
    temporary.write_text(json.dumps(manifest, indent=2))
    temporary.replace(directory / "manifest.json")
    return Datastore.open(directory)


# ----------------------------------------------------------------------------- CLI


def add_datastore_arguments(subparsers) -> argparse.ArgumentParser:
    """Add `datastore build FILES... -o DIR --model NAME` and `datastore info DIR`; func = run_datastore."""
    parser = subparsers.add_parser("datastore", help="build or inspect a retrieval datastore for the rest drafter")
    actions = parser.add_subparsers(dest="datastore_command", required=True)
    build = actions.add_parser("build", help="tokenize text files and build a suffix-array datastore")
    build.add_argument("files", nargs="+", help=".txt/.md files, .jsonl (one document per line), .json, or directories")
    build.add_argument("-o", "--output", required=True, help="datastore directory to write")
    build.add_argument(
        "--model", required=True, help="target model (registry name, HF dir or .gguf) whose tokenizer to use"
    )
    build.add_argument("--field", default=None, help='JSON field holding the text (default: "text", else every string)')
    build.add_argument(
        "--sorted-depth", type=int, default=DEFAULT_SORTED_DEPTH,
        help=f"sort suffixes by this many tokens; the longest usable match (default {DEFAULT_SORTED_DEPTH})",
    )
    info = actions.add_parser("info", help="print a datastore's manifest")
    info.add_argument("directory")
    parser.set_defaults(func=run_datastore)
    return parser


def load_tokenizer(model: str, progress: bool = True):
    """Just the tokenizer of a registry model / HF dir / .gguf (no weights are loaded)."""
    from transformers import AutoTokenizer

    from .models.registry import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(model, progress=progress))


def run_datastore(args: argparse.Namespace) -> int:
    """Execute a parsed `datastore` command; returns the process exit code."""
    if args.datastore_command == "info":
        store = Datastore.open(args.directory)
        print(json.dumps(store.manifest, indent=2))
        return 0
    if args.sorted_depth < 1:
        raise DatastoreError(f"--sorted-depth must be >= 1, got {args.sorted_depth}")
    check_output_dir(args.output, "datastore", flag="--output")  # before the tokenizer loads
    tokenizer = load_tokenizer(args.model)
    store = build_datastore(
        args.files, args.output, tokenizer, args.model, field=args.field, sorted_depth=args.sorted_depth
    )
    print(f"{store.path}: {len(store)} tokens from {store.manifest['num_documents']} documents")
    return 0
