"""The sync schedule of Streaming DiLoCo: pure integer maths, traced inside jit.

Fragment p is **sent** at every step `t = f_p + k·H` (k ≥ 0); what was sent at step `s`
is **received** by replica m at step `s + τ_m` (Alg. 2, l.6 and l.9). The global
parameters take their outer step at the earliest arrival `s + min_m τ_m`
(docs/contract.md §1, step 3).
Steps are 1-based: the first training step is t = 1.
"""

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Int


NEVER = -1
"""The `sent_at` value of a fragment that has never been sent."""


def default_first_send(sync_every: int, num_fragments: int) -> tuple[int, ...]:
    """First-send steps `f_p = H + round(p·H/P)` spread evenly over one period.

    Rounding is half-up (`floor(x + 1/2)`), so the result does not depend on Python's
    banker's rounding. With H = 100 and P = 2 this gives (100, 150): the paper's example
    (§2.2: fragments sync at 100, 200, … and 150, 250, …).

    Examples:
        >>> default_first_send(100, 2)
        (100, 150)
        >>> default_first_send(10, 4)
        (10, 13, 15, 18)
    """
    h, n = sync_every, num_fragments
    return tuple(h + (2 * p * h + n) // (2 * n) for p in range(n))


@dataclasses.dataclass(frozen=True)
class Schedule:
    """When each fragment is sent and when it is received.

    Attributes:
        sync_every: H, the number of inner steps between two sends of one fragment.
        first_send: f_p for each fragment p (any value >= 1).
        overlap: τ_m for each replica m (0 <= τ_m < H).
    """

    sync_every: int
    first_send: tuple[int, ...]
    overlap: tuple[int, ...]

    def __post_init__(self):
        h = self.sync_every
        if not isinstance(h, int | np.integer) or h < 1:
            raise ValueError(f"sync_every (H)={h!r}; must be an integer >= 1.")
        for name, values in (
            ("first_send", self.first_send),
            ("overlap", self.overlap),
        ):
            if not values or not all(isinstance(v, int | np.integer) for v in values):
                raise ValueError(
                    f"{name}={values!r}; must be a non-empty tuple of ints."
                )
        bad = [f for f in self.first_send if f < 1]
        if bad:
            raise ValueError(
                f"first_send={self.first_send}: steps {bad} are < 1; every first-send "
                "step must be >= 1 (steps are 1-based)."
            )
        bad = [t for t in self.overlap if not 0 <= t < h]
        if bad:
            raise ValueError(
                f"overlap (tau)={self.overlap}: values {bad} are outside [0, H={h}); a "
                "fragment must arrive before it is sent again (tau < H)."
            )

    @property
    def num_fragments(self) -> int:
        """P."""
        return len(self.first_send)

    @property
    def num_replicas(self) -> int:
        """M (the length of `overlap`)."""
        return len(self.overlap)

    @property
    def min_overlap(self) -> int:
        """τ_min: a fragment's outer step is at `sent + τ_min`, its earliest arrival."""
        return min(self.overlap)

    def sent(self, t: Int[ArrayLike, ""]) -> Bool[ArrayLike, " P"]:
        """Which fragments are sent at step t (Alg. 2, l.6): `t >= f_p`, `H | t - f_p`.

        A traced step gives a jax array; a host int (the courier's loop) a NumPy one.
        """
        if isinstance(t, jax.Array):
            f = jnp.asarray(self.first_send, dtype=t.dtype)
            return (t >= f) & ((t - f) % self.sync_every == 0)
        t, f = np.asarray(t), np.asarray(self.first_send, dtype=np.int64)
        return (t >= f) & ((t - f) % self.sync_every == 0)

    def in_flight(
        self, t: Int[ArrayLike, ""], sent_at: Int[ArrayLike, " P"]
    ) -> Bool[ArrayLike, " P"]:
        """Which fragments are in flight at t: sent, their outer step (at
        `sent_at + τ_min`) still to come. jax or NumPy, as its arguments."""
        xp = jnp if isinstance(t, jax.Array) else np
        t, sent_at = xp.asarray(t), xp.asarray(sent_at)
        return (sent_at != NEVER) & (t < sent_at + self.min_overlap)

    def outer_due(
        self, t: Int[Array, ""], sent_at: Int[Array, " P"]
    ) -> Bool[Array, " P"]:
        """Which fragments take their outer step at t: the earliest arrival."""
        tau = jnp.asarray(self.min_overlap, dtype=t.dtype)
        return (sent_at != NEVER) & (t - sent_at == tau)

    def merge_due(
        self, t: Int[Array, ""], sent_at: Int[Array, " P"]
    ) -> Bool[Array, "M P"]:
        """Which fragments each replica m merges at t: `t = sent_at + τ_m` (Alg. 2, l.9)."""
        tau = jnp.asarray(self.overlap, dtype=t.dtype)[:, None]
        return (sent_at != NEVER)[None, :] & (t - sent_at[None, :] == tau)

    def arriving(
        self, t: Int[Array, ""], sent_at: Int[Array, " P"]
    ) -> Bool[Array, " P"]:
        """Which fragments some replica merges at t: `merge_due(t, sent_at)` reduced
        over the replicas, computed without a replica axis (under a mesh that splits
        the replicas, a reduction over them would be a collective)."""
        age = t - sent_at
        hit = functools.reduce(
            jnp.logical_or, [age == tau for tau in sorted(set(self.overlap))]
        )
        return (sent_at != NEVER) & hit


def make_schedule(
    sync_every: int,
    num_fragments: int,
    num_replicas: int,
    overlap: int | Sequence[int] = 0,
    first_send: Sequence[int] | None = None,
) -> Schedule:
    """Build and validate a `Schedule`.

    Args:
        sync_every: H >= 1.
        num_fragments: P >= 1.
        num_replicas: M >= 1.
        overlap: τ, one int for all replicas or one per replica (0 <= τ < H).
        first_send: f_p per fragment (each >= 1); default `default_first_send(H, P)`.

    Raises:
        ValueError: naming the field, the value and what is allowed.
    """
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas (M)={num_replicas!r}; must be an integer >= 1.")
    if not isinstance(num_fragments, int) or num_fragments < 1:
        raise ValueError(
            f"num_fragments (P)={num_fragments!r}; must be an integer >= 1."
        )
    if not isinstance(sync_every, int | np.integer) or sync_every < 1:
        raise ValueError(f"sync_every (H)={sync_every!r}; must be an integer >= 1.")
    if isinstance(overlap, int | np.integer):
        overlap = (int(overlap),) * num_replicas
    overlap = tuple(overlap)
    if len(overlap) != num_replicas:
        raise ValueError(
            f"overlap (tau)={overlap} has {len(overlap)} entries; give one int or one "
            f"per replica (M={num_replicas})."
        )
    if first_send is None:
        first_send = default_first_send(int(sync_every), num_fragments)
    first_send = tuple(first_send)
    if len(first_send) != num_fragments:
        raise ValueError(
            f"first_send={first_send} has {len(first_send)} entries; need one per "
            f"fragment (P={num_fragments})."
        )
    return Schedule(int(sync_every), first_send, overlap)
