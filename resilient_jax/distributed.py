"""Static multi-process start-up: join a fixed-size JAX world described by environment variables.

    RESILIENT_JAX_COORDINATOR=127.0.0.1:PORT  RESILIENT_JAX_NUM_PROCESSES=N  RESILIENT_JAX_PROCESS_ID=i

Used by tests and by hand to run one training job as N processes on one machine (or N hosts). The
elastic runtime (resilient_jax.elastic) re-forms worlds of changing size; this is the fixed case.
"""

from __future__ import annotations

import os

ENV_COORDINATOR = "RESILIENT_JAX_COORDINATOR"
ENV_NUM_PROCESSES = "RESILIENT_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "RESILIENT_JAX_PROCESS_ID"


def initialize_from_env() -> bool:
    """Join the world named by the environment; False when it names none (single process)."""
    address = os.environ.get(ENV_COORDINATOR)
    if not address:
        return False
    import jax

    try:
        num_processes = int(os.environ[ENV_NUM_PROCESSES])
        process_id = int(os.environ[ENV_PROCESS_ID])
    except (KeyError, ValueError):
        raise ValueError(
            f"{ENV_COORDINATOR} is set, so {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} must be integers too"
        ) from None
    jax.distributed.initialize(address, num_processes=num_processes, process_id=process_id)
    return True
