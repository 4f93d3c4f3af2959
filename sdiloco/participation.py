"""Which replicas take part in a step: elastic training as data.

Replicas fail, straggle and come back. A step of every method takes an optional
`Participation` (three `[M]` bool arrays) as an input: changing who takes part never
recompiles, and a trace of them drives a whole run (`sdiloco.sim.chaos`).

- `alive[m]`: replica m exists at this step. A replica alive now but not at the
  previous step has come back: it *heals* before its inner step (it adopts θ_g for
  every fragment and a fresh copy of a live peer's inner optimizer state, or a reset
  one; see `streaming_diloco(heal=...)`). A replica that is not alive keeps its
  state untouched: it takes no inner step, sends nothing and merges nothing.
- `computes[m]`: it takes its inner step at this step (a straggler alive but behind
  skips steps). Implies alive.
- `sends[m]`: its outer gradient is part of the fragments sent at this step (a
  message that misses the round's grace window is left out). Implies alive.

A fragment's average is over the replicas that sent it (plain mean); a fragment sent
by no replica takes no outer step, like a failed round. Data-Parallel averages the
gradients of the replicas that compute.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Bool


class Participation(NamedTuple):
    """Which of the M replicas take part in one step (each field `[M]` bool)."""

    alive: Bool[Array, " M"]
    computes: Bool[Array, " M"]
    sends: Bool[Array, " M"]

    @staticmethod
    def of(
        alive: ArrayLike | list,
        computes: ArrayLike | list | None = None,
        sends: ArrayLike | list | None = None,
    ) -> "Participation":
        """A `Participation`; `computes` and `sends` default to `alive`.

        Raises:
            ValueError: a field that is not a 1-D bool array, fields of different
                lengths, or (for concrete values) a replica that computes or sends while
                not alive.
        """
        alive = jnp.asarray(alive)
        computes = alive if computes is None else jnp.asarray(computes)
        sends = alive if sends is None else jnp.asarray(sends)
        p = Participation(alive, computes, sends)
        check(p, alive.shape[0] if alive.ndim == 1 else -1)
        for name in ("computes", "sends"):
            value = getattr(p, name)
            if not (_concrete(value) and _concrete(alive)):
                continue
            if bool(jnp.any(value & ~alive)):
                raise ValueError(
                    f"Participation.{name}={value.tolist()} has a replica that is not "
                    f"alive (alive={alive.tolist()}); allowed: a subset of alive."
                )
        return p


def _concrete(x: Array) -> bool:
    """Whether `x` has a value now (not a tracer inside `jit`)."""
    try:
        x.__array__()
    except jax.errors.TracerArrayConversionError:
        return False
    return True


def everyone(num_replicas: int) -> Participation:
    """All M replicas alive, computing and sending."""
    ones = jnp.ones((num_replicas,), bool)
    return Participation(ones, ones, ones)


def check(p: Participation, num_replicas: int) -> None:
    """Shapes and dtypes (at trace time, before any compute).

    Raises:
        ValueError: naming the field, its shape and dtype, and what is allowed.
    """
    if not isinstance(p, Participation):
        raise ValueError(
            f"participation={p!r}; allowed: a sdiloco.participation.Participation "
            "(or None: every replica)."
        )
    for name, value in zip(p._fields, p):
        shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
        if shape != (num_replicas,) or dtype != jnp.bool_:
            raise ValueError(
                f"Participation.{name} has shape {shape} and dtype {dtype}; allowed: "
                f"shape ({num_replicas},) (M) and dtype bool."
            )


def where_replicas(mask: Bool[Array, " M"], new, old):
    """Per replica, `new` where `mask` and `old` elsewhere (array leaves with a
    leading M axis; other leaves from `new`)."""

    def pick(n, o):
        if not isinstance(n, jax.Array):
            return n
        return jnp.where(mask.reshape((-1,) + (1,) * (n.ndim - 1)), n, o)

    return jax.tree.map(pick, new, old)


def mean_over(values: Array, mask: Bool[Array, " M"] | None) -> Array:
    """Mean over the leading replica axis, over the replicas in `mask` (all: None)."""
    if mask is None:
        return jnp.mean(values, axis=0)
    mask = mask.reshape((-1,) + (1,) * (values.ndim - 1))
    total = jnp.sum(jnp.where(mask, values, 0), axis=0)
    return total / jnp.maximum(jnp.sum(mask), 1).astype(total.dtype)


def over_senders(mean: list[Array], count: Array, num_replicas: int) -> list[Array]:
    """An exchange's mean over M replicas, of which only `count` sent (the others
    sent zeros), as the mean over those that sent: times exactly 1.0 when all did,
    zero when none did."""
    n = jnp.maximum(count, 1)
    return [
        x * jnp.where(count > 0, num_replicas / n.astype(x.dtype), 0).astype(x.dtype)
        for x in mean
    ]


def token_weights(steps_since: Array, sends: Bool[Array, " M"] | None) -> Array:
    """`[M, P]` factors `M·w_m / Σ w`, `w_m` the inner steps replica m took since
    fragment p's last send (0 for a replica not sending; all 0 when Σ w = 0): scaling
    each Δ_m by them makes an exchange's mean over M the weighted mean."""
    w = steps_since.astype(jnp.float32)
    if sends is not None:
        w = jnp.where(sends[:, None], w, 0.0)
    total = jnp.sum(w, axis=0, keepdims=True)
    return jnp.where(total > 0, w.shape[0] * w / jnp.maximum(total, 1.0), 0.0)
