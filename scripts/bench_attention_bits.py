"""Are jax.nn.dot_product_attention's bits stable across device layouts? Measured, next to the explicit form.

For each `model.attention` (explicit, dot_product, chunked with --chunk query rows per block) the tiny config trains --steps steps in
`reduction: invariant` (dropout off: dot_product has no attention-probability dropout) on each
(data x fsdp) layout of the 8 emulated CPU devices, and the params fingerprints are compared. A form
whose fingerprint is the same on every layout is bitwise stable; one whose fingerprints differ is
not (then the invariant mode cannot use it). Prints JSON.

    python scripts/bench_attention_bits.py [--steps 10] [--layouts 8x1,4x1,2x1,1x1,4x2,2x4,1x8] [--chunk 16]
                                           [--forms explicit,dot_product,chunked]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layouts", default="8x1,4x1,2x1,1x1,4x2,2x4,1x8")
    parser.add_argument("--chunk", type=int, default=16,
                        help="model.attention_chunk for the chunked form (tiny's seq_len 64: 4 blocks)")
    parser.add_argument("--forms", default="explicit,dot_product,chunked")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    from resilient_jax.config import load_config
    from resilient_jax.trainer import Trainer

    layouts = [tuple(int(x) for x in item.split("x")) for item in args.layouts.split(",")]
    report: dict = {"steps": args.steps, "overrides": args.overrides, "chunk": args.chunk}
    for attention in args.forms.split(","):
        fingerprints = {}
        for data, fsdp in layouts:
            cfg = load_config(REPO / "configs" / "tiny.yaml", [
                *args.overrides, f"model.attention={attention}",
                f"model.attention_chunk={args.chunk}", "model.dropout=0", "parallel.reduction=invariant",
                f"parallel.data={data}", f"parallel.fsdp={fsdp}", f"train.steps={args.steps}",
                f"train.log_every={args.steps}", "run.progress=quiet", "checkpoint.enabled=false",
                f"run.dir={tempfile.mkdtemp(prefix='attn-bits-')}"])
            print(f"{attention} {data}x{fsdp}", file=sys.stderr, flush=True)
            summary = Trainer(cfg, devices=jax.devices()[: data * fsdp]).run()
            fingerprints[f"{data}x{fsdp}"] = {"fingerprint": summary["params_fingerprint"],
                                              "final_loss": summary["final_loss"]}
        distinct = {v["fingerprint"] for v in fingerprints.values()}
        report[attention] = {"layouts": fingerprints, "distinct_fingerprints": len(distinct),
                             "bitwise_stable": len(distinct) == 1}
    json.dump(report, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
