"""What every algorithm shares: the `Algorithm` pair and the Protocols around it.

An algorithm is a pair of pure functions, `init(params, key) -> state` and
`step(state, batch) -> (state, metrics)`, plus its exact wire accounting. Its state is
one immutable pytree that declares which of its fields carry the leading replica axis
M (`replica_fields`), so that sharding, checkpoints and memory accounting read the
declaration instead of hard-coding field names. How the replicas exchange their outer
gradients is an `Exchange`: the vmapped simulation (`communication.simulated_exchange`)
and the sharded one (`distributed.sharded_exchange`) are interchangeable.
"""

import dataclasses
from collections.abc import Callable
from typing import (
    Any,
    ClassVar,
    Generic,
    NamedTuple,
    Protocol,
    TypeVar,
    runtime_checkable,
)

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int, PRNGKeyArray

from .compression import Compressor
from .custom_types import Metrics, Params
from .fragments import Fragments


@runtime_checkable
class AlgorithmState(Protocol):
    """The state of any algorithm: one immutable pytree (a NamedTuple here).

    `replica_fields` names the fields whose array leaves carry a leading axis M (one
    slice per replica); every other field is shared, i.e. one copy that every worker
    of a deployment would hold.
    """

    replica_fields: ClassVar[tuple[str, ...]]
    _fields: ClassVar[tuple[str, ...]]

    @property
    def step(self) -> Int[Array, ""]:
        """Steps taken so far (t)."""
        ...

    @property
    def global_params(self) -> Params:
        """The parameters to evaluate (θ_g)."""
        ...


@runtime_checkable
class Exchange(Protocol):
    """How the replicas exchange one fragment's outer gradients (Alg. 2, l.7-8).

    Given each replica's outer gradient of the fragment (one `[M, ...]` array per
    piece), it returns the average over replicas of what the receivers reconstruct
    (one `[...]` array per piece, in float32 or wider) and each replica's own
    reconstruction `[M, ...]` (what error feedback subtracts).
    `communication.simulated_exchange` (every replica on one device),
    `distributed.sharded_exchange(mesh)` (a packed all-gather) and
    `distributed.board_exchange` (islands of an elastic job) are the ones here.
    """

    def __call__(
        self,
        compressor: Compressor | None,
        fragments: Fragments,
        deltas: list[Array],
        key: PRNGKeyArray,
    ) -> tuple[list[Array], list[Array]]:
        """Exchange `deltas`; returns `(mean, own_reconstruction)`."""
        ...


@runtime_checkable
class PostedExchange(Protocol):
    """An exchange split around a transport that runs between steps.

    The step that sends a fragment only *encodes*: each replica's packed message goes
    into the state's outbox. Something outside the step (a `distributed.Courier`)
    moves the messages between replicas while the next τ inner steps compute, and
    puts every replica's message in the state's inbox before the step that needs
    them, which *decodes* and averages them. The values are those of an `Exchange`
    that encodes, moves and decodes within one step.
    """

    def message_bytes(
        self,
        compressor: Compressor | None,
        fragments: Fragments,
        deltas: list[Any],
        key: Array,
    ) -> int:
        """Bytes of one replica's message for deltas shaped like `deltas`."""
        ...

    def encode(
        self,
        compressor: Compressor | None,
        fragments: Fragments,
        deltas: list[Array],
        key: PRNGKeyArray,
    ) -> tuple[Array, list[Array]]:
        """Each replica's message `[M, B]` (uint8) and its own reconstruction."""
        ...

    def decode_mean(
        self,
        compressor: Compressor | None,
        fragments: Fragments,
        messages: Array,
        deltas: list[Any],
        key: PRNGKeyArray,
    ) -> list[Array]:
        """The mean over replicas of the reconstructions of all M `messages`."""
        ...


SpecT = TypeVar("SpecT")


@dataclasses.dataclass(frozen=True)
class Algorithm(Generic[SpecT]):
    """A distributed training algorithm: pure `init` and `step`, plus its accounting.

    Attributes:
        init: `init(params, key=None) -> state`.
        step: `step(state, batch, participation=None) -> (state, metrics)`, pure
            and jittable; every leaf of `batch` has a leading axis of size
            `num_replicas`; `participation` says which replicas take part
            (`sdiloco.participation`; None: all).
        bits_per_fragment: `bits_per_fragment(params) -> [P]` exact bits (Python ints)
            one replica puts on the wire to send each fragment (docs/contract.md §3);
            for Data-Parallel, one entry: the bits of one gradient exchange.
        num_replicas: M.
        spec: the algorithm's static description, typed: a `streaming.StreamingSpec`
            for the DiLoCo family (its schedule, layout and exchange, e.g. for a
            `distributed.Courier` or `streaming.inflight_outer_gradients`); None for
            Data-Parallel.
    """

    init: Callable[..., Any]
    step: Callable[..., tuple[Any, Metrics]]
    bits_per_fragment: Callable[[Params], np.ndarray]
    num_replicas: int
    spec: SpecT


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


def replica_fields(state: AlgorithmState) -> tuple[str, ...]:
    """The fields of `state` whose array leaves carry the leading replica axis M."""
    return type(state).replica_fields


def per_replica_bytes(state: AlgorithmState) -> dict[str, float]:
    """Bytes one replica holds of each field of `state` in a deployment.

    A replica field holds 1/M of its bytes per replica (its own slice); a shared field
    is held whole by every replica (each worker keeps its own copy). `state` may be
    abstract (`jax.eval_shape(alg.init, params)`): nothing needs to be allocated.
    """
    fields = replica_fields(state)
    out = {}
    for name in state._fields:
        leaves = [
            x
            for x in jax.tree.leaves(getattr(state, name))
            if eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)
        ]
        total = float(sum(x.size * jnp.dtype(x.dtype).itemsize for x in leaves))
        if name in fields and leaves:
            total /= leaves[0].shape[0]
        out[name] = total
    return out


def global_params(state: AlgorithmState) -> Params:
    """θ_g: the parameters to evaluate by default (paper Table 3)."""
    return state.global_params


def replica_params(state: Any, m: int) -> Params:
    """The parameters of replica m (of a state with a `replica_params` field)."""
    return jax.tree.map(lambda x: x[m] if eqx.is_array(x) else x, state.replica_params)


def replica_average(state: Any) -> Params:
    """The average of the replicas' parameters (computed in float32 or wider)."""

    def avg(x):
        if not eqx.is_inexact_array(x):
            return x[0] if eqx.is_array(x) else x
        wide = jnp.promote_types(x.dtype, jnp.float32)
        return jnp.mean(x.astype(wide), axis=0).astype(x.dtype)

    return jax.tree.map(avg, state.replica_params)
