"""Replicas sharded over devices and hosts: meshes, the packed wire format, the exchange.

One concept per module:

- `mesh`: the replica mesh and the placement of states, batches and steps on it;
- `wire`: the packed `uint8` message of one fragment: what the compressor encodes,
  integer fields at their width (`pack_bits` / `unpack_bits`, `pack4`, `Wire`);
- `exchange`: `sharded_exchange`, the per-replica exchange hook of `streaming_diloco`;
- `posted`: the exchange split around the steps that move it (`posted_exchange`);
- `transport`: the one way messages cross between programs (`Transport`:
  `InProcess`, `MeshAllGather`, `ray_transport.RayTransport`, or a function of
  yours);
- `courier`: runs a posted algorithm's steps and hands each fragment's messages to
  its transport between them (`Courier`, `courier_meshes`);
- `hlo`: reading a compiled program's collectives and the bytes on the wire;
- `ray_transport`: replica islands that fail and rejoin, their rounds and heals
  through Ray's object store (`RayTransport`), the exchange of the elastic job;
- `syncer`: the elastic job's syncer, a Ray actor that carries control only
  (`Syncer`: who takes part in each round, who may join, heal routing).

`ray_transport` and `syncer` import Ray only when called (the `elastic` extra).
"""

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
from .ray_transport import (
    ElasticError as ElasticError,
    RayTransport as RayTransport,
    Refused as Refused,
    SyncerLost as SyncerLost,
)
from .syncer import Syncer as Syncer
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
