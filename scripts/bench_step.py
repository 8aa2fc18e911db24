"""Step time of the resilient_jax trainer vs a hand-written minimal jit loop, side by side.

Same model, same batches, same optimizer, same mesh. The minimal loop is what a user would write
without this framework: one jitted `(params, opt_state, batch) -> (params, opt_state, loss)` with
XLA's own data-parallel reduction. The trainer's step is the real one (data loader, two-phase
compute/apply, per-shard finiteness check, loss readback). Rounds alternate between the two so
machine noise hits both alike; the ratio of medians is reported.

    python scripts/bench_step.py [--config configs/tiny.yaml] [--steps 30] [--rounds 5] [--set k=v ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_args import at_least, config_file, load_config_or_exit, refused_in_one_line  # noqa: E402  (a script next to this one)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=config_file,
                        default=str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"))
    parser.add_argument("--steps", type=at_least(1), default=30, help="steps per round")
    parser.add_argument("--rounds", type=at_least(1), default=5)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    load_config_or_exit(parser, args.config, args.overrides)  # a typo is one line, not a traceback

    from resilient_jax.config import load_config
    from resilient_jax.train import setup_devices

    results = {}
    # The runs' directories go with the script, whether it ends or fails.
    with tempfile.TemporaryDirectory(prefix="bench-step-") as work, refused_in_one_line(parser):
        for reduction in ("native", "invariant"):
            cfg = load_config(args.config, [*args.overrides, f"parallel.reduction={reduction}", "run.progress=quiet",
                                            f"run.dir={work}/{reduction}"])
            setup_devices(cfg)
            results[reduction] = bench(cfg, args.steps, args.rounds)
    report = {
        "config": args.config,
        "overrides": args.overrides,
        "minimal_loop_step_s": results["native"]["minimal"],
        "trainer_native_step_s": results["native"]["trainer"],
        "trainer_invariant_step_s": results["invariant"]["trainer"],
        "ratio_trainer_native_vs_minimal": results["native"]["trainer"] / results["native"]["minimal"],
        "ratio_trainer_invariant_vs_minimal": results["invariant"]["trainer"] / results["invariant"]["minimal"],
    }
    json.dump(report, sys.stdout, indent=2)
    print()


def bench(cfg, steps: int, rounds: int) -> dict[str, float]:
    import jax
    import numpy as np
    import optax

    from resilient_jax import mesh as mesh_lib
    from resilient_jax import rng
    from resilient_jax import state as state_lib
    from resilient_jax.metrics import MetricsLog
    from resilient_jax.trainer import RunTotals, Trainer

    trainer = Trainer(cfg)
    log = MetricsLog(Path(cfg.run.dir), steps, progress="quiet", enabled=False)

    # -- the trainer's own step ----------------------------------------------------------------
    state = state_lib.init_state(trainer.model_def, trainer.tx, trainer.mesh, cfg.train.seed)
    loader = trainer.open_loader(start_step=0)
    totals = RunTotals()
    step_counter = [0]

    def trainer_steps(n: int) -> float:
        nonlocal state
        t0 = time.perf_counter()
        for _ in range(n):
            k = step_counter[0]
            result = trainer.compute_finite(state.params, loader, k, totals, log)
            state, _ = trainer.apply(state, result.grads, np.int32(k))
            float(result.loss)
            step_counter[0] += 1
        return (time.perf_counter() - t0) / n

    # -- the minimal loop: same model/optimizer/mesh, XLA's data parallelism ---------------------
    model_def, tx, mesh = trainer.model_def, trainer.tx, trainer.mesh
    shardings = trainer.shardings
    batch_sharding = mesh_lib.batch_sharding(mesh)
    use_dropout = cfg.model.dropout > 0

    def minimal_step(params, opt_state, tokens, weights, step):
        def loss_fn(p):
            key = rng.dropout_key(cfg.train.seed, step, 0) if use_dropout else None
            logits = model_def.forward(p, tokens[:, :-1], dropout_key=key)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
            return jnp_sum(ce * weights) / jnp_sum(weights)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    import jax.numpy as jnp

    jnp_sum = jnp.sum
    minimal = jax.jit(
        minimal_step,
        in_shardings=(shardings.params, shardings.opt_state, batch_sharding, batch_sharding, None),
        out_shardings=(shardings.params, shardings.opt_state, mesh_lib.replicated(mesh)),
        donate_argnums=(0, 1),
    )
    mstate = state_lib.init_state(model_def, tx, mesh, cfg.train.seed)
    m_params, m_opt = mstate.params, mstate.opt_state
    batch_loader = trainer.open_loader(start_step=0)
    batches = [next(batch_loader) for _ in range(steps)]
    batch_loader.close()
    placed = [(jax.device_put(b.tokens, batch_sharding), jax.device_put(b.weights, batch_sharding)) for b in batches]

    def minimal_steps(n: int) -> float:
        nonlocal m_params, m_opt
        t0 = time.perf_counter()
        for i in range(n):
            tokens, weights = placed[i % len(placed)]
            m_params, m_opt, loss = minimal(m_params, m_opt, tokens, weights, np.int32(i))
            float(loss)  # the same per-step readback the trainer does
        return (time.perf_counter() - t0) / n

    trainer_steps(2)  # compile
    minimal_steps(2)
    t_times, m_times = [], []
    for _ in range(rounds):
        t_times.append(trainer_steps(steps))
        m_times.append(minimal_steps(steps))
    loader.close()
    return {"trainer": statistics.median(t_times), "minimal": statistics.median(m_times)}


if __name__ == "__main__":
    main()
