"""resilient_jax: a JAX/Flax multi-host training framework whose runs absorb faults.

The trajectory is a function of (config, dataset version, step), never of how many hosts are alive.
"""

__version__ = "0.1.0"


def fingerprint(tree) -> str:
    """sha256 over every leaf's bytes in sorted-path order (see resilient_jax.fingerprinting)."""
    from resilient_jax.fingerprinting import params_fingerprint

    return params_fingerprint(tree)
