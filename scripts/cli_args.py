"""Argument checks the benchmark scripts share. A typo is refused by argparse (one `error:` line
naming the flag, exit 2) before any run starts -- not found minutes later, after the compiles, as an
empty median, a division by zero, a traceback or a file that cannot be written."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def at_least(minimum: int):
    """An argparse `type` for an int >= `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def config_file(text: str) -> str:
    """An argparse `type` for --config: the file as an absolute path -- yours, against your current
    directory, if it is there, else the repository's (configs/tiny.yaml from anywhere), as
    scripts/soak.py reads it. Absolute because the scripts start their runs in the repository
    (cwd=REPO), where a relative path of yours names another file or none."""
    path = Path(text).expanduser()
    candidates = dict.fromkeys([path.resolve(), (REPO / path).resolve()])  # one, from the repository
    for candidate in candidates:
        if candidate.is_file():
            return str(candidate)
    raise argparse.ArgumentTypeError(f"no such file: {' nor '.join(map(str, candidates))}; name a YAML config, "
                                     "e.g. configs/tiny.yaml")


def comma_list(choices):
    """An argparse `type` for a comma-separated list of `choices`, at least one."""

    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        unknown = [item for item in items if item not in choices]
        if unknown or not items:
            what = f"unknown {', '.join(unknown)}" if unknown else "empty"
            raise argparse.ArgumentTypeError(f"{what}; choose from {', '.join(choices)} (comma-separated)")
        return items

    return parse


def layouts(devices: int):
    """An argparse `type` for comma-separated DATAxFSDP meshes (2x4,8x1) -> [(2, 4), (8, 1)]: positive
    sizes whose product fits the `devices` emulated CPU devices (a larger mesh fails to build)."""

    def parse(text: str) -> list[tuple[int, int]]:
        out = []
        for item in text.split(","):
            match = re.fullmatch(r"(\d+)x(\d+)", item.strip(), re.ASCII)
            sizes = (int(match[1]), int(match[2])) if match else (0, 0)
            if 0 in sizes:
                raise argparse.ArgumentTypeError(f"{item!r} is not DATAxFSDP with positive sizes, e.g. 2x4")
            if sizes[0] * sizes[1] > devices:
                raise argparse.ArgumentTypeError(f"{item.strip()} needs {sizes[0] * sizes[1]} devices, more than "
                                                 f"the {devices} emulated; e.g. 2x4")
            out.append(sizes)
        return out

    return parse


def load_config_or_exit(parser: argparse.ArgumentParser, config, overrides=()):
    """load_config(config, overrides), or argparse's one error line (exit 2) naming the bad key,
    value or file: checked before the runs, not when the first run -- minutes later, or in a child
    process whose error the script reports as a traceback -- reads it."""
    from resilient_jax.config import ConfigError, load_config

    try:
        return load_config(config, list(overrides))
    except ConfigError as e:
        parser.error(str(e))


@contextlib.contextmanager
def refused_in_one_line(parser: argparse.ArgumentParser):
    """A mistake that only shows once the devices exist or the dataset is read -- a mesh larger than
    the devices, a data.src that is not there -- as argparse's one error line (exit 2), as
    `python -m resilient_jax.train` says it, not a traceback after the imports."""
    from resilient_jax.config import ConfigError
    from resilient_jax.data.errors import DatasetError

    try:
        yield
    except (ConfigError, DatasetError) as e:
        parser.error(str(e))


def output_file(parser: argparse.ArgumentParser, flag: str, text: str) -> Path:
    """`text` as an absolute path whose directory exists and is writable, else one error line: the
    file is written at the end, after the runs."""
    out = Path(text).expanduser().resolve()
    if out.is_dir():
        parser.error(f"{flag} {out} is a directory; name a file, e.g. {out / 'out.png'}")
    if not out.parent.is_dir():
        parser.error(f"{flag} {out}: the directory {out.parent} does not exist; create it or name a file in "
                     "an existing directory")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        parser.error(f"{flag} {out}: cannot write in {out.parent}; name a file in a directory you can write")
    return out


def output_dir(parser: argparse.ArgumentParser, flag: str, text: str) -> Path:
    """`text` as an absolute path to a directory that is, or can be made (its nearest existing parent
    is a writable directory), else one error line: it is made and written at the end, after the runs."""
    out = Path(text).expanduser().resolve()
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        parser.error(f"{flag} {out}: {existing} is a file, not a directory; name a new or existing directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        parser.error(f"{flag} {out}: cannot write in {existing}; name a directory you can write")
    return out
