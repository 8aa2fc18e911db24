"""Logical names for activations: the model says what each dim of an activation is
(`constrain(x, ("batch", "length", "heads", "kv"))`), the framework says what that means on the
mesh. Outside a step that sets rules (a plain forward pass, a model used on its own) it is a no-op,
so the model never sees a mesh.

Why: inside the step's shard_map, `data` and `fsdp` are manual and `tensor` (when > 1) is left to
GSPMD, whose sharding propagation picks how to split each matmul from the whole program around
it. Pinning the activations to the logical rules (resilient_jax.mesh.LOGICAL_RULES: heads and mlp
over `tensor`, the rest whole) makes that choice the same in every program -- Megatron-style
tensor parallelism, whatever the data x fsdp layout -- so the bits do not depend on the layout.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator, Sequence

import jax

Rule = Callable[[jax.Array, Sequence[str | None]], jax.Array]

_RULE: contextvars.ContextVar[Rule | None] = contextvars.ContextVar("resilient_jax_activation_rule", default=None)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """`x` with one logical name per dim, constrained as the active rule says (else unchanged)."""
    rule = _RULE.get()
    return x if rule is None else rule(x, names)


@contextlib.contextmanager
def rule(fn: Rule | None) -> Iterator[None]:
    """Models traced inside this block constrain their activations with `fn` (None: not at all)."""
    token = _RULE.set(fn)
    try:
        yield
    finally:
        _RULE.reset(token)
