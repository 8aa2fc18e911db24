"""Load an export with transformers' LlamaForCausalLM and compare its logits with our model's.

    python scripts/check_hf_export.py runs/tiny/checkpoints/200 [--batch 4] [--tol 1e-4]

Exports STEP_DIR (a step directory or a checkpoint root) into a temporary directory with
`resilient_jax.checkpoint.export`, loads it with `LlamaForCausalLM.from_pretrained` on the CPU in
float32, runs both models on the same random tokens (data.seq_len long) and prints the max
absolute difference of the logits; exit 1 above --tol. Needs torch and transformers, which are
not dependencies of resilient_jax: `pip install torch==2.13.0 transformers` into a venv.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step_dir")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tol", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        import torch
        import transformers
    except ImportError as e:
        print(f"error: {e.name} is not installed: pip install torch==2.13.0 transformers", file=sys.stderr)
        return 2

    from resilient_jax.checkpoint import export as export_lib
    from resilient_jax.checkpoint import reader
    from resilient_jax.config import from_dict
    from resilient_jax.state import make_model_def

    ckpt = reader.load(args.step_dir)
    cfg = from_dict(ckpt.config["config"])
    tokens = np.random.default_rng(args.seed).integers(0, cfg.model.vocab_size, (args.batch, cfg.data.seq_len),
                                                       dtype=np.int32)
    ours = np.asarray(make_model_def(cfg.model).forward(ckpt.weights, tokens))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "hf"
        export_lib.export(ckpt.path, out)
        model = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        with torch.no_grad():
            theirs = model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
    diff = float(np.abs(ours - theirs).max())
    print(f"checkpoint {ckpt.path} step {ckpt.step} (model.dtype {cfg.model.dtype}, "
          f"scan_layers {getattr(cfg.model, 'scan_layers', False)}): transformers {transformers.__version__}, "
          f"torch {torch.__version__}; logits {list(ours.shape)}, max |ours| {float(np.abs(ours).max()):.4g}, "
          f"max abs difference {diff:.3g} (tolerance {args.tol:g})")
    same_argmax = float((ours.argmax(-1) == theirs.argmax(-1)).mean())
    print(f"argmax agreement {same_argmax:.4f}")
    return 0 if diff <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
