"""Merge policies: how a replica takes in the outer step of a fragment (Alg. 2, l.12).

Streaming DiLoCo overlaps a fragment's exchange with τ inner steps and then mixes the
new global parameters into each replica, `θ_m ← α·θ_m + (1 − α)·θ_g` (`alpha_merge`,
the default). Eager updates (Kale et al., 2025) use the overlap differently: right
after sending, a replica applies the outer step it can compute alone, with its own
outer gradient standing in for the average that has not arrived, and when the
average arrives it swaps that stand-in for the real step, keeping the inner steps it
took meanwhile (`eager`).

Both are plug-ins (`plugins`): their `on_arrival` takes in the outer step, and
Eager's `after_send` applies its stand-in. Eager keeps one array per replica and
parameter (the stand-in), in the algorithm's `plugin_state`, so it is checkpointed,
restored and sharded like the replicas, and a replica that comes back from a
failure starts it again from θ_g.
"""

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool

from .compression.base import compute_dtype
from .inner import replicate
from .participation import where_replicas
from .plugins import Plugin, pieces, scatter_senders


class AlphaMerge(Plugin):
    """The paper's merge, `θ_m ← α·θ_m + (1 − α)·θ_g` (Streaming DiLoCo Alg. 2, l.12).

    Where the fragment's outer gradient was not finite, the replica is restored to
    θ_g. Each stacked leaf is merged one row at a time, in place (`Visit.update`).

    Attributes:
        alpha: the mixing factor α in [0, 1] (0: take θ_g, as DiLoCo does).
    """

    alpha: float = eqx.field(default=0.5, static=True)
    merges = True

    def __check_init__(self):
        if isinstance(self.alpha, bool) or not 0 <= self.alpha <= 1:
            raise ValueError(f"alpha={self.alpha!r}; must be in [0, 1].")

    def on_arrival(self, arrival, replicas, state):
        """`merge`: α-mix where due, θ_g where the outer gradient failed."""

        def mix(r, g):
            due = arrival.due.reshape((-1,) + (1,) * g.ndim)
            return merge(r, arrival.fetch(g), due, arrival.ok, self.alpha)

        return arrival.visit.update(replicas, arrival.global_, mix, 1), state


class Eager(Plugin):
    """Eager updates in the streaming form: a stand-in outer step at the send, the
    real one swapped in on arrival (Kale et al., 2025).

    At the send of fragment p, replica m sets its pieces of p to `θ̃_m`, the outer
    step from θ_g with its own outer gradient in place of the average (the outer
    optimizer's state as it is, not advanced), and remembers `θ̃_m`. It trains τ
    inner steps from there. When the average arrives and θ_g takes the real step,
    `θ_m ← θ_m − θ̃_m + θ_g` (computed in float32 or wider): the stand-in is replaced
    by the real step and the inner progress since the send is kept. Where the outer
    gradient was not finite, the replica is restored to θ_g. A replica that does not
    send keeps its pieces, and its stand-in is θ_g (it applied none). With τ = 0
    this is α = 0; with M = 1 the stand-in is the real step and the correction is
    zero.

    This differs from the Eager paper in:
    1. The stand-in is the replica's own outer gradient alone (the text of this
       form: "its own outer gradient as a stand-in"), not the paper's one-outer-step
       mix of its fresh gradient with the others' previous ones.
    2. The one-outer-step form (τ = H) is not offered: docs/decisions.md says why.
    """

    merges = True

    def init(self, params, num_replicas, num_fragments):
        """The stand-ins, θ_g on every replica."""
        del num_fragments
        return replicate(params, num_replicas)

    def after_send(self, send, sent, own, replicas, state):
        """Every sender takes its stand-in step, and remembers it."""
        del sent
        stand = send.standin(own)
        replicas = scatter_senders(send, replicas, stand)
        if send.sends is not None:  # a replica not sending: its stand-in is θ_g
            mask, leaves = send.sends, send.visit.group.leaves
            dtypes = [replicas[i].dtype for i in leaves]
            g = replicate(send.global_, mask.shape[0])
            stand = [
                where_replicas(mask, x, y.astype(d))
                for x, y, d in zip(stand, g, dtypes)
            ]
        return replicas, send.visit.scatter(state, stand, axis=1)

    def on_arrival(self, arrival, replicas, state):
        """`θ_m − θ̃_m + θ_g` where due (θ_g where the outer gradient failed)."""
        v = arrival.visit
        new = []
        own, stand = pieces(arrival, replicas), pieces(arrival, state)
        for r, s, g in zip(own, stand, v.gather(arrival.global_)):
            wide = compute_dtype(r.dtype)
            g = jnp.broadcast_to(arrival.fetch(g)[None], r.shape)
            fixed = r.astype(wide) - s.astype(wide) + g.astype(wide)
            fixed = jnp.where(arrival.ok, fixed.astype(r.dtype), g)
            due = arrival.due.reshape((-1,) + (1,) * (r.ndim - 1))
            new.append(jnp.where(due, fixed, r))
        return v.scatter(replicas, new, axis=1), state


def merge(
    replica: Array,
    global_: Array,
    due: Bool[Array, "..."],
    ok: Bool[Array, "..."],
    alpha: float,
) -> Array:
    """The α-merge of one leaf: `θ_m ← α·θ_m + (1 − α)·θ_g` where due (Alg. 2, l.12).

    Where the fragment's outer gradient was not finite (`ok` false) the replica is
    restored to θ_g instead (a failed round). α = 0 returns θ_g exactly and α = 1 leaves
    the replica bitwise untouched.

    Args:
        replica: the leaf of all replicas, `[M, ...]`.
        global_: the same leaf of θ_g, `[...]`.
        due: where each replica merges, broadcastable to `replica`.
        ok: where the outer gradient was finite, broadcastable to `global_`.
        alpha: the mixing factor α in [0, 1].
    """
    g = jnp.broadcast_to(global_[None], replica.shape)
    if alpha == 0:
        mixed = g
    elif alpha == 1:
        mixed = replica
    else:
        mixed = (alpha * replica + (1 - alpha) * g).astype(replica.dtype)
    new = jnp.where(ok[None], mixed, g)
    return jnp.where(due, new, replica)


def alpha_merge(alpha: float = 0.5) -> AlphaMerge:
    """The α-merge (the paper's; `streaming_diloco(alpha=...)` builds it)."""
    return AlphaMerge(alpha)


def eager() -> Eager:
    """Eager updates' merge (`streaming_diloco(plugins=eager())`)."""
    return Eager()
