#!/usr/bin/env bash
# Tokens/s and MFU of gpu-1b-shaped training on one GPU (4 of its 16 layers, so it fits one device
# with room to spare), native vs invariant, and the cost of the deterministic-ops XLA flags.
# Three runs, each in its own process with the environment resilient_jax.gpu_env gives a worker:
#   native                 XLA picks the fastest kernels
#   native_deterministic   + --xla_gpu_deterministic_ops --xla_gpu_exclude_nondeterministic_ops
#   invariant              always deterministic (gpu_env refuses invariant without the flags)
# First, on the GPU: a gradient sum's channel (resilient_jax/fsdp.py) returns exactly the bits its
# backward pass wrote, through the scanned, rematerialised model (tests/test_fsdp.py; checked on
# CPU in CI, here on the GPU's own compiler).
# Budget: <= 5 minutes on one H100/H200 (3 compiles of a 4-layer 1B-wide model + 12 steps each).
# Prints one JSON report (section "throughput" of scripts/bench_scale.py) on stdout.
#
#   scripts/gpu_check.sh              on the machine's first GPU
#   scripts/gpu_check.sh --cpu-smoke  the same Python path, tiny, on one CPU device (no GPU needed)
#   extra arguments go to bench_scale.py, e.g. --throughput-layers 8 --peak-flops 989e12
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
if [[ -x .venv/bin/python && "${PYTHON}" == python ]]; then
  PYTHON=.venv/bin/python
fi

smoke=0
for arg in "$@"; do
  [[ "${arg}" == --cpu-smoke ]] && smoke=1
done

if [[ "${smoke}" == 0 ]]; then
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "error: no nvidia-smi: this check needs a GPU (use --cpu-smoke to run the same path on CPU)" >&2
    exit 2
  fi
  # One GPU: the 1-device program of gpu-1b's widths (see section_throughput).
  export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2
fi

if [[ "${smoke}" == 0 ]]; then
  if "${PYTHON}" -c "import pytest" 2>/dev/null; then
    "${PYTHON}" -m pytest -q -p no:cacheprovider tests/test_fsdp.py -k channel_returns_exactly >&2
  else
    echo "note: pytest is not installed (pip install -e '.[test]'): the channel check is skipped" >&2
  fi
fi

limit=300
[[ "${smoke}" == 1 ]] && limit=1200  # a shared 2-core CPU box is slow; the 5 minutes are the GPU budget
exec timeout "${limit}" "${PYTHON}" scripts/bench_scale.py --sections throughput "$@"
