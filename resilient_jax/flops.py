"""Model FLOPs, device peaks and MFU: how much of the hardware a run's throughput uses.

Model FLOPs per token (the PaLM appendix B convention, training = forward + backward):

    6 * N_matmul + 12 * n_layers * d_model * seq_len

N_matmul counts the parameters that take part in a matrix multiply -- every weight except the
input embedding table (a gather) and the RMSNorm scales -- so the unembedding counts; each costs
2 FLOPs per token forward and 4 backward. The second term is attention's two sequence-length
products (Q.K^T and P.V: 2 * 2 * seq_len * d_model per layer forward, x3 with the backward). The
causal mask is applied to a full L x L score matrix here, so the full product is what runs.
Recomputed steps (a quarantined shard re-read) and the optimizer are not model FLOPs.

MFU = achieved model FLOP/s / (peak FLOP/s per device x devices). Peaks are dense tensor-core
figures from the vendors' data sheets; float32 matmuls run as TF32 by default on these GPUs
(JAX's default matmul precision). Any other device (CPU) has no known peak: MFU is None unless
`run.peak_flops` gives one.
"""

from __future__ import annotations

from collections.abc import Sequence

from resilient_jax.config import ModelConfig

# device_kind substring -> {compute dtype: dense peak FLOP/s per device}. First match wins, so the
# more specific names come first.
PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H200", {"bfloat16": 989e12, "float32": 494.5e12}),
    ("H100 PCIe", {"bfloat16": 756e12, "float32": 378e12}),
    ("H100", {"bfloat16": 989e12, "float32": 494.5e12}),
    ("A100", {"bfloat16": 312e12, "float32": 156e12}),
)


def matmul_params(model: ModelConfig) -> int:
    """Parameters that enter a matrix multiply (see the module docstring)."""
    d, f, v = model.d_model, model.d_ff, model.vocab_size
    per_layer = 4 * d * d + 3 * d * f  # q, k, v, o projections; gate, up, down
    return model.n_layers * per_layer + d * v  # + the unembedding


def flops_per_token(model: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), the formula in the module docstring."""
    return 6.0 * matmul_params(model) + 12.0 * model.n_layers * model.d_model * seq_len


def dense_flops_per_token(num_params: int) -> float:
    """A model of your own (model.factory): 6 FLOPs per parameter per token, its sequence-length
    terms (attention, recurrences) unknown -- so MFU is an estimate there."""
    return 6.0 * num_params


def peak_flops(device_kind: str, dtype: str, override: float = 0.0) -> float | None:
    """Dense peak FLOP/s of one device for matmuls in `dtype`; `override` (run.peak_flops) wins."""
    if override > 0:
        return float(override)
    for name, peaks in PEAK_FLOPS:
        if name.lower() in device_kind.lower():
            return peaks.get(dtype)
    return None


def mfu(flops_per_second: float | None, peak_per_device: float | None, devices: int) -> float | None:
    if not flops_per_second or not peak_per_device or devices < 1:
        return None
    return flops_per_second / (peak_per_device * devices)


def device_memory_in_use(devices: Sequence) -> int | None:
    """Bytes in use on the busiest local device, where the backend reports it (None on CPU)."""
    in_use = []
    for device in devices:
        try:
            stats = device.memory_stats()
        except (NotImplementedError, RuntimeError):
            stats = None
        if stats and "bytes_in_use" in stats:
            in_use.append(int(stats["bytes_in_use"]))
    return max(in_use) if in_use else None
