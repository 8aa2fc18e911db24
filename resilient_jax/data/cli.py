"""`python -m resilient_jax.data {prepare,verify,batch}`: build, check and inspect datasets.

Every DatasetError (and, as a last resort, any OSError, with its path) is printed as one `error: ...`
line on stderr with exit status 2, no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from resilient_jax.data.errors import DatasetError
from resilient_jax.data.manifest import load_manifest
from resilient_jax.data.order import GlobalOrder, QuarantineEvent, global_batch_ids, host_rows
from resilient_jax.data.prepare import DEFAULT_SEQ_LEN, DEFAULT_SHARDS, prepare_dataset, verify_dataset
from resilient_jax.data.sources import DEFAULT_SOURCE, FORMATS
from resilient_jax.data.tokenizer import known_tokenizers


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        args.run(args)
    except DatasetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a last resort: the expected failures are DatasetErrors that say what to do
        paths = " -> ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
        print(f"error: {paths + ': ' if paths else ''}{e.strerror or e}", file=sys.stderr)
        return 2
    return 0


def _prepare(args: argparse.Namespace) -> None:
    m = prepare_dataset(args.src, args.out, shards=args.shards, seq_len=args.seq_len,
                        tokenizer=args.tokenizer, max_bytes=args.max_bytes, fmt=args.format,
                        text_field=args.text_field)
    print(json.dumps({"root": str(m.root), "version": m.version, "records": m.num_records,
                      "shards": len(m.shards), "seq_len": m.seq_len, "tokenizer": m.tokenizer,
                      "tokenizer_sha256": m.tokenizer_sha256, "token_dtype": m.token_dtype}))


def _verify(args: argparse.Namespace) -> None:
    m = verify_dataset(args.dir)
    print(f"ok: {len(m.shards)} shards, {m.num_records} records, version {m.version}")


def _batch(args: argparse.Namespace) -> None:
    manifest = load_manifest(args.dataset)
    order = GlobalOrder.for_manifest(manifest, args.seed, args.global_batch, args.quarantine)
    lo, hi = host_rows(args.global_batch, args.hosts, args.host)
    ids = global_batch_ids(order, args.step)[lo:hi]
    print(json.dumps({
        "dataset_version": manifest.version,
        "seed": args.seed,
        "step": args.step,
        "epoch": order.epoch_at(args.step),
        "global_batch": args.global_batch,
        "hosts": args.hosts,
        "host": args.host,
        "rows": [lo, hi],
        "quarantine": [e.to_dict() for e in order.quarantine],
        "sample_ids": ids.tolist(),
        "shard_ids": manifest.shard_of(ids).tolist(),
    }))


def _quarantine_list(text: str) -> list[QuarantineEvent]:
    """'3,7@100' -> shard 3 from step 0, shard 7 from step 100."""
    events = []
    for item in filter(None, text.split(",")):
        shard, _, from_step = item.partition("@")
        try:
            events.append(QuarantineEvent(int(shard), int(from_step or 0)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad quarantine item {item!r}; use SHARD or SHARD@FROM_STEP") from None
    return events


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m resilient_jax.data", description=__doc__)
    sub = parser.add_subparsers(required=True, metavar="{prepare,verify,batch}")

    p = sub.add_parser("prepare", help="tokenize text, jsonl, parquet or HF datasets into ArrayRecord shards")
    p.add_argument("--src", required=True,
                   help=f"a directory of text files; a .jsonl or .parquet file or a directory of them; a Hugging "
                        f"Face save_to_disk directory; or {DEFAULT_SOURCE!r} (Python stdlib)")
    p.add_argument("--format", default="auto",
                   help=f"one of: {', '.join(FORMATS)} (default auto: from the extension / directory contents)")
    p.add_argument("--text-field", default="text", help="jsonl key / parquet or HF column holding the text")
    p.add_argument("--out", required=True, help="new dataset directory")
    p.add_argument("--shards", type=int, default=DEFAULT_SHARDS)
    p.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN)
    p.add_argument("--tokenizer", default="bytes",
                   help=f"one of: {', '.join(known_tokenizers())} (hf: a tokenizer.json, sp: a sentencepiece .model)")
    p.add_argument("--max-bytes", type=int, default=None,
                   help="cap on source bytes (default: all; 8 MiB for 'default')")
    p.set_defaults(run=_prepare)

    v = sub.add_parser("verify", help="re-hash every shard against manifest.json")
    v.add_argument("dir")
    v.set_defaults(run=_verify)

    b = sub.add_parser("batch", help="print the global sample ids of one step as JSON")
    b.add_argument("--dataset", required=True)
    b.add_argument("--seed", type=int, required=True)
    b.add_argument("--step", type=int, required=True)
    b.add_argument("--global-batch", type=int, required=True)
    b.add_argument("--hosts", type=int, default=1)
    b.add_argument("--host", type=int, default=0)
    b.add_argument("--quarantine", type=_quarantine_list, default=[], help="SHARD[@FROM_STEP],... e.g. 3,7@100")
    b.set_defaults(run=_batch)
    return parser
