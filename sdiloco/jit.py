"""The step compiled once: `jit_step` and what it returns.

`jax.jit` with the state donated and every non-array leaf static (as
`eqx.filter_jit` does), but a call returns as soon as the step is dispatched, so the
training loop prepares the next batch (and a courier moves messages) while it runs.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp

from .base import Algorithm


def jit_step(
    algorithm: Algorithm | Callable[[Any, Any], Any],
) -> "JittedStep":
    """`algorithm.step` (or a step function), compiled once, with the state donated.

    The one way to run a step fast: `step = sdiloco.jit_step(alg)`, then
    `state, metrics = step(state, batch)`. The state passed in is consumed (its
    buffers are reused for the new one): do not use it again. The batch is not
    donated. The first call copies the state's arrays, since `init` keeps the
    parameters it was given as θ_g and the caller may still hold them.
    `step.lower(state, batch)` gives the program (`jax.stages.Lowered`).
    """
    fn = algorithm.step if isinstance(algorithm, Algorithm) else algorithm
    return JittedStep(fn, copy_first=True)


class JittedStep:
    """`fn(state, batch, ...)` compiled by `jax.jit`, the state's arrays donated.

    The inputs after the state (the batch, and a `Participation` where given) are
    traced and not donated.

    As with `eqx.filter_jit`, array leaves are traced and every other leaf (an
    Equinox module's activation function, say) is static: hashed with the tree
    structure, a new value compiles again. Unlike `eqx.filter_jit`, which waits for
    each call's result, a call returns as soon as the step is dispatched, so the
    training loop prepares the next batch (and a courier moves messages) while the
    step computes.

    Args:
        fn: `fn(state, batch) -> outputs` (any pytree).
        donate: donate the state; False keeps the state passed in valid (a
            courier's step whose messages may still fail to arrive).
        copy_first: copy the state's arrays at the first call (in the memory they
            are in), so that arrays the caller still holds survive the donation.
    """

    def __init__(
        self,
        fn: Callable[[Any, Any], Any],
        *,
        donate: bool = True,
        copy_first: bool = False,
    ):
        self._fn = fn
        self._jitted = jax.jit(
            self._run, donate_argnums=(0,) if donate else (), static_argnums=(2, 3)
        )
        self._outputs: dict[tuple[_Static, _Static], _Static] = {}
        self._copy = copy_first

    def __call__(self, state: Any, *inputs: Any) -> Any:
        if self._copy:  # a copy in the same place (device or host memory)
            state = jax.tree.map(_copy, state)
            self._copy = False
        (s_dyn, s_static), (b_dyn, b_static) = _split(state), _split(inputs)
        dynamic = self._jitted(s_dyn, b_dyn, s_static, b_static)
        return self._outputs[s_static, b_static].combine(dynamic)

    def lower(self, state: Any, *inputs: Any) -> "LoweredStep":
        """The program of a call on these arguments, lowered: `.as_text()`, and
        `.compile()` to a `CompiledStep` (`compiled(state, batch)`, `.as_text()`,
        `.memory_analysis()`, `.cost_analysis()`)."""
        (s_dyn, s_static), (b_dyn, b_static) = _split(state), _split(inputs)
        lowered = self._jitted.lower(s_dyn, b_dyn, s_static, b_static)
        return LoweredStep(lowered, self._outputs[s_static, b_static])

    def _run(self, s_dyn, b_dyn, s_static: "_Static", b_static: "_Static"):
        out = self._fn(s_static.combine(s_dyn), *b_static.combine(b_dyn))
        dynamic, self._outputs[s_static, b_static] = _split(out)
        return dynamic


class LoweredStep(NamedTuple):
    """`JittedStep.lower`'s result."""

    lowered: jax.stages.Lowered
    outputs: "_Static"

    def as_text(self) -> str:
        return self.lowered.as_text()

    def compile(self) -> "CompiledStep":
        return CompiledStep(self.lowered.compile(), self.outputs)


class CompiledStep(NamedTuple):
    """A compiled step: `compiled(state, batch)` (the state donated) and XLA's
    reports on its program."""

    compiled: jax.stages.Compiled
    outputs: "_Static"

    def __call__(self, state: Any, *inputs: Any) -> Any:
        dynamic = self.compiled(_split(state)[0], _split(inputs)[0])
        return self.outputs.combine(dynamic)

    def as_text(self) -> str:
        return self.compiled.as_text() or ""

    def memory_analysis(self) -> Any:
        return self.compiled.memory_analysis()

    def cost_analysis(self) -> Any:
        return self.compiled.cost_analysis()


class _Static(NamedTuple):
    """The hashable part of a pytree: its structure and its non-array leaves."""

    treedef: Any
    leaves: tuple[tuple[int, Any], ...]  # (position, value)

    def combine(self, dynamic: list[Any]) -> Any:
        leaves = list(dynamic)
        for i, x in self.leaves:  # in increasing i: every earlier position is filled
            leaves.insert(i, x)
        return jax.tree.unflatten(self.treedef, leaves)


def _split(tree: Any) -> tuple[list[Any], _Static]:
    """The array leaves of `tree` and the rest (`_Static`)."""
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [x for x in leaves if eqx.is_array(x)]
    static = tuple((i, x) for i, x in enumerate(leaves) if not eqx.is_array(x))
    return arrays, _Static(treedef, static)


def _copy(x: Any) -> Any:
    if isinstance(x, jax.Array):
        return jax.device_put(x, x.sharding, may_alias=False)
    return jnp.array(x) if eqx.is_array(x) else x
