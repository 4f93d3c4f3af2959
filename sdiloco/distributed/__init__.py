"""Replicas sharded over devices and hosts: meshes, the packed wire format, the exchange.

One concept per module:

- `mesh`: the replica mesh and the placement of states, batches and steps on it;
- `wire`: the packed `uint8` message of one fragment: what the compressor encodes,
  integer fields at their width (`pack_bits` / `unpack_bits`, `pack4`, `Wire`);
- `exchange`: `sharded_exchange`, the per-replica exchange hook of `streaming_diloco`;
- `courier`: the exchange overlapped with the next τ inner steps (`posted_exchange`,
  `Courier`, `courier_meshes`);
- `hlo`: reading a compiled program's collectives and the bytes on the wire;
- `net`: bytes between the programs of an elastic job: a key-value store served
  over TCP (the standard library), values of any size;
- `board`: replica islands that fail and rejoin (`Board`, `board_exchange`,
  healing from a live peer), the exchange of the elastic job;
- `coordinator`: the elastic job's coordinator (`BoardServer`, `Coordinator`:
  who takes part in each round, heal routing).
"""

from .board import (
    Board as Board,
    BoardError as BoardError,
    BoardLost as BoardLost,
    BoardProtocolError as BoardProtocolError,
    board_exchange as board_exchange,
)
from .coordinator import (
    BoardServer as BoardServer,
    Coordinator as Coordinator,
    coordinate as coordinate,
)
from .courier import (
    Courier as Courier,
    CourierError as CourierError,
    courier_meshes as courier_meshes,
    posted_exchange as posted_exchange,
)
from .exchange import sharded_exchange as sharded_exchange
from .hlo import (
    Collective as Collective,
    by_axis as by_axis,
    collectives as collectives,
    wire_bytes as wire_bytes,
)
from .mesh import (
    AXIS as AXIS,
    DATA as DATA,
    batch_sharding as batch_sharding,
    process_replicas as process_replicas,
    replica_mesh as replica_mesh,
    shard_batch as shard_batch,
    shard_state as shard_state,
    sharded_step as sharded_step,
    state_shardings as state_shardings,
)
from .wire import (
    pack4 as pack4,
    pack_bits as pack_bits,
    unpack4 as unpack4,
    unpack_bits as unpack_bits,
)
