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
from jax.extend.core import Literal
from jaxtyping import Array, ArrayLike, Bool, Int

from .custom_types import Params
from .inflight import ROW_BY_ROW, Group


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
    in_place: Int[ArrayLike, ""] | None = None,
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
        in_place: for an elementwise outer optimizer (`is_elementwise`; the caller
            checks): take the step one row at a time, each row computed in
            `isolated` and written in place (this value is `Group.update_one`'s
            `unknown_zero`), instead of computing the whole pieces and copying them
            in (`_step_in_place`). A group with a piece of more than `ROW_BY_ROW`
            rows takes the whole pieces anyway (one slice, a small program).

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

    if in_place is not None and all(
        r is None or r.shape[1] <= ROW_BY_ROW for r in group.rows
    ):
        return _step_in_place(
            outer,
            group,
            j,
            p,
            params,
            state,
            outer_grad,
            read_grad,
            in_place,
            fetch,
            store,
            isolated,
        )
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


def is_elementwise(
    outer: optax.GradientTransformation, params: Params, state: optax.OptState
) -> bool:
    """Whether `outer.update` is elementwise: each element of a parameter's update
    and of its state depends only on the same element of that parameter, of its
    gradient and of its state, and on scalars (counts, hyper-parameters), and the
    non-parameter state (counts) on no parameter. Then it can be applied to any
    part of a parameter, a row at a time, with the same numbers.

    Read off the jaxpr of one update (shapes only, nothing is computed): every
    operation on an array must be in `_ELEMENTWISE` (or a broadcast of a scalar, or
    a call whose own jaxpr passes), with operands shaped like its result or scalar.
    A reduction, a matrix product, a reshape or an index makes it False, as does
    anything unknown: e.g. a clip by global norm. So does an update that depends on
    a parameter's shape (a scale by its size, a branch on its rank): it is traced a
    second time with every parameter a scalar, and the two traces must run the same
    operations on the same constants.

    Args:
        outer: the outer optimizer.
        params: the parameters (inexact arrays; shapes and dtypes are what counts).
        state: its state as `outer_init` makes it (non-parameter leaves `[P, ...]`).
    """
    leaves, treedef = jax.tree.flatten(params)
    param_index = _param_index(outer, params, state)
    s_leaves, s_def = jax.tree.flatten(state)

    def shapes(scalar):  # the update's arguments: real shapes, or params as scalars
        like = [
            jax.ShapeDtypeStruct(() if scalar else x.shape, x.dtype) for x in leaves
        ]
        s_like = [
            jax.ShapeDtypeStruct(
                x.shape[1:] if i < 0 else () if scalar else x.shape, x.dtype
            )
            for x, i in zip(s_leaves, param_index)
        ]
        return like, s_like, like

    def update(grads, s, params):
        updates, new = outer.update(
            jax.tree.unflatten(treedef, grads),
            jax.tree.unflatten(s_def, s),
            jax.tree.unflatten(treedef, params),
        )
        return jax.tree.leaves(updates), jax.tree.leaves(new)

    try:
        closed = jax.make_jaxpr(update)(*shapes(False))
        scalar = jax.make_jaxpr(update)(*shapes(True))
    except Exception:  # noqa: BLE001 - not traceable on shapes alone: not known safe
        return False
    if _operations(closed.jaxpr) != _operations(scalar.jaxpr):
        return False
    n = len(leaves)
    origin = [frozenset({i}) for i in range(n)]
    inputs = origin + [frozenset() if i < 0 else frozenset({i}) for i in param_index]
    out = _origins(closed.jaxpr, inputs + origin)
    if out is None:
        return False
    updates, new = out[:n], out[n:]
    if any(not o <= {i} for i, o in enumerate(updates)):
        return False
    return all(o <= ({i} if i >= 0 else set()) for o, i in zip(new, param_index))


_ELEMENTWISE = frozenset(
    "abs add and atan2 cbrt ceil clamp convert_element_type copy copy_p cos cosh div "
    "eq erf erf_inv exp exp2 expm1 floor ge gt integer_pow is_finite le log log1p "
    "logistic lt max min mul ne neg nextafter not or pow reduce_precision rem round "
    "rsqrt select_n sign sin sinh sqrt square stop_gradient sub tan tanh xor".split()
)
"""Primitives that act element by element on operands of one shape."""


def _origins(jaxpr: Any, inputs: list[frozenset]) -> list[frozenset] | None:
    """For each output of `jaxpr`, the parameters (leaf indices) its elements come
    from, given those of its inputs; None if an operation is not elementwise."""
    env: dict = dict(zip(jaxpr.invars, inputs))
    env.update((var, frozenset()) for var in jaxpr.constvars)

    def read(v):
        return frozenset() if isinstance(v, Literal) else env[v]

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        shapes = [jnp.shape(v.aval) for v in eqn.invars]
        sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        sub = getattr(sub, "jaxpr", sub)
        if sub is not None and hasattr(sub, "eqns"):
            outs = _origins(sub, ins)
            if outs is None:
                return None
        elif all(shape == () for shape in shapes) and all(
            jnp.shape(v.aval) == () for v in eqn.outvars
        ):  # scalars only: counts and hyper-parameters
            outs = [frozenset().union(*ins)] * len(eqn.outvars)
        elif eqn.primitive.name == "broadcast_in_dim" and shapes[0] == ():
            outs = [ins[0]]
        elif eqn.primitive.name in _ELEMENTWISE:
            result = jnp.shape(eqn.outvars[0].aval)
            if any(shape not in ((), result) for shape in shapes):
                return None
            outs = [frozenset().union(*ins)] * len(eqn.outvars)
        else:
            return None
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _operations(jaxpr: Any) -> list:
    """The primitives of `jaxpr` in order, with their literal operands (sub-jaxprs
    inlined, shapes left out), to tell whether two traces compute alike."""
    out: list = []
    for eqn in jaxpr.eqns:
        literals = tuple(
            repr(v.val) if isinstance(v, Literal) else None for v in eqn.invars
        )
        out.append((eqn.primitive.name, literals))
        sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        sub = getattr(sub, "jaxpr", sub)
        if sub is not None and hasattr(sub, "eqns"):
            out.extend(_operations(sub))
    return out


def _step_in_place(
    outer: optax.GradientTransformation,
    group: Group,
    j: Int[ArrayLike, ""],
    p: Int[Array, ""],
    params: Params,
    state: optax.OptState,
    outer_grad: Any,
    read_grad: Callable[[Any], list[Array]],
    unknown_zero: Int[ArrayLike, ""],
    fetch: Callable[[Array], Array],
    store: Callable[[Array], Array],
    isolated: Callable[..., Any],
) -> tuple[Params, optax.OptState]:
    """`fragment_outer_step` for an elementwise outer optimizer, a row at a time:
    each parameter leaf of the fragment, with its state leaves, goes through
    `outer.update` alone (the other leaves empty), one row at a time for a stacked
    leaf. A row's new values are computed in `isolated` into row-sized buffers, which
    stay in cache, and written in place; the other path writes the whole new pieces
    out and reads them back to copy them in (on the sync-heavy benchmark's
    0.5M-value fragment on XLA:CPU, about 0.6 ms less per arrival).

    Fused into the writes instead (no `isolated`), XLA recomputed the new momentum
    inside the parameter's write, which must read the momentum rows before the
    momentum's own write; with nothing ordering the two, it copied the state leaves
    whole.

    The numbers are those of the pieces path up to the last bit: XLA:CPU's square
    root is not always correctly rounded, and which elements it rounds otherwise
    depends on the array's shape (so Adam's steps differ in the last bit of some
    elements). SGD with Nesterov momentum, the default, has no square root and gives
    bitwise the same numbers. Offloaded or not, a run takes the same path."""
    leaves, treedef = jax.tree.flatten(params)
    param_index = _param_index(outer, params, state)
    s_leaves, s_def = jax.tree.flatten(state)
    counts = [fetch(x[p]) if i < 0 else None for x, i in zip(s_leaves, param_index)]

    def empty(x):
        return jnp.zeros((0,), x.dtype)

    def update(i, x, s, g):  # parameter i's x (a row or whole), its state s, Δ̄ g
        ps = [x if t == i else empty(y) for t, y in enumerate(leaves)]
        gs = [g.astype(x.dtype) if t == i else empty(y) for t, y in enumerate(leaves)]
        it = iter(s)
        ss = [
            c if t < 0 else next(it) if t == i else empty(y)
            for y, c, t in zip(s_leaves, counts, param_index)
        ]
        updates, new = outer.update(
            jax.tree.unflatten(treedef, gs),
            jax.tree.unflatten(s_def, ss),
            jax.tree.unflatten(treedef, ps),
        )
        new_x = (x + jax.tree.leaves(updates)[i].astype(x.dtype)).astype(x.dtype)
        new_s = [y for y, t in zip(jax.tree.leaves(new), param_index) if t == i]
        return new_x, new_s

    leaves, s_leaves = list(leaves), list(s_leaves)
    for k, i in enumerate(group.leaves):
        mine = [t for t, index in enumerate(param_index) if index == i]
        rows = group.rows[k]
        if rows is None:
            new_x, new_s = isolated(
                lambda x, s, outer_grad, i=i, k=k: update(
                    i, fetch(x), [fetch(y) for y in s], read_grad(outer_grad)[k]
                ),
                leaves[i],
                [s_leaves[t] for t in mine],
                outer_grad,
            )
            leaves[i] = store(new_x)
            for t, y in zip(mine, new_s):
                s_leaves[t] = store(y.astype(s_leaves[t].dtype))
            continue
        table = jnp.asarray(rows)[j] + unknown_zero
        for r in range(rows.shape[1]):

            def compute(x, s, outer_grad, row, i=i, k=k, r=r, mine=mine):
                x = fetch(jax.lax.dynamic_index_in_dim(x, row, 0, keepdims=False))
                s = [
                    fetch(jax.lax.dynamic_index_in_dim(y, row, 0, keepdims=False))
                    for y in s
                ]
                return update(i, x, s, read_grad(outer_grad)[k][r])

            # The row's results are computed in `isolated` (written out, a row in
            # cache) and then written in: fused into the writes, XLA recomputed the
            # new state inside the parameter's write, which then read the state
            # rows after the state's own write, and it copied the state leaves.
            row = table[r]
            new_x, new_s = isolated(
                compute, leaves[i], [s_leaves[t] for t in mine], outer_grad, row
            )
            leaves[i] = jax.lax.dynamic_update_index_in_dim(
                leaves[i], store(new_x), row, 0
            )
            for t, y in zip(mine, new_s):
                s_leaves[t] = jax.lax.dynamic_update_index_in_dim(
                    s_leaves[t], store(y.astype(s_leaves[t].dtype)), row, 0
                )
    # The non-parameter state (counts) depends on no parameter: one update of
    # empty leaves gives it.
    new = outer.update(
        jax.tree.unflatten(treedef, [empty(x) for x in leaves]),
        jax.tree.unflatten(
            s_def,
            [
                c if t < 0 else empty(y)
                for y, c, t in zip(s_leaves, counts, param_index)
            ],
        ),
        jax.tree.unflatten(treedef, [empty(x) for x in leaves]),
    )[1]
    for t, (y, index) in enumerate(zip(jax.tree.leaves(new), param_index)):
        if index < 0:
            s_leaves[t] = s_leaves[t].at[p].set(store(y))
    return jax.tree.unflatten(treedef, leaves), jax.tree.unflatten(s_def, s_leaves)


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
