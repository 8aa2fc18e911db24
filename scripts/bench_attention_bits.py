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
import typing
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEVICES = 8  # emulated CPU devices: every layout must fit them
sys.path.insert(0, str(REPO / "scripts"))
from cli_args import at_least, comma_list, layouts, load_config_or_exit  # noqa: E402  (a script next to this one)


def main() -> None:
    from resilient_jax.config import ModelConfig

    forms = typing.get_args(typing.get_type_hints(ModelConfig)["attention"])  # model.attention's values
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=at_least(1), default=10)
    parser.add_argument("--layouts", type=layouts(DEVICES), default="8x1,4x1,2x1,1x1,4x2,2x4,1x8",
                        help="comma-separated data x fsdp meshes")
    parser.add_argument("--chunk", type=at_least(1), default=16,
                        help="model.attention_chunk for the chunked form (tiny's seq_len 64: 4 blocks)")
    parser.add_argument("--forms", type=comma_list(forms), default=",".join(forms))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()

    def form_config(attention: str, data: int, fsdp: int, run_dir: str):
        return load_config_or_exit(parser, REPO / "configs" / "tiny.yaml", [
            *args.overrides, f"model.attention={attention}",
            f"model.attention_chunk={args.chunk}", "model.dropout=0", "parallel.reduction=invariant",
            f"parallel.data={data}", f"parallel.fsdp={fsdp}", f"train.steps={args.steps}",
            f"train.log_every={args.steps}", "run.progress=quiet", "checkpoint.enabled=false",
            f"run.dir={run_dir}"])

    # Every config, before the first run: a --set typo, or a --chunk that does not divide data.seq_len,
    # would otherwise stop the script only when its form's turn comes, after the forms before it trained.
    for attention in args.forms:
        for data, fsdp in args.layouts:
            form_config(attention, data, fsdp, "unused")

    import jax

    jax.config.update("jax_num_cpu_devices", DEVICES)
    from resilient_jax.trainer import Trainer

    report: dict = {"steps": args.steps, "overrides": args.overrides, "chunk": args.chunk}
    # The runs' directories go with the script, whether it ends or fails.
    with tempfile.TemporaryDirectory(prefix="attn-bits-") as work:
        for attention in args.forms:
            fingerprints = {}
            for data, fsdp in args.layouts:
                cfg = form_config(attention, data, fsdp, f"{work}/{attention}-{data}x{fsdp}")
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
