"""Merge policies: how a replica takes in the outer step of a fragment (Alg. 2, l.12).

Streaming DiLoCo overlaps a fragment's exchange with τ inner steps and then mixes the
new global parameters into each replica, `θ_m ← α·θ_m + (1 − α)·θ_g` (`alpha_merge`,
the default). Eager updates (Kale et al., 2025) use the overlap differently: right
after sending, a replica applies the outer step it can compute alone, with its own
outer gradient standing in for the average that has not arrived, and when the
average arrives it swaps that stand-in for the real step, keeping the inner steps it
took meanwhile (`eager`).

A policy is an `eqx.Module` with static configuration and two hooks, each acting on
one fragment's pieces (one `[M, ...]` array per leaf the fragment touches):

* `on_send(replicas, standin, state)`, right after the replicas send the fragment:
  `standin()` computes, per replica, the fragment's parameters after an outer step
  on that replica's own outer gradient (what `eager` applies). Returns the replicas'
  new pieces and the policy's new state pieces. A policy whose `acts_on_send` is
  false is not called here.
* `on_arrival(replica, global_, due, ok, state)`, when the outer step arrives: the
  replica's new piece (where `due`), given θ_g after the step and whether the outer
  gradient was finite (`ok`; where it was not, a policy should restore θ_g).

A policy with state (`stateful`) keeps one array per replica and parameter, like the
parameters (`init`, from θ_g); it lives in the algorithm's state (`merge_state`), so
it is checkpointed, restored and sharded like the replicas, and a replica that comes
back from a failure gets `init`'s value again.
"""

from collections.abc import Callable

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool

from .compression.base import compute_dtype
from .outer import merge


class MergePolicy(eqx.Module):
    """How a replica takes in a fragment's outer step (see the module docstring)."""

    @property
    def acts_on_send(self) -> bool:
        """Whether `on_send` changes anything (False: the step skips it)."""
        return False

    @property
    def stateful(self) -> bool:
        """Whether the policy keeps per-replica state (`init`)."""
        return False

    def init(self, replica: Array) -> Array:
        """The state of one `[M, ...]` leaf, from θ_g broadcast to every replica."""
        return replica

    def on_send(
        self,
        replicas: list[Array],
        standin: Callable[[], list[Array]],
        state: list[Array] | None,
    ) -> tuple[list[Array], list[Array] | None]:
        """The replicas' pieces (and state) right after they sent the fragment."""
        del standin
        return replicas, state

    def on_arrival(
        self,
        replica: Array,
        global_: Array,
        due: Bool[Array, "..."],
        ok: Bool[Array, "..."],
        state: Array | None,
    ) -> tuple[Array, Array | None]:
        """A replica piece `[M, ...]` (and its state) once θ_g took the outer step."""
        raise NotImplementedError


class AlphaMerge(MergePolicy):
    """The paper's merge, `θ_m ← α·θ_m + (1 − α)·θ_g` (Streaming DiLoCo Alg. 2, l.12).

    Attributes:
        alpha: the mixing factor α in [0, 1] (0: take θ_g, as DiLoCo does).
    """

    alpha: float = eqx.field(default=0.5, static=True)

    def __check_init__(self):
        if isinstance(self.alpha, bool) or not 0 <= self.alpha <= 1:
            raise ValueError(f"alpha={self.alpha!r}; must be in [0, 1].")

    def on_arrival(self, replica, global_, due, ok, state):
        """`outer.merge`: α-mix where due, θ_g where the outer gradient failed."""
        return merge(replica, global_, due, ok, self.alpha), state


class Eager(MergePolicy):
    """Eager updates in the streaming form: a stand-in outer step at the send, the
    real one swapped in on arrival (Kale et al., 2025).

    At the send of fragment p, replica m sets its pieces of p to `θ̃_m`, the outer
    step from θ_g with its own outer gradient in place of the average (the outer
    optimizer's state as it is, not advanced), and remembers `θ̃_m`. It trains τ
    inner steps from there. When the average arrives and θ_g takes the real step,
    `θ_m ← θ_m − θ̃_m + θ_g` (computed in float32 or wider): the stand-in is replaced
    by the real step and the inner progress since the send is kept. Where the outer
    gradient was not finite, the replica is restored to θ_g. With τ = 0 this is
    α = 0; with M = 1 the stand-in is the real step and the correction is zero.

    This differs from the Eager paper in:
    1. The stand-in is the replica's own outer gradient alone (the text of this
       form: "its own outer gradient as a stand-in"), not the paper's one-outer-step
       mix of its fresh gradient with the others' previous ones.
    2. The one-outer-step form (τ = H) is not offered: docs/decisions.md says why.
    """

    @property
    def acts_on_send(self) -> bool:
        """True: the replica applies its stand-in at the send."""
        return True

    @property
    def stateful(self) -> bool:
        """True: the stand-in `θ̃_m` of each replica."""
        return True

    def on_send(self, replicas, standin, state):
        """Every replica takes its stand-in step, and remembers it."""
        del replicas, state
        stand = standin()
        return stand, stand

    def on_arrival(self, replica, global_, due, ok, state):
        """`θ_m − θ̃_m + θ_g` where due (θ_g where the outer gradient failed)."""
        assert state is not None  # a stateful policy: the core passes its state
        wide = compute_dtype(replica.dtype)
        g = jnp.broadcast_to(global_[None], replica.shape)
        fixed = replica.astype(wide) - state.astype(wide) + g.astype(wide)
        new = jnp.where(ok[None], fixed.astype(replica.dtype), g)
        return jnp.where(due, new, replica), state


MERGES = ("alpha", "eager")
"""The policies `streaming_diloco(merge=...)` builds by name."""


def merge_policy(merge: "str | MergePolicy", alpha: float) -> MergePolicy:
    """The policy `merge` names ("alpha": `AlphaMerge(alpha)`, "eager": `Eager()`),
    or `merge` itself when it is a `MergePolicy`."""
    if isinstance(merge, MergePolicy):
        return merge
    if merge == "alpha":
        return AlphaMerge(alpha)
    if merge == "eager":
        return Eager()
    raise ValueError(
        f"merge={merge!r}; allowed: one of {MERGES} or a sdiloco.MergePolicy."
    )
