"""Tokenizers by name: a small registry so `prepare --tokenizer NAME` stays pluggable.

A tokenizer turns the raw bytes of one source file into a 1-D integer array of token ids in
[0, vocab_size). The manifest records the tokenizer's name and vocab size, so a dataset prepared
with one tokenizer is never silently read as another.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from resilient_jax.data.errors import DatasetError


class Tokenizer(Protocol):
    name: str
    vocab_size: int

    def encode(self, data: bytes) -> np.ndarray:
        """Token ids of `data`, any integer dtype, values in [0, vocab_size)."""
        ...


class ByteTokenizer:
    """One token per byte (vocab 256): no training, no files, identical on every machine."""

    name = "bytes"
    vocab_size = 256

    def encode(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8)


_REGISTRY: dict[str, Callable[[], Tokenizer]] = {"bytes": ByteTokenizer}


def register_tokenizer(name: str, factory: Callable[[], Tokenizer]) -> None:
    """Makes `factory()` available as `--tokenizer name`; re-registering a name replaces it."""
    _REGISTRY[name] = factory


def known_tokenizers() -> list[str]:
    return sorted(_REGISTRY)


def get_tokenizer(name: str) -> Tokenizer:
    if name not in _REGISTRY:
        raise DatasetError(
            f"unknown tokenizer {name!r}; known tokenizers: {', '.join(known_tokenizers())}"
        )
    return _REGISTRY[name]()
