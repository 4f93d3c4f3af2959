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
    Protocol,
    TypeVar,
    runtime_checkable,
)

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
    piece) and `aggregate`, it returns `aggregate(rows)` of what the receivers
    reconstruct of every replica's message (`rows`: `[M, ...]` per piece, in
    float32 or wider; one `[...]` array per piece comes back), computed where the
    rows are, and each replica's own reconstruction `[M, ...]` (what error feedback
    subtracts).
    `communication.simulated_exchange` (every replica on one device) and
    `distributed.sharded_exchange(mesh)` (a packed all-gather) are the ones here;
    `distributed.posted_exchange` splits one around the steps (`PostedExchange`).
    """

    def __call__(
        self,
        compressor: Compressor | None,
        fragments: Fragments,
        deltas: list[Array],
        key: PRNGKeyArray,
        aggregate: Callable[[list[Array]], list[Array]],
    ) -> tuple[list[Array], list[Array]]:
        """Exchange `deltas`; returns `(aggregate(rows), own_reconstruction)`."""
        ...


@runtime_checkable
class PostedExchange(Protocol):
    """An exchange split around a transport that runs between steps.

    The step that sends a fragment only *encodes*: each replica's packed message goes
    into the state's outbox. Something outside the step (a `distributed.Courier`)
    moves the messages between replicas while the next τ inner steps compute (with
    τ = 0, between the two halves of the sending step), and puts every replica's
    message in the state's inbox before the step that needs them, which *decodes*
    and aggregates them. The values are those of an `Exchange`
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

    def decode(
        self,
        compressor: Compressor | None,
        fragments: Fragments,
        messages: Array,
        deltas: list[Any],
        key: PRNGKeyArray,
    ) -> tuple[list[Array], Array | None]:
        """The reconstructions `[R, ...]` of all R `messages` (one array per piece)
        and who sent them (`[R]` bool), or None where the state records it (the
        algorithm's `senders`; an elastic island reads presence marks)."""
        ...

    def inbox_rows(self, num_replicas: int) -> int:
        """Messages the inbox holds per fragment: M, or more when the step's M
        replicas are one island of a larger job (`distributed.ray_transport`)."""
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
            `distributed.Courier` or `analysis.inflight_outer_gradients`); None for
            Data-Parallel.
    """

    init: Callable[..., Any]
    step: Callable[..., tuple[Any, Metrics]]
    bits_per_fragment: Callable[[Params], np.ndarray]
    num_replicas: int
    spec: SpecT


def replica_fields(state: AlgorithmState) -> tuple[str, ...]:
    """The fields of `state` whose array leaves carry the leading replica axis M."""
    return type(state).replica_fields
