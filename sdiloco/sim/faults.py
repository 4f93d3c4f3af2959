"""Faults in what a replica sends: one replica turns bad (a plug-in).

`sim.chaos` decides who takes part in a step; this decides what a bad replica
sends when it does. `bad_replica(kind)` is a `plugins.Plugin` whose `before_send`
replaces replica `replica`'s outer gradient, at every send, by:

- `"sign"`: `−Δ` (a sign-flipped update);
- `"scale"`: `10·Δ` (`factor`);
- `"noise"`: Gaussian noise with the norm of Δ over the fragment (seeded per
  send: a counter in the plug-in's state);
- `"nan"`: NaN everywhere.

The replica keeps training honestly on its own data; only its message lies. Put it
in `streaming_diloco(plugins=...)` (or `StreamingConfig.plugins`) beside an
aggregator to measure what the aggregator does about it (`robust_aggregation`).
"""

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr

from ..plugins import Plugin


KINDS = ("sign", "scale", "noise", "nan")


class BadReplica(Plugin):
    """Replica `replica` sends a corrupted outer gradient (see the module).

    Attributes:
        kind: one of `KINDS`.
        replica: which replica turns bad.
        factor: the scale of `"scale"`.
        seed: the seed of `"noise"`.
    """

    kind: str = eqx.field(static=True)
    replica: int = eqx.field(default=0, static=True)
    factor: float = eqx.field(default=10.0, static=True)
    seed: int = eqx.field(default=0, static=True)

    def __check_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"bad_replica kind={self.kind!r}; allowed: {KINDS}.")
        if isinstance(self.replica, bool) or self.replica < 0:
            raise ValueError(
                f"bad_replica replica={self.replica!r}; allowed: a replica index >= 0."
            )

    def init(self, params, num_replicas, num_fragments):
        """A count of the sends, per replica (the noise's seed)."""
        del params, num_fragments
        if self.replica >= num_replicas:
            raise ValueError(
                f"bad_replica replica={self.replica}; allowed: 0 ... "
                f"{num_replicas - 1} (M={num_replicas})."
            )
        return jnp.zeros((num_replicas,), jnp.int32)

    def before_send(self, send, deltas, state):
        k = self.replica
        bad = [self._corrupt(send, i, deltas, state[k]) for i in range(len(deltas))]
        deltas = [d.at[k].set(b.astype(d.dtype)) for d, b in zip(deltas, bad)]
        return deltas, state.at[k].add(1)

    def _corrupt(self, send, i, deltas, count):
        """Piece i of the bad replica's message."""
        delta = deltas[i][self.replica]
        if self.kind == "sign":
            return -delta
        if self.kind == "scale":
            return self.factor * delta
        if self.kind == "nan":
            return jnp.full_like(delta, jnp.nan)
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(d[self.replica])) for d in deltas))
        size = sum(d[self.replica].size for d in deltas)
        key = jr.fold_in(jr.fold_in(jr.key(self.seed), count), send.visit.p)
        key = jr.fold_in(key, i)
        noise = jr.normal(key, delta.shape, delta.dtype)
        return noise * (norm / jnp.sqrt(jnp.asarray(size, norm.dtype)))


def bad_replica(
    kind: str, replica: int = 0, *, factor: float = 10.0, seed: int = 0
) -> BadReplica:
    """A plug-in that makes replica `replica` send a corrupted outer gradient."""
    return BadReplica(kind, replica, factor, seed)
