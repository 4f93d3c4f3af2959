"""Replicas sharded over devices and hosts: meshes, the packed wire format, the exchange.

One concept per module:

- `mesh`: the replica mesh and the placement of states, batches and steps on it;
- `wire`: the packed `uint8` message of one fragment: what the compressor encodes,
  integer fields at their width (`pack_bits` / `unpack_bits`, `pack4`, `Wire`);
- `exchange`: `sharded_exchange`, the per-replica exchange hook of `streaming_diloco`;
- `posted`: the exchange split around the steps that move it (`posted_exchange`);
- `transport`: the one way messages cross between programs (`Transport`:
  `InProcess`, `MeshAllGather`, `board.BoardTransport`, or a function of yours);
- `courier`: runs a posted algorithm's steps and hands each fragment's messages to
  its transport between them (`Courier`, `courier_meshes`);
- `hlo`: reading a compiled program's collectives and the bytes on the wire;
- `net`: bytes between the programs of an elastic job: a key-value store served
  over TCP (the standard library), values of any size;
- `board`: replica islands that fail and rejoin (`Board`, `BoardTransport`, the
  board's `Keys`, healing from a live peer), the exchange of the elastic job;
- `coordinator`: the elastic job's coordinator (`BoardServer`, `Coordinator`:
  who takes part in each round, heal routing).
"""

from .board import (
    Board as Board,
    BoardError as BoardError,
    BoardLost as BoardLost,
    BoardProtocolError as BoardProtocolError,
    BoardTransport as BoardTransport,
    Keys as Keys,
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
from .posted import posted_exchange as posted_exchange
from .transport import (
    HostTransport as HostTransport,
    InProcess as InProcess,
    MeshAllGather as MeshAllGather,
    Transport as Transport,
    as_transport as as_transport,
)
from .wire import (
    pack4 as pack4,
    pack_bits as pack_bits,
    unpack4 as unpack4,
    unpack_bits as unpack_bits,
)
