"""`python -m resilient_jax.checkpoint inspect|verify|export PATH` -- built on the framework-free reader.

    inspect PATH [--brief] [--json]   the seven fields: step, topology, commit, and every array's
                                      shape, dtype and bytes (read from the manifest)
    verify PATH [--deep]              the crc32c of every file a restore reads (against the commit
                                      manifest), the context fields' sha256, and a structural
                                      restore dry-run (shapes, dtypes; no array allocated); --deep
                                      also decodes every array; exit 2 naming each corrupt file
    export PATH --format safetensors --out DIR
                                      the weights as DIR/model.safetensors + DIR/config.json (the
                                      built-in LM in the Hugging Face Llama layout; see export.py)

PATH is a step directory or a checkpoint root (its newest step). No JAX is imported, so both run
in about a second on any machine with numpy and tensorstore. Exit codes: 0 ok, 2 a problem (one
line per problem on stderr, no traceback), 141 the reader closed the pipe (`inspect DIR | head`;
nothing printed on stderr).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from resilient_jax.checkpoint import commit, reader
from resilient_jax.checkpoint.export import ExportError, cmd_export
from resilient_jax.checkpoint.reader import ARRAY_FIELDS, CONTEXT_FIELDS, CheckpointError

BROKEN_PIPE_EXIT = 141  # 128 + SIGPIPE: what a shell tool reports when its reader closed the pipe


def _short(sha: str | None, n: int = 12) -> str:
    return sha[:n] if sha else "-"


def field_digest(step_dir: Path, name: str) -> str:
    """One digest per array field: sha256 over the sorted "path crc32c" lines of its committed files."""
    try:
        files = commit.read(step_dir)
    except commit.CommitError as e:  # a damaged commit manifest: one line naming it, as verify says
        raise reader.commit_problem(step_dir, e) from None
    lines = "".join(f"{rel} {e['crc32c']}\n" for rel, e in sorted(files.items()) if reader.field_of(rel) == name)
    return hashlib.sha256(lines.encode()).hexdigest()


def _context_summary(name: str, ctx: dict[str, Any]) -> str:
    if name == "rng":
        return f"seed {ctx['seed']}, {ctx['impl']}, next step {ctx['next_step']}"
    if name == "data":
        shards = sorted({q.get('shard') for q in ctx["quarantine"]})
        return (f"step {ctx['step']}, offset {ctx['global_offset']}, epoch {ctx['epoch']}, dataset "
                f"{_short(ctx['dataset_version'])}, quarantined shards {shards or 'none'}")
    if name == "config":
        return f"hash {_short(ctx['hash'])}, {len(ctx['history'])} allowed change(s) recorded"
    if name == "topology":
        from resilient_jax.checkpoint.topology import describe

        return f"{describe(ctx)}, {len(ctx['history'])} change(s) recorded"
    if name == "provenance":
        dirty = " (dirty)" if ctx.get("dirty") else ""
        return (f"commit {_short(ctx['commit'])}{dirty}, version {ctx['version']}, source "
                f"{ctx.get('source', '?')}, {len(ctx['history'])} change(s) recorded")
    return ""


def describe_checkpoint(step_dir: Path) -> dict[str, Any]:
    missing = reader.missing_field(step_dir)
    if missing:
        raise CheckpointError(step_dir, *missing)
    manifest = reader.read_manifest(step_dir)
    context = reader.read_context(step_dir, manifest)
    fields = []
    for name in ARRAY_FIELDS:
        entries = manifest["arrays"][name]
        fields.append({"field": name, "kind": "arrays", "arrays": len(entries),
                       "bytes": sum(e["bytes"] for e in entries.values()), "sha256": field_digest(step_dir, name),
                       "summary": f"{sum(int(_prod(e['shape'])) for e in entries.values())} elements"})
    for name in CONTEXT_FIELDS:
        text = reader.context_file(step_dir, name).read_bytes()
        fields.append({"field": name, "kind": "json", "arrays": None, "bytes": len(text),
                       "sha256": manifest["context_sha256"][name], "summary": _context_summary(name, context[name])})
    return {"path": str(step_dir), "step": manifest["step"], "format_version": manifest["format_version"],
            "fields": fields, "arrays": {name: manifest["arrays"][name] for name in ARRAY_FIELDS},
            "context": context}


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def cmd_inspect(path: str, brief: bool, as_json: bool) -> int:
    info = describe_checkpoint(reader.resolve(path))
    if as_json:
        print(json.dumps(info, indent=2, sort_keys=True))
        return 0
    print(f"checkpoint {info['path']}  step {info['step']}  format_version {info['format_version']}")
    rows = [["field", "kind", "arrays", "bytes", "sha256", "summary"]]
    for f in info["fields"]:
        rows.append([f["field"], f["kind"], "-" if f["arrays"] is None else str(f["arrays"]), str(f["bytes"]),
                     _short(f["sha256"]), f["summary"]])
    print(_table(rows))
    if not brief:
        rows = [["field", "array", "shape", "dtype", "bytes"]]
        for name in ARRAY_FIELDS:
            for array, e in info["arrays"][name].items():
                rows.append([name, array, "x".join(map(str, e["shape"])) or "scalar", e["dtype"], str(e["bytes"])])
        print()
        print(_table(rows))
    return 0


def cmd_verify(path: str, deep: bool) -> int:
    step_dir = reader.resolve(path)
    problems = reader.verify(step_dir, deep=deep)
    if problems:
        hint = _older_step_hint(step_dir)
        for i, problem in enumerate(problems):
            print(f"error: {problem}{hint if i == len(problems) - 1 else ''}", file=sys.stderr)
        return 2
    manifest = reader.read_manifest(step_dir)
    arrays = sum(len(manifest["arrays"][name]) for name in ARRAY_FIELDS)
    files = len(commit.read(step_dir))
    print(f"ok: checkpoint {step_dir} step {manifest['step']}: 7 fields, {arrays} arrays, {files} files, all crc32c "
          f"match, restore dry-run ok{', every array decoded' if deep else ''}")
    return 0


def _older_step_hint(step_dir: Path) -> str:
    older = reader.newest_complete(step_dir.parent, below=int(step_dir.name)) if step_dir.name.isdigit() else None
    if older is None:
        return "; no older committed step to resume from"
    return f"; resume from the older step {older} (--resume {step_dir.parent / str(older)}) after verifying it"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m resilient_jax.checkpoint", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_inspect = sub.add_parser("inspect", help="show the seven fields and every array")
    p_inspect.add_argument("path")
    p_inspect.add_argument("--brief", action="store_true", help="fields only, no per-array table")
    p_inspect.add_argument("--json", action="store_true", help="machine-readable output")
    p_verify = sub.add_parser("verify", help="check every file and a restore dry-run; exit 2 on corruption")
    p_verify.add_argument("path")
    p_verify.add_argument("--deep", action="store_true", help="also read and decode every array")
    p_export = sub.add_parser("export", help="write the weights as safetensors + config.json")
    p_export.add_argument("path")
    p_export.add_argument("--format", default="safetensors", help="safetensors (the only one so far)")
    p_export.add_argument("--out", required=True, help="a new or empty directory")
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            code = cmd_inspect(args.path, args.brief, args.json)
        elif args.command == "export":
            code = cmd_export(args.path, args.format, args.out)
        else:
            code = cmd_verify(args.path, args.deep)
        sys.stdout.flush()  # here, not at exit, so that a closed pipe is caught below
        return code
    except BrokenPipeError:
        # The reader went away (`inspect DIR | head -1`): stop quietly, as `cat` would. Point stdout
        # at /dev/null so the interpreter's final flush does not complain either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE_EXIT
    except (CheckpointError, ExportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e.filename or args.path}: {e.strerror or e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
