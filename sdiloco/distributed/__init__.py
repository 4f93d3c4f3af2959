"""Replicas sharded over devices and hosts: meshes, the packed wire format, the exchange."""

from .exchange import (
    AXIS as AXIS,
    Collective as Collective,
    collectives as collectives,
    pack4 as pack4,
    process_replicas as process_replicas,
    replica_mesh as replica_mesh,
    shard_batch as shard_batch,
    shard_state as shard_state,
    sharded_exchange as sharded_exchange,
    sharded_step as sharded_step,
    state_shardings as state_shardings,
    unpack4 as unpack4,
    wire_bytes as wire_bytes,
)
