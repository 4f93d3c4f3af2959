"""FedPart-style freezing: train only the fragment that is synchronised next.

Streaming DiLoCo §3.3.1 compares itself with FedPart (Wang et al., 2024), which trains
only the layers about to be synchronised and freezes the others. `freeze_unsynced` wraps
an inner optimizer so that, at inner step t, only the fragment whose next send is the
soonest (`t <= f_p + k·H`, the smallest such step over p) receives updates; every other
fragment's update (weight decay included) is zero. The wrapped optimizer's own moments
still see every gradient; only the parameter update is masked.

With the default first sends `f_p = H + round(p·H/P)`, the first H steps train fragment 0
only (its send at H comes first), then each fragment trains for the H/P steps before its
own send.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Int

from .fragments import Fragments
from .schedule import Schedule


class FreezeState(NamedTuple):
    """State of `freeze_unsynced`: the inner step count and the wrapped state."""

    count: Int[Array, ""]
    inner: optax.OptState


def active_fragment(schedule: Schedule, t: Int[Array, ""]) -> Int[Array, ""]:
    """The fragment whose next send (at or after step t >= 1) comes first."""
    f = jnp.asarray(schedule.first_send, t.dtype)
    h = jnp.asarray(schedule.sync_every, t.dtype)
    rounds = jnp.maximum(0, -((f - t) // h))  # ceil((t - f) / H), at least 0
    return jnp.argmin(f + rounds * h)


def freeze_unsynced(
    inner: optax.GradientTransformation, fragments: Fragments, schedule: Schedule
) -> optax.GradientTransformation:
    """Wrap `inner` so that only the fragment synchronised next is updated.

    Args:
        inner: the inner optimizer (e.g. AdamW).
        fragments: the partition of the parameters the updates are over.
        schedule: the sync schedule (`make_schedule`) whose sends define the rounds.

    Returns:
        An optax transformation whose updates are `inner`'s on the active fragment and
        zero elsewhere.
    """
    if fragments.num_fragments != schedule.num_fragments:
        raise ValueError(
            f"fragments has P={fragments.num_fragments} fragments but the schedule has "
            f"{schedule.num_fragments}; they must match."
        )

    def init(params):
        return FreezeState(jnp.zeros((), jnp.int32), inner.init(params))

    def update(updates, state, params=None):
        t = state.count + 1
        active = jax.nn.one_hot(
            active_fragment(schedule, t), fragments.num_fragments, dtype=bool
        )
        new, inner_state = inner.update(updates, state.inner, params)
        leaves, treedef = jax.tree.flatten(new)
        masks = fragments.mask(active)
        if len(masks) != len(leaves):
            raise ValueError(
                f"the updates have {len(leaves)} array leaves but the fragments cover "
                f"{len(masks)} parameter leaves."
            )
        leaves = [jnp.where(m, u, jnp.zeros_like(u)) for m, u in zip(masks, leaves)]
        return jax.tree.unflatten(treedef, leaves), FreezeState(t, inner_state)

    return optax.GradientTransformation(init, update)
