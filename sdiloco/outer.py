"""The outer step of (Streaming) DiLoCo, restricted to one fragment, and the α-merge.

The outer optimizer is any optax transformation. Its state is kept **separate per
fragment** (docs/contract.md §1): the leaves that mirror the parameters (momentum, Adam
moments) are stored once, since fragments are disjoint and a fragment only ever writes
its own elements, while every other leaf (step counts, schedules' counters) is stacked
on a leading fragment axis `[P, ...]`, so that an optimizer with a step count counts
the syncs of that fragment, not global steps.

The outer optimizer sees only the fragment's elements (its pieces, gathered by the
fragment's `inflight.Group`), so transforms that reduce over the tree (e.g. clipping by
global norm) see that fragment alone. Its state must mirror the parameters (true of
optax's element-wise optimizers; not of factored ones such as adafactor).
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, ArrayLike, Bool, Int

from .custom_types import Params
from .inflight import Group


def outer_init(
    outer: optax.GradientTransformation, params: Params, num_fragments: int
) -> optax.OptState:
    """Outer optimizer state for `num_fragments` fragments (non-param leaves stacked)."""
    state = outer.init(params)
    return optax.tree_utils.tree_map_params(
        outer,
        lambda x: x,
        state,
        transform_non_params=lambda x: jnp.broadcast_to(
            x, (num_fragments,) + jnp.shape(x)
        ),
    )


def fragment_outer_step(
    outer: optax.GradientTransformation,
    group: Group,
    j: Int[ArrayLike, ""],
    p: Int[Array, ""],
    params: Params,
    state: optax.OptState,
    outer_grad: list[Array] | Any,
    fetch: Callable[[Array], Array] = lambda x: x,
    store: Callable[[Array], Array] = lambda x: x,
    isolated: Callable[..., Any] = lambda compute, *operands: compute(*operands),
    read_grad: Callable[[Any], list[Array]] = lambda pieces: pieces,
) -> tuple[Params, optax.OptState]:
    """One outer step of fragment p on its elements only (Alg. 2, l.11).

    The outer optimizer sees the fragment's pieces, every other leaf an empty array, so
    the step costs the fragment's size, not the model's, and transforms that reduce over
    the tree (e.g. clipping by global norm) see that fragment alone. Non-parameter state
    leaves (step counts) are indexed `[p]`: a count counts that fragment's syncs. Everything outside fragment p, of the
    parameters and of the state, is returned bitwise unchanged.

    Args:
        outer: the outer optimizer.
        group: the fragment's group (`inflight.make_layout`); j its position in it.
        p: the fragment (traced).
        params: the global parameters θ_g (inexact arrays only).
        state: the per-fragment outer state from `outer_init`.
        outer_grad: the averaged outer gradient Δ̄ of the fragment: its pieces, or
            what `read_grad` turns into them inside `isolated` (e.g. the in-flight
            buffer, so that XLA fuses the read into the update instead of writing
            the pieces out first).
        fetch: applied to every piece read from `params` and `state` (e.g. a move
            from host memory to the device, when they are offloaded).
        store: applied to every piece before it is written back (e.g. the move back).
        isolated: `isolated(compute, *operands)` runs the update, which is given
            the touched leaves whole and gathers the fragment's pieces itself
            (`inflight.Visit.isolated` inside `Layout.for_each`; by default a call).
        read_grad: the pieces of Δ̄ from `outer_grad` (by default the identity).

    Returns:
        The new global parameters and outer state.
    """
    leaves, treedef = jax.tree.flatten(params)
    position = {i: k for k, i in enumerate(group.leaves)}
    param_index = _param_index(outer, params, state)
    s_leaves, s_def = jax.tree.flatten(state)
    # The update reads whole leaves and gathers the pieces itself, so that XLA fuses
    # the reads into it (`Group.gather_one`'s `fused`: the leaves are written only
    # after it).
    touched = [leaves[i] for i in group.leaves]
    s_touched = [
        fetch(x[p]) if i < 0 else x if i in position else None
        for x, i in zip(s_leaves, param_index)
    ]

    def piece(x, i, j):
        if i in position:
            return fetch(group.gather_one(position[i], x, j, fused=True))
        return jnp.zeros((0,), x.dtype)

    def update(touched, s_touched, outer_grad, j):
        outer_grad = read_grad(outer_grad)
        pieces = [
            piece(touched[position[i]] if i in position else x, i, j)
            for i, x in enumerate(leaves)
        ]
        grads = [
            outer_grad[position[i]].astype(x.dtype) if i in position else x
            for i, x in enumerate(pieces)
        ]
        s_pieces = [
            t if i < 0 else piece(x if t is None else t, i, j)
            for x, t, i in zip(s_leaves, s_touched, param_index)
        ]
        updates, new_state = outer.update(
            jax.tree.unflatten(treedef, grads),
            jax.tree.unflatten(s_def, s_pieces),
            jax.tree.unflatten(treedef, pieces),
        )
        new = [
            (x + u.astype(x.dtype)).astype(x.dtype)
            for x, u in zip(pieces, jax.tree.leaves(updates))
        ]
        return new, jax.tree.leaves(new_state)

    new_pieces, new_s_pieces = isolated(update, touched, s_touched, outer_grad, j)
    new_leaves = list(leaves)
    for i in position:
        new = store(new_pieces[i])
        new_leaves[i] = group.scatter_one(position[i], leaves[i], j, new)
    out_state = []
    for old, new, i in zip(s_leaves, new_s_pieces, param_index):
        if i < 0:
            out_state.append(old.at[p].set(store(new)))
        elif i in position:
            out_state.append(group.scatter_one(position[i], old, j, store(new)))
        else:
            out_state.append(old)
    return jax.tree.unflatten(treedef, new_leaves), jax.tree.unflatten(s_def, out_state)


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


def _param_index(
    outer: optax.GradientTransformation, params: Params, state: optax.OptState
) -> list[int]:
    """For each leaf of `state`: the index of the parameter leaf it mirrors, or -1."""
    treedef = jax.tree.structure(params)
    index = jax.tree.unflatten(treedef, list(range(treedef.num_leaves)))
    annotated = optax.tree_utils.tree_map_params(
        outer, lambda _, i: i, state, index, transform_non_params=lambda _: -1
    )
    return jax.tree.leaves(annotated)
