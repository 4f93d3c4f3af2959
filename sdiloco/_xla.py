"""The two helpers that shape how XLA compiles a step's sync work.

Everything else in the core is written as plain array code; these two hold the
performance invariants of docs/performance.md, which says why each matters on every
backend and what was measured:

- `loop_over_selected`: sync work runs inside a loop over the fragments that are due,
  and XLA cannot hoist any of it out of the loop to run at every step;
- `run_if`: a step with nothing due skips the sync work altogether, without a
  conditional that holds (and so copies) the state.
"""

from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int


T = TypeVar("T")


def loop_over_selected(
    selected: Bool[Array, " n"],
    body: Callable[[Int[Array, ""], Any, T], T],
    inputs: Any,
    carry: T,
) -> T:
    """`carry = body(j, inputs, carry)` for each j with `selected[j]`, in order.

    A while loop whose trip count is the number selected, so an unselected member
    costs nothing. The loop counter, `inputs` and `carry` go through one optimization
    barrier at the start of every iteration: everything `body` computes then depends
    on the iteration, and XLA's loop-invariant code motion cannot move it in front of
    the loop, where it would run at every step whether or not anything is selected
    (with one whole-model fragment, as in DiLoCo, all of Δ, its compression and its
    all-gather are otherwise loop-invariant). The carry is a while loop's, updated in
    place.
    """
    order = jnp.nonzero(selected, size=selected.shape[0], fill_value=0)[0]
    count = jnp.sum(selected, dtype=jnp.int32)

    def step(i, carry):
        i, ins, carry = jax.lax.optimization_barrier((i, inputs, carry))
        return body(order[i], ins, carry)

    return jax.lax.fori_loop(0, count, step, carry)


def run_if(due: Bool[Array, ""], fn: Callable[[T], T], tree: T) -> T:
    """`fn(tree)` if `due`, else `tree`, as a loop of 0 or 1 iteration.

    Not a `lax.cond`: a conditional's operands and results are separate buffers, so
    one that holds the parameters copies them on the way in and out, where a while
    loop updates its carry in place. `fn` must return a tree of `tree`'s structure;
    its non-array leaves are static.
    """
    dynamic, static = eqx.partition(tree, eqx.is_array)

    def body(carry):
        _, dynamic = carry
        new = fn(eqx.combine(jax.lax.optimization_barrier(dynamic), static))
        return jnp.zeros_like(due), eqx.partition(new, eqx.is_array)[0]

    dynamic = jax.lax.while_loop(lambda carry: carry[0], body, (due, dynamic))[1]
    return eqx.combine(dynamic, static)
