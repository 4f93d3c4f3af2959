"""What every algorithm shares: the `Algorithm` pair and the Protocols around it.

An algorithm is a pair of pure functions, `init(params, key) -> state` and
`step(state, batch) -> (state, metrics)`, plus its exact wire accounting. Its state is
one immutable pytree that declares which of its fields carry the leading replica axis
M (`replica_fields`), so that sharding, checkpoints and memory accounting read the
declaration instead of hard-coding field names. How the replicas exchange their outer
gradients is an `Exchange`: the vmapped simulation (`communication.simulated_exchange`)
and the sharded one (`distributed.sharded_exchange`) are interchangeable.
"""

from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple, Protocol, runtime_checkable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int, PRNGKeyArray

from .custom_types import Batch, Metrics, Params
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
    """How the replicas exchange their outer gradients (Alg. 2, l.7-8).

    Given each replica's outer gradient (one `[M, ...]` array per parameter leaf), it
    returns the average over replicas of what the receivers reconstruct (one `[...]`
    array per leaf, in float32 or wider) and each replica's own reconstruction
    `[M, ...]` (what error feedback subtracts). Only the fragments in `sent` need to be
    correct: the caller keeps those and discards the rest.
    """

    def __call__(
        self,
        compressor: Any,
        fragments: Fragments,
        deltas: list[Array],
        key: PRNGKeyArray,
        sent: Bool[Array, " P"],
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
        self, compressor: Any, fragments: Fragments, deltas: list[Any], key: Array
    ) -> int:
        """Bytes of one replica's message for deltas shaped like `deltas`."""
        ...

    def encode(
        self,
        compressor: Any,
        fragments: Fragments,
        deltas: list[Array],
        key: PRNGKeyArray,
    ) -> tuple[Array, list[Array]]:
        """Each replica's message `[M, B]` (uint8) and its own reconstruction."""
        ...

    def decode_mean(
        self,
        compressor: Any,
        fragments: Fragments,
        messages: Array,
        deltas: list[Any],
        key: PRNGKeyArray,
    ) -> list[Array]:
        """The mean over replicas of the reconstructions of all M `messages`."""
        ...


class Algorithm(NamedTuple):
    """A distributed training algorithm: pure `init` and `step`, plus its accounting.

    Attributes:
        init: `init(params, key=None) -> state`.
        step: `step(state, batch) -> (state, metrics)`, pure and jittable; every leaf of
            `batch` has a leading axis of size `num_replicas`.
        bits_per_fragment: `bits_per_fragment(params) -> [P]` exact bits (Python ints)
            one replica puts on the wire to send each fragment (docs/contract.md §3);
            for Data-Parallel, one entry: the bits of one gradient exchange.
        num_replicas: M.
        spec: the algorithm's static description (a `StreamingSpec` for the DiLoCo
            family, e.g. to read the in-flight buffer with
            `streaming.inflight_outer_gradients`); None for Data-Parallel.
    """

    init: Callable[..., Any]
    step: Callable[[Any, Batch], tuple[Any, Metrics]]
    bits_per_fragment: Callable[[Params], np.ndarray]
    num_replicas: int
    spec: Any = None


def jit_step(
    algorithm: Algorithm | Callable[[Any, Batch], tuple[Any, Metrics]],
) -> "JittedStep":
    """`algorithm.step` (or a step function), compiled once, with the state donated.

    The one way to run a step fast: `step = sdiloco.jit_step(alg)`, then
    `state, metrics = step(state, batch)`. The state passed in is consumed (its
    buffers are reused for the new one): do not use it again. The batch is not
    donated. The first call copies the state's arrays, since `init` keeps the
    parameters it was given as θ_g and the caller may still hold them.
    `step.lower(state, batch)` gives the compiled program (`jax.stages.Lowered`).
    """
    fn = algorithm.step if isinstance(algorithm, Algorithm) else algorithm
    return JittedStep(fn, copy_first=True)


class JittedStep:
    """`fn(state, batch)` jitted with the state's arrays donated, as `jit_step` and
    `distributed.sharded_step` give it.

    Like `eqx.filter_jit`, array leaves are traced and every other leaf is static (it
    must be hashable; a new value compiles again). Unlike it, a call costs a few
    microseconds of Python. When every leaf of the state and the batch is an array
    (a jax or NumPy array), which is the usual case, the pytrees go straight to a
    `jax.jit` with the state donated: its C++ dispatch flattens them and rebuilds
    the outputs. Otherwise the array leaves are split out here, passed on, and the
    program found by the tree structures and the static leaves. `eqx.filter_jit`
    splits and rebuilds every pytree in Python at each call, which on the
    ~1M-parameter sync-heavy benchmark (`benchmarks/sync_heavy.py`) was 0.6 ms of a
    10 ms step; the split here about 0.06 ms, the direct path about 0.01 ms.

    Args:
        fn: `fn(state, batch) -> outputs` (any pytree).
        copy_first: copy the state's arrays at the first call (in the memory they
            are in), so that the caller's arrays survive the donation.
    """

    def __init__(self, fn: Callable[[Any, Any], Any], copy_first: bool = False):
        self.fn = fn
        self.copy_first = copy_first
        self._programs: dict = {}
        # All-array arguments: `fn` jitted as is. None once its outputs turned out
        # not to be all arrays (then every call takes the split path).
        self._direct: Callable | None = jax.jit(fn, donate_argnums=0)

    def __call__(self, state: Any, batch: Any) -> Any:
        if self.copy_first:
            state = jax.tree.map(  # a copy in the same place (device or host memory)
                lambda x: (
                    jax.device_put(x, x.sharding, may_alias=False)
                    if isinstance(x, jax.Array)
                    else (jnp.array(x) if eqx.is_array(x) else x)
                ),
                state,
            )
            self.copy_first = False
        if self._direct is not None and _all_arrays((state, batch)):
            try:
                return self._direct(state, batch)
            except TypeError as error:  # an output that is not an array: split
                if "not a valid JAX type" not in str(error):
                    raise
                self._direct = None
        (jitted, out), s_dyn, b_dyn = self._program(state, batch)
        dynamic = jitted(s_dyn, b_dyn)
        return _rebuild(out[0], dynamic)

    def lower(self, state: Any, batch: Any) -> "LoweredStep":
        """The program of a call on these arguments, lowered (the same XLA program
        whichever way the call is dispatched)."""
        (jitted, out), s_dyn, b_dyn = self._program(state, batch)
        return LoweredStep(jitted.lower(s_dyn, b_dyn), out)

    def _program(self, state, batch):
        s_dyn, s_key = _split(state)
        b_dyn, b_key = _split(batch)
        program = self._programs.get((s_key, b_key))
        if program is None:
            program = self._programs[s_key, b_key] = self._compile(s_key, b_key)
        return program, s_dyn, b_dyn

    def _compile(self, s_key, b_key):
        out: list = [None]  # the outputs' key, set when `run` is traced

        def run(s_dyn, b_dyn):
            result = self.fn(_rebuild(s_key, s_dyn), _rebuild(b_key, b_dyn))
            dynamic, out[0] = _split(result)
            return dynamic

        return jax.jit(run, donate_argnums=0), out


class LoweredStep:
    """`JittedStep.lower`: `.as_text()`, and `.compile()` to a `CompiledStep`."""

    def __init__(self, lowered: jax.stages.Lowered, out: list):
        self.lowered, self._out = lowered, out

    def as_text(self) -> str:
        return self.lowered.as_text()

    def compile(self) -> "CompiledStep":
        return CompiledStep(self.lowered.compile(), self._out)


class CompiledStep:
    """A compiled step: `compiled(state, batch)` (the state donated), `.as_text()`
    and `.memory_analysis()` of its XLA program."""

    def __init__(self, compiled: jax.stages.Compiled, out: list):
        self.compiled, self._out = compiled, out

    def __call__(self, state: Any, batch: Any) -> Any:
        return _rebuild(self._out[0], self.compiled(_split(state)[0], _split(batch)[0]))

    def as_text(self) -> str:
        return self.compiled.as_text()

    def memory_analysis(self) -> Any:
        return self.compiled.memory_analysis()


_ARRAY_LEAF_TYPES: set[type] = set()
"""Leaf types seen to be arrays (`eqx.is_array` is an `isinstance` test, so it holds
for every value of a type)."""


def _all_arrays(tree: Any) -> bool:
    """Whether every leaf of `tree` is an array in `_split`'s sense (`eqx.is_array`):
    then `jax.jit` traces it exactly as `_split` would, with nothing static.

    A set lookup of each leaf's type, with `eqx.is_array` only for a type not seen
    before: on the sync-heavy benchmark's state and batch (23 leaves) 5 µs a call
    against 10 µs for `eqx.is_array` on every leaf."""
    leaves = jax.tree.leaves(tree)
    if _ARRAY_LEAF_TYPES.issuperset(map(type, leaves)):
        return True
    for x in leaves:
        if not eqx.is_array(x):
            return False
        _ARRAY_LEAF_TYPES.add(type(x))
    return True


def _split(tree: Any) -> tuple[list, tuple]:
    """The array leaves of `tree`, and a hashable key: its structure and its other
    leaves with their positions."""
    leaves, treedef = jax.tree.flatten(tree)
    dynamic, static = [], []
    for i, x in enumerate(leaves):
        if eqx.is_array(x):
            dynamic.append(x)
        else:
            static.append((i, x))
    return dynamic, (treedef, tuple(static))


def _rebuild(key: tuple, dynamic: list) -> Any:
    """The inverse of `_split`."""
    treedef, static = key
    leaves = list(dynamic)
    for i, x in static:  # in increasing i: every earlier position is filled
        leaves.insert(i, x)
    return jax.tree.unflatten(treedef, leaves)


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
