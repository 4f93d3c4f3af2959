"""One process of a timed exchange over the emulated WAN (`benchmarks/wan.py`).

Usage: `python -m benchmarks.wan_worker COORDINATOR NUM_PROCESSES PROCESS_ID
[--elements N] [--rounds R] [--compressor e3m0]`

Every process holds one replica of an N-element outer gradient (one fragment) and runs
the library's sharded exchange (`distributed.sharded_exchange`: encode, all-gather of
the packed message over jax.distributed's CPU collectives, decode, fixed-order mean).
After a warm-up exchange, R exchanges are timed; process 0 prints one JSON line:
`{"message_bytes": ..., "seconds_per_exchange": [...]}` (the bytes read off the
compiled program, `distributed.wire_bytes`).
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import sdiloco
from sdiloco import distributed
from sdiloco.lab import cluster


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("coordinator")
    p.add_argument("num_processes", type=int)
    p.add_argument("process_id", type=int)
    p.add_argument("--elements", type=int, default=1 << 20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compressor", default="e3m0")
    args = p.parse_args(argv)
    cluster.connect(args.coordinator, args.num_processes, args.process_id, timeout_s=60)
    try:
        m = args.num_processes
        mesh = distributed.replica_mesh(m)
        params = {"w": jnp.zeros((args.elements,), jnp.float32)}
        frags = sdiloco.single_fragment(params)
        exchange = distributed.sharded_exchange(mesh)
        compressor = None if args.compressor == "fp32" else sdiloco.quantizer("e3m0")
        sharding = NamedSharding(mesh, PartitionSpec(distributed.AXIS))
        mine = distributed.process_replicas(mesh, m)
        local = np.asarray(jr.normal(jr.key(0), (m, args.elements)))[mine]
        deltas = [jax.make_array_from_process_local_data(sharding, local)]

        @jax.jit
        def run(deltas, key):
            mean, _ = exchange(compressor, frags, deltas, key)
            return mean

        compiled = run.lower(deltas, jr.key(1)).compile()
        message = distributed.wire_bytes(compiled.as_text(), m)[0]
        jax.block_until_ready(compiled(deltas, jr.key(1)))  # warm-up
        times = []
        for r in range(args.rounds):
            start = time.perf_counter()
            jax.block_until_ready(compiled(deltas, jr.key(2 + r)))
            times.append(time.perf_counter() - start)
        if jax.process_index() == 0:
            print(
                json.dumps({"message_bytes": message, "seconds_per_exchange": times}),
                flush=True,
            )
    finally:
        cluster.disconnect()


if __name__ == "__main__":
    main()
