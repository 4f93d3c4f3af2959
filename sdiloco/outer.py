"""The outer step of (Streaming) DiLoCo, restricted to one fragment.

The outer optimizer is any optax transformation. Its state is kept **separate per
fragment** (docs/contract.md §1): the leaves that mirror the parameters (momentum, Adam
moments) are stored once, since fragments are disjoint and a fragment only ever writes
its own elements, while every other leaf (step counts, schedules' counters) is stacked
on a leading fragment axis `[P, ...]`, so that an optimizer with a step count counts
the syncs of that fragment, not global steps.

The outer optimizer sees only the fragment's elements (its pieces, gathered by the
fragment's `inflight.Group`), so transforms that reduce over the tree (e.g. clipping by
global norm, `optax.clip_by_global_norm`) see that fragment alone: they clip each
fragment by its own norm, not the model's. Its state must mirror the parameters
(true of optax's element-wise optimizers; not of factored ones such as adafactor,
which `check_outer` refuses when the algorithm is built).
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array

from .custom_types import Params
from .inflight import Visit


@dataclasses.dataclass(frozen=True)
class GlobalMemory:
    """Where θ_g and the outer optimizer state live.

    On the device (the default), or offloaded to host memory (`sdiloco.offload(alg)`, the
    `pinned_host` memory kind): then a sync moves only the fragment's pieces to the
    device (`fetch`) and its results back (`store`).
    """

    offload: bool = False

    def fetch(self, x: Array) -> Array:
        """A piece of θ_g or of the outer state, on the device."""
        return jax.device_put(x, jax.memory.Space.Device) if self.offload else x

    def store(self, x: Array) -> Array:
        """A piece to write into θ_g or the outer state, where those live."""
        return jax.device_put(x, jax.memory.Space.Host) if self.offload else x


def check_outer(outer: optax.GradientTransformation, params: Any) -> None:
    """Refuse an outer optimizer whose state does not mirror the parameters element
    by element (a factored one such as `optax.adafactor`): a fragment's outer step
    reads and writes its own elements of that state, which needs each of its
    parameter-like leaves shaped as its parameter.

    Args:
        outer: the outer optimizer.
        params: the parameter leaves, or their `jax.ShapeDtypeStruct`s (nothing is
            computed: the state's shapes are traced).

    Raises:
        ValueError: naming the first state leaf whose shape is not its parameter's.
    """
    state = jax.eval_shape(outer.init, params)
    bad = []

    def same(leaf: Any, param: Any) -> Any:
        if jnp.shape(leaf) != jnp.shape(param):
            bad.append((jnp.shape(leaf), jnp.shape(param)))
        return leaf

    optax.tree_utils.tree_map_params(outer, same, state, params)
    if bad:
        got, want = bad[0]
        raise ValueError(
            f"outer: the outer optimizer keeps state of shape {got} for a parameter "
            f"of shape {want} ({len(bad)} such leaves: a factored optimizer such as "
            "adafactor); allowed: an outer optimizer whose state mirrors the "
            "parameters element by element (sgd, Nesterov, adam, ...), since each "
            "fragment steps its own elements."
        )


def outer_init(
    outer: optax.GradientTransformation, params: Params, num_fragments: int
) -> optax.OptState:
    """Outer optimizer state for `num_fragments` fragments (non-param leaves stacked).

    Raises:
        ValueError: an outer optimizer whose state does not mirror the parameters
            (`check_outer`).
    """
    check_outer(outer, params)
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
    visit: Visit,
    params: Params,
    state: optax.OptState,
    grads: list[Array],
    memory: GlobalMemory = GlobalMemory(),
) -> tuple[Params, optax.OptState]:
    """One outer step of fragment p = `visit.p` on its elements only (Alg. 2, l.11).

    `θ_g[p], s_p ← OuterOpt(θ_g[p], s_p, Δ̄_p)`. The outer optimizer sees the
    fragment's pieces and every other leaf as an empty array, so the step costs the
    fragment's size, not the model's. Non-parameter state leaves (step counts) are
    indexed `[p]`: a count counts that fragment's syncs. Everything outside fragment
    p, of the parameters and of the state, is returned bitwise unchanged.

    Args:
        outer: the outer optimizer.
        visit: the fragment: its group, its id p and its rows.
        params: θ_g (inexact arrays only).
        state: the per-fragment outer state from `outer_init`.
        grads: Δ̄_p, one array per piece of the fragment (`visit.group.shapes`).
        memory: where `params` and `state` live.

    Returns:
        The new θ_g and outer state.
    """
    leaves, treedef = jax.tree.flatten(params)
    s_leaves, s_def = jax.tree.flatten(state)
    mirrors = _param_index(outer, params, state)  # per state leaf: its parameter
    where = {i: k for k, i in enumerate(visit.group.leaves)}  # parameter -> piece
    new_x, new_s = _update(outer, visit, params, state, grads, memory)
    out = list(leaves)
    for i, k in where.items():
        out[i] = visit.scatter_one(k, leaves[i], memory.store(new_x[i]))
    out_s = []
    for leaf, new, i in zip(s_leaves, jax.tree.leaves(new_s), mirrors):
        if i < 0:
            leaf = leaf.at[visit.p].set(memory.store(new))
        elif i in where:
            leaf = visit.scatter_one(where[i], leaf, memory.store(new))
        out_s.append(leaf)
    return jax.tree.unflatten(treedef, out), jax.tree.unflatten(s_def, out_s)


def outer_step_pieces(
    outer: optax.GradientTransformation,
    visit: Visit,
    params: Params,
    state: optax.OptState,
    grads: list[Array],
    memory: GlobalMemory = GlobalMemory(),
) -> list[Array]:
    """Fragment p's pieces of θ_g after an outer step on `grads`, with nothing
    written: neither θ_g nor the outer state changes (the stand-in of
    `merging.Eager`). The arguments are those of `fragment_outer_step`."""
    new_x, _ = _update(outer, visit, params, state, grads, memory)
    return [new_x[i] for i in visit.group.leaves]


def _update(
    outer: optax.GradientTransformation,
    visit: Visit,
    params: Params,
    state: optax.OptState,
    grads: list[Array],
    memory: GlobalMemory,
) -> tuple[list[Array], optax.OptState]:
    """The outer step of fragment p on its pieces: the new piece of every parameter
    leaf (an empty array for a leaf p does not touch) and the new state pieces."""
    leaves, treedef = jax.tree.flatten(params)
    s_leaves, s_def = jax.tree.flatten(state)
    mirrors = _param_index(outer, params, state)
    where = {i: k for k, i in enumerate(visit.group.leaves)}

    def piece(x: Array, i: int) -> Array:  # p's piece of a leaf shaped like param i
        if i in where:
            return memory.fetch(visit.gather_one(where[i], x))
        return jnp.zeros((0,), x.dtype)

    x = [piece(leaf, i) for i, leaf in enumerate(leaves)]
    g = [grads[where[i]].astype(a.dtype) if i in where else a for i, a in enumerate(x)]
    s = [
        memory.fetch(leaf[visit.p]) if i < 0 else piece(leaf, i)
        for leaf, i in zip(s_leaves, mirrors)
    ]
    updates, new_s = outer.update(
        jax.tree.unflatten(treedef, g),
        jax.tree.unflatten(s_def, s),
        jax.tree.unflatten(treedef, x),
    )
    new_x = [
        (a + u.astype(a.dtype)).astype(a.dtype)
        for a, u in zip(x, jax.tree.leaves(updates))
    ]
    return new_x, new_s


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
