"""The one exception type of the data package, and how its messages name a setting.

Every bad input (missing or damaged files, impossible batch geometry, unknown tokenizer, a
quarantine that leaves nothing to read) raises `DatasetError` with a single line that names the
file or key at fault and says what to do. The CLI prints it as `error: ...` and exits 2.

The same source checks run for `python -m resilient_jax.data prepare --format ...` and for a
training run that builds its dataset from `data.format` in its config. A message names the setting
the way its reader set it: `option("--format")` is `--format` by default and `data.format` inside
`named_as_config_keys()` (trainer.resolve_dataset), so a user who never ran `prepare` is not told
to pass one of its flags.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

# prepare's flag -> the config key that sets the same thing when a run builds its dataset.
CONFIG_KEYS = {
    "--src": "data.src",
    "--format": "data.format",
    "--text-field": "data.text_field",
    "--tokenizer": "data.tokenizer",
    "--shards": "data.shards",
    "--seq-len": "data.seq_len",
}

_config_keys = contextvars.ContextVar("resilient_jax_data_config_keys", default=False)


class DatasetError(ValueError):
    """A dataset, its files or a data-order request is unusable; the message says why and how to fix it."""


@contextlib.contextmanager
def named_as_config_keys() -> Iterator[None]:
    """Messages raised inside name settings by their config keys (`data.format`), not prepare's flags."""
    token = _config_keys.set(True)
    try:
        yield
    finally:
        _config_keys.reset(token)


def option(flag: str) -> str:
    """`flag` as the reader set it: the flag itself, or its config key inside named_as_config_keys()."""
    return CONFIG_KEYS[flag] if _config_keys.get() else flag


def give(flag: str, value: str) -> str:
    """The instruction to set `flag` to `value`: `pass --format jsonl` or `set data.format=jsonl`."""
    return f"set {CONFIG_KEYS[flag]}={value}" if _config_keys.get() else f"pass {flag} {value}"
