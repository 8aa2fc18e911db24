"""Tokenizers by spec: `bytes` (and other registered names), `hf:PATH`, `sp:PATH`.

A tokenizer turns documents (UTF-8 bytes) into 1-D integer arrays of token ids in [0, vocab_size).
- `bytes`     one token per byte, vocab 256, no file (the default)
- `hf:PATH`   a Hugging Face `tokenizers` tokenizer.json (needs the `tokenizers` package)
- `sp:PATH`   a sentencepiece `.model` (needs the `sentencepiece` package)
- any name added with `register_tokenizer`

Each tokenizer has a `kind` (what the manifest records as `tokenizer`: "bytes", "hf", "sp" or the
registered name -- never a path, so the dataset version is the same on every machine) and a
`sha256`: of the tokenizer file for hf/sp, of the kind's name for file-less ones. The sha256 is in
the manifest and in the checkpoint's data position, so a dataset or resume with another tokenizer
is refused naming both hashes. `encode_batch` encodes many documents at once; the hf and sp
tokenizers run it on all cores (Rust / C++ threads), with the same ids whatever the thread count.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from resilient_jax.data.errors import DatasetError, option


class Tokenizer(Protocol):
    name: str  # the kind recorded in the manifest
    vocab_size: int
    sha256: str

    def encode_batch(self, docs: Sequence[bytes]) -> list[np.ndarray]:
        """Token ids of each document, any integer dtype, values in [0, vocab_size)."""
        ...


def _name_sha256(name: str) -> str:
    return hashlib.sha256(f"resilient_jax.tokenizer:{name}".encode()).hexdigest()


class ByteTokenizer:
    """One token per byte (vocab 256): no training, no files, identical on every machine."""

    name = "bytes"
    vocab_size = 256
    sha256 = _name_sha256("bytes")

    def encode(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8)

    def encode_batch(self, docs: Sequence[bytes]) -> list[np.ndarray]:
        return [self.encode(d) for d in docs]


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer.json; special tokens are not added (no BOS/EOS)."""

    name = "hf"

    def __init__(self, path: Path):
        tokenizers = _import("tokenizers", "hf")
        data = _read(path)
        try:
            self._tok = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
        except Exception as e:  # the Rust parser raises its own exception type
            raise DatasetError(f"tokenizer file {path} does not parse as a Hugging Face tokenizer.json "
                               f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); pass a tokenizer.json "
                               "saved by tokenizers.Tokenizer.save") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.sha256 = hashlib.sha256(data).hexdigest()

    def encode_batch(self, docs: Sequence[bytes]) -> list[np.ndarray]:
        texts = [d.decode("utf-8", errors="ignore") for d in docs]  # a max_bytes cut may split a character
        return [np.asarray(e.ids, np.int64) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(map(int, ids)), skip_special_tokens=False)


class SentencePieceTokenizer:
    """A sentencepiece `.model`; no BOS/EOS added."""

    name = "sp"

    def __init__(self, path: Path):
        spm = _import("sentencepiece", "sp")
        data = _read(path)
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(data)
        except Exception as e:
            raise DatasetError(f"tokenizer file {path} does not parse as a sentencepiece .model ({e}); "
                               "pass a model written by sentencepiece's trainer") from None
        self.vocab_size = self._sp.get_piece_size()
        self.sha256 = hashlib.sha256(data).hexdigest()

    def encode_batch(self, docs: Sequence[bytes]) -> list[np.ndarray]:
        ids = self._sp.encode([d.decode("utf-8", errors="ignore") for d in docs], num_threads=-1)
        return [np.asarray(i, np.int64) for i in ids]

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode(list(map(int, ids)))


def _import(module: str, prefix: str):
    try:
        return __import__(module)
    except ImportError:
        raise DatasetError(f"{option('--tokenizer')} {prefix}:PATH needs the {module!r} package, which is not installed; "
                           f"pip install 'resilient_jax[data]' (or {module})") from None


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise DatasetError(f"cannot read tokenizer file {path} ({e.strerror}); check the path after hf:/sp:") from None


_FILE_KINDS: dict[str, Callable[[Path], Tokenizer]] = {"hf": HFTokenizer, "sp": SentencePieceTokenizer}
_REGISTRY: dict[str, Callable[[], Tokenizer]] = {"bytes": ByteTokenizer}


class _SingleDocAdapter:
    """Gives a registered tokenizer with only `encode(bytes)` the batch interface and a sha256."""

    def __init__(self, inner, name: str):
        self._inner = inner
        self.name = getattr(inner, "name", name)
        self.vocab_size = inner.vocab_size
        self.sha256 = getattr(inner, "sha256", None) or _name_sha256(self.name)

    def encode_batch(self, docs: Sequence[bytes]) -> list[np.ndarray]:
        return [np.asarray(self._inner.encode(d)) for d in docs]


def register_tokenizer(name: str, factory: Callable[[], Tokenizer]) -> None:
    """Makes `factory()` available as `--tokenizer name`; re-registering a name replaces it.

    The factory's object needs `name`, `vocab_size` and `encode(bytes)` or `encode_batch(docs)`."""
    _REGISTRY[name] = factory


def known_tokenizers() -> list[str]:
    return sorted(_REGISTRY) + [f"{kind}:PATH" for kind in _FILE_KINDS]


def get_tokenizer(spec: str) -> Tokenizer:
    kind, sep, path = spec.partition(":")
    if sep and kind in _FILE_KINDS:
        return _FILE_KINDS[kind](Path(path).expanduser())
    if spec not in _REGISTRY:
        raise DatasetError(f"unknown tokenizer {spec!r}; known tokenizers: {', '.join(known_tokenizers())}")
    tok = _REGISTRY[spec]()
    return tok if hasattr(tok, "encode_batch") and hasattr(tok, "sha256") else _SingleDocAdapter(tok, spec)
