"""The posted exchange: a fragment's messages encoded in the step that sends it,
moved between steps, decoded in the step of its outer update.

One exchange for every layout (`posted_exchange`): the replicas simulated on one
device, sharded over a mesh (`mesh=`), or one replica per program (`island=`, an
elastic job's island). It is `sharded_exchange`'s wire format split in two halves:

- `encode` (in the sending step, `streaming.send`): each replica's Δ packed into one
  `uint8` message (`Wire`, with the simulation's PRNG keys of that replica), into the
  state's outbox;
- `decode` (in the step of the outer update, `streaming.receive`): every message in
  the inbox decoded, for the algorithm's aggregator.

What moves the outbox to the inbox in between is a `Courier` and its `Transport`.
An island's message carries one more byte, 1, that marks it present: a row of
zeros in its inbox is an island that was not a member of the round, which the
aggregator leaves out, as the simulation does with a replica that does not send;
with every island present, the numbers are those of the simulation.
"""

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array, PRNGKeyArray

from .. import participation
from ..base import PostedExchange
from ..compression import Compressor
from ..fragments import Fragments
from .exchange import assemble, replica_keys
from .mesh import AXIS
from .wire import Wire


class _Posted:
    """`PostedExchange` with the packed wire format of `sharded_exchange`."""

    def __init__(self, mesh: Mesh | None, island: tuple[int, int] | None):
        if island is not None:
            replica, count = island
            if not 0 <= replica < count:
                raise ValueError(
                    f"replica={replica}; allowed: 0 ... num_replicas - 1 = {count - 1}."
                )
            if mesh is not None:
                raise ValueError("island= with a mesh; allowed: one of the two.")
        self.mesh, self.island = mesh, island

    def __repr__(self) -> str:
        if self.island is not None:
            return f"posted_exchange(replica={self.island[0]}, M={self.island[1]})"
        return f"posted_exchange({'mesh' if self.mesh is not None else ''})"

    def _wire(self, compressor, fragments, deltas, key):
        """The format of the messages of the replicas of `deltas`, and their keys
        (an island's: those the simulation gives its replica)."""
        if self.island is None:
            keys = replica_keys(key, len(deltas), deltas[0].shape[0])
        else:
            if deltas[0].shape[0] != 1:
                raise ValueError(
                    f"an island's exchange carries one replica; got "
                    f"{deltas[0].shape[0]} (build the island with num_replicas=1)."
                )
            m, count = self.island
            keys = [k[m : m + 1] for k in replica_keys(key, len(deltas), count)]
        return Wire(compressor, fragments, deltas, keys, 0), keys

    def message_bytes(
        self, compressor: Compressor | None, fragments: Fragments, deltas, key
    ) -> int:
        def size(deltas, key):
            wire, keys = self._wire(compressor, fragments, deltas, key)
            one = [x[0] for x in deltas], [k[0] for k in keys]
            return wire.encode(*one)

        return int(jax.eval_shape(size, deltas, key).shape[0]) + self._mark

    def encode(
        self,
        compressor: Compressor | None,
        fragments: Fragments,
        deltas: list[Array],
        key: PRNGKeyArray,
    ) -> tuple[Array, list[Array]]:
        wire, keys = self._wire(compressor, fragments, deltas, key)

        def local(deltas, keys):
            messages = jax.vmap(wire.encode)(deltas, keys)
            own = assemble([wire], fragments, [jax.vmap(wire.decode)(messages)])
            if self._mark:  # present
                messages = jnp.pad(messages, ((0, 0), (0, 1)), constant_values=1)
            return messages, own

        if self.mesh is None:
            return local(deltas, keys)
        split = PartitionSpec(AXIS)
        return jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(split, split),
            out_specs=(split, split),
            check_vma=False,
        )(deltas, keys)

    def decode(
        self,
        compressor: Compressor | None,
        fragments: Fragments,
        messages: Array,
        deltas,
        key: PRNGKeyArray,
    ) -> tuple[list[Array], Array | None]:
        wire, _ = self._wire(compressor, fragments, deltas, key)
        if not self._mark:
            recon = assemble([wire], fragments, [jax.vmap(wire.decode)(messages)])
            return recon, None
        present = messages[:, -1] == 1
        recon = assemble([wire], fragments, [jax.vmap(wire.decode)(messages[:, :-1])])
        recon = [
            participation.where_replicas(present, r, jnp.zeros_like(r)) for r in recon
        ]
        return recon, present

    def inbox_rows(self, num_replicas: int) -> int:
        return num_replicas if self.island is None else self.island[1]

    @property
    def _mark(self) -> int:
        """Bytes of the presence mark: 1 for an island, whose peers may be absent."""
        return int(self.island is not None)


def posted_exchange(
    mesh: Mesh | None = None, *, island: tuple[int, int] | None = None
) -> PostedExchange:
    """The posted exchange: pass it as `streaming_diloco(..., exchange=...)`.

    Args:
        mesh: the compute mesh the replicas are sharded over (`courier_meshes`), or
            None for the simulation on one device.
        island: `(m, M)` for island m of an elastic job of M islands (one replica
            per program, built with `num_replicas=1`): its messages carry the
            presence mark, and its inbox has a row per island.

    Returns:
        A `PostedExchange`. The algorithm's state gains an outbox `[M, K, B]` and an
        inbox `[K, R, B]` of packed messages (K in-flight slots, B the bytes of the
        largest fragment's message, R the rows read: M, or the islands); a
        `Courier` moves one to the other, between the halves of a step when τ = 0.
    """
    return _Posted(mesh, island)
