"""Plug-ins: what each replica does around the exchange, with state of its own.

A plug-in is shaped like an optax transform: `init` makes its state, and hooks
transform what passes through it. Streaming DiLoCo calls three hooks, each for one
fragment at a time (a `Visit`, which reads and writes the fragment's elements of
any array shaped like the parameter leaves):

* `before_send(send, deltas, state)`, on each replica's outer gradient of the
  fragment being sent, before compression: returns what is compressed (error
  feedback adds its residual here; a stage with a running scale clips here);
* `after_send(send, sent, own, replicas, state)`, once the exchange has run:
  `sent` is what went into the compressor and `own` what the receivers reconstruct
  of it; a plug-in may update its state (error feedback keeps `sent − own`) and the
  replicas' parameters (Eager applies its stand-in step here);
* `on_arrival(arrival, replicas, state)`, when the fragment's outer step arrives:
  the merge (`merging.alpha_merge`, `merging.eager`).

Every hook gets the whole of the plug-in's state and returns it; a hook that does
nothing returns its inputs. The state is any pytree whose array leaves carry the
leading replica axis M (per replica and parameter, like error feedback's residual,
or per replica and fragment, `[M, P]`): it lives in one field of the algorithm's
state (`StreamingState.plugin_state`), so it is checkpointed and sharded with the
replicas, and a replica that comes back from a failure gets `init`'s value again.

Plug-ins compose with `chain`, in order: each `before_send` feeds the next, each
`on_arrival` sees the replicas the one before it left. Exactly one plug-in of a
run takes in the outer step (`merges`): `streaming_diloco` adds the α-merge when
none of the given plug-ins does.

A replica that does not send (`Send.sends` false) sends a zero outer gradient,
whatever `before_send` returns for it, and a plug-in should leave its state as it
was (`where_replicas`); where the fragment's outer gradient was not finite
(`Arrival.ok` false), a merge should restore the replicas to θ_g.
"""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool

from .compression.base import compute_dtype
from .inflight import Visit
from .participation import where_replicas


class Send(NamedTuple):
    """What a plug-in sees of one fragment's send.

    Attributes:
        visit: the fragment (its pieces of any leaf list shaped like the parameters).
        sends: `[M]` who sends (None: every replica).
        global_: the fragment's pieces of θ_g (on the device).
        standin: `standin(grads)` per replica: the fragment's pieces of θ_g after an
            outer step on `grads` (`[M, ...]` per piece), with the outer optimizer's
            state as it is and nothing written (what Eager applies at the send).
    """

    visit: Visit
    sends: Bool[Array, " M"] | None
    global_: list[Array]
    standin: Callable[[list[Array]], list[Array]]


class Arrival(NamedTuple):
    """What a plug-in sees when a fragment's outer step arrives.

    Attributes:
        visit: the fragment.
        global_: every leaf of θ_g after the outer step (host memory when offloaded:
            `fetch` a piece before computing with it).
        due: `[M]` which replicas merge it now (`sent + τ_m = t`, and alive).
        ok: `[]` whether its averaged outer gradient was finite (or checks are off).
        fetch: moves a piece of θ_g to the device (the identity without offload).
    """

    visit: Visit
    global_: list[Array]
    due: Bool[Array, " M"]
    ok: Bool[Array, ""]
    fetch: Callable[[Array], Array]


class Plugin(eqx.Module):
    """A replica's hooks around the exchange (see the module docstring)."""

    merges = False
    """Whether `on_arrival` takes in the outer step (one plug-in of a run does)."""

    def init(self, params: list[Array], num_replicas: int, num_fragments: int) -> Any:
        """The state, from θ_g's leaves (unreplicated); leaves carry a leading M."""
        del params, num_replicas, num_fragments
        return None

    def before_send(
        self, send: Send, deltas: list[Array], state: Any
    ) -> tuple[list[Array], Any]:
        """What each replica compresses of the fragment (`[M, ...]` per piece)."""
        del send
        return deltas, state

    def after_send(
        self,
        send: Send,
        sent: list[Array],
        own: list[Array],
        replicas: list[Array],
        state: Any,
    ) -> tuple[list[Array], Any]:
        """The replicas' leaves (all of them, `[M, ...]`) and the state after the
        exchange, from what was compressed (`sent`) and reconstructed (`own`)."""
        del send, sent, own
        return replicas, state

    def on_arrival(
        self, arrival: Arrival, replicas: list[Array], state: Any
    ) -> tuple[list[Array], Any]:
        """The replicas' leaves and the state once θ_g took the outer step."""
        del arrival
        return replicas, state


class Chain(Plugin):
    """Plug-ins applied in turn; its state is the tuple of theirs (`chain`)."""

    plugins: tuple[Plugin, ...]

    @property
    def merges(self) -> bool:  # pyright: ignore[reportIncompatibleVariableOverride]
        """Whether one of the plug-ins merges."""
        return any(p.merges for p in self.plugins)

    def init(self, params, num_replicas, num_fragments):
        return tuple(p.init(params, num_replicas, num_fragments) for p in self.plugins)

    def before_send(self, send, deltas, state):
        out = []
        for p, s in zip(self.plugins, state):
            deltas, s = p.before_send(send, deltas, s)
            out.append(s)
        return deltas, tuple(out)

    def after_send(self, send, sent, own, replicas, state):
        out = []
        for p, s in zip(self.plugins, state):
            replicas, s = p.after_send(send, sent, own, replicas, s)
            out.append(s)
        return replicas, tuple(out)

    def on_arrival(self, arrival, replicas, state):
        out = []
        for p, s in zip(self.plugins, state):
            replicas, s = p.on_arrival(arrival, replicas, s)
            out.append(s)
        return replicas, tuple(out)


def chain(*plugins: Plugin) -> Chain:
    """Compose plug-ins, applied in the order given (like `optax.chain`).

    Raises:
        ValueError: naming a member that is not a `Plugin`, or two that merge.
    """
    for i, p in enumerate(plugins):
        if not isinstance(p, Plugin):
            raise ValueError(
                f"plugins[{i}]={p!r} is not a sdiloco.plugins.Plugin; allowed: "
                "error_feedback(...), alpha_merge(...), eager(), chain(...) or a "
                "subclass of Plugin."
            )
    merging = [type(p).__name__ for p in plugins if p.merges]
    if len(merging) > 1:
        raise ValueError(
            f"plugins={merging} each merge the outer step; allowed: one merge."
        )
    return Chain(tuple(plugins))


def as_plugin(plugins: Plugin | Sequence[Plugin]) -> Chain:
    """`plugins` (one, or a sequence) as one `Chain`."""
    if isinstance(plugins, Chain):
        return plugins
    return chain(plugins) if isinstance(plugins, Plugin) else chain(*plugins)


def pieces(send_or_arrival: Send | Arrival, leaves: list[Array]) -> list[Array]:
    """The fragment's `[M, ...]` pieces of per-replica leaves shaped like θ."""
    return send_or_arrival.visit.gather(leaves, 1)


def scatter_senders(send: Send, leaves: list[Array], new: list[Array]) -> list[Array]:
    """`leaves` `[M, ...]` with the fragment's pieces set to `new`, except for a
    replica that did not send, which keeps its own."""
    v = send.visit
    if send.sends is not None:
        kept = v.gather(leaves, 1)
        new = [where_replicas(send.sends, x, k) for x, k in zip(new, kept)]
    return v.scatter(leaves, new, axis=1)


class ErrorFeedback(Plugin):
    """Error feedback with decay β: a per-replica residual carried into the next send.

    Its state is one residual `e` per replica and parameter, in float32 or wider,
    zero at the start. Before compression the replica's outer gradient becomes
    `a = Δ + β·e`; after it, `e ← a − own` (what the receivers did not get), so that
    what was sent plus the new residual is `Δ + β·e`. A replica that does not send
    keeps its residual; a round that fails (its outer gradient not finite) zeroes
    the residual of the replicas that merge it. β = 1 is classic error feedback; SparseLoCo's β < 1 makes the
    residual a decaying accumulator that stands in for outer momentum.

    Attributes:
        beta: the decay of the residual, in [0, 1].
    """

    beta: float = eqx.field(default=1.0, static=True)

    def __check_init__(self):
        if isinstance(self.beta, bool) or not 0.0 <= self.beta <= 1.0:
            raise ValueError(
                f"error_feedback beta={self.beta!r} is not allowed; expected "
                "0 <= beta <= 1."
            )

    def init(self, params, num_replicas, num_fragments):
        del num_fragments
        return [
            jnp.zeros((num_replicas,) + x.shape, compute_dtype(x.dtype)) for x in params
        ]

    def before_send(self, send, deltas, state):
        residual = pieces(send, state)
        if self.beta == 1.0:
            return [d + e for d, e in zip(deltas, residual)], state
        decayed = [(self.beta * e).astype(e.dtype) for e in residual]
        return [d + e for d, e in zip(deltas, decayed)], state

    def after_send(self, send, sent, own, replicas, state):
        errors = [a - q for a, q in zip(sent, own)]
        return replicas, scatter_senders(send, state, errors)

    def on_arrival(self, arrival, replicas, state):
        """A failed round (`ok` false) restores θ_g, so the residual of what it did
        not send goes too: zero for the replicas that merge it (a non-finite
        residual would otherwise fail every later round of the fragment)."""
        v, failed = arrival.visit, arrival.due & ~arrival.ok
        kept = [
            jnp.where(failed.reshape((-1,) + (1,) * (e.ndim - 1)), 0, e).astype(e.dtype)
            for e in v.gather(state, 1)
        ]
        return replicas, v.scatter(state, kept, axis=1)


def error_feedback(beta: float = 1.0) -> ErrorFeedback:
    """Feed each replica's compression residual, decayed by `beta`, into its next
    send of the fragment (a plug-in: `streaming_diloco(plugins=...)`)."""
    return ErrorFeedback(beta=beta)


def is_finite(values: list[Array]) -> Array:
    """Whether every value of every array is finite (`[]` bool)."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(v)) for v in values]))
