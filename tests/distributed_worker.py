"""One process of the two-process test: the toy model, Streaming DiLoCo, one replica each.

Run by `tests/test_distributed.py` as
`python tests/distributed_worker.py COORDINATOR NUM_PROCESSES PROCESS_ID OUT`. Every
process builds the same problem (`problem()`, also used by the test for its
single-process reference), feeds only its own replicas' batches, and process 0 saves
the final global parameters to OUT (`.npz`).
"""

import sys

import jax
import jax.random as jr
import numpy as np
from helpers import toy_batches, toy_params, toy_streaming

import sdiloco
from sdiloco import distributed


STEPS = 7  # syncs at 2, 3, 4, ...: fragments in flight (τ = 1) at the end


def problem(exchange=None):
    """`(algorithm, params, batches)` of the two-process test (M = 2, e3m0, τ = 1)."""
    params = toy_params(jr.key(0))
    extra = {} if exchange is None else {"exchange": exchange}
    alg = toy_streaming(
        params,
        num_replicas=2,
        layers_per_fragment=2,
        sync_every=2,
        compressor="e3m0",
        plugins=sdiloco.error_feedback(),
        **extra,
    )
    return alg, params, toy_batches(jr.key(1), steps=STEPS, replicas=2)


def run_sharded(mesh):
    """Run `problem()` with the replicas sharded over `mesh`; the final global params."""
    alg, params, batches = problem(distributed.sharded_exchange(mesh))
    mine = distributed.process_replicas(mesh, alg.num_replicas)
    state = distributed.shard_state(alg.init(params, jr.key(2)), mesh)
    step = distributed.sharded_step(alg.step, mesh)
    for batch in batches:
        local = jax.tree.map(lambda x: np.asarray(x)[mine], batch)
        state, _ = step(state, distributed.shard_batch(local, mesh, alg.num_replicas))
    return jax.tree.map(
        lambda x: np.asarray(x.addressable_data(0)), state.global_params
    )


def main(coordinator, num_processes, process_id, out):
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    jax.config.update("jax_numpy_rank_promotion", "raise")
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=int(num_processes),
        process_id=int(process_id),
        initialization_timeout=60,
    )
    try:
        mesh = distributed.replica_mesh(2)
        final = run_sharded(mesh)
        if jax.process_index() == 0:
            np.savez(out, **{k: v for k, v in sorted(_flat(final).items())})
        print(f"process {jax.process_index()} done", flush=True)
    finally:
        jax.distributed.shutdown()


def _flat(tree):
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p): x for p, x in leaves}


if __name__ == "__main__":
    main(*sys.argv[1:])
