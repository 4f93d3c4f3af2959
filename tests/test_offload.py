"""Host offload of θ_g and the outer state: the same numbers, θ_g kept in host memory.

On CPU, host and device memory are the same RAM, so what this tier can check is that
the offloaded run is bitwise the plain one, that θ_g and the outer state stay in the
`pinned_host` memory kind from step to step, and that the compiled step moves pieces
between memory spaces; the device bytes are measured on an accelerator by
`benchmarks/memory.py --offload` (see benchmarks/README.md).
"""

import jax
import jax.random as jr
import numpy as np
import pytest
from helpers import (
    assert_trees_equal,
    toy_batches,
    toy_params,
    toy_streaming,
    tree_equal,
)

import sdiloco
from sdiloco import distributed


def _run(offload, steps=10, **kw):
    params = toy_params(jr.key(0))
    alg = toy_streaming(
        params, num_replicas=2, layers_per_fragment=1, offload=offload, **kw
    )
    state = alg.init(params, jr.key(1))
    step = sdiloco.jit_step(alg)
    for batch in toy_batches(jr.key(2), steps=steps, replicas=2):
        state, metrics = step(state, batch)
    return state, step


@pytest.mark.parametrize(
    "options",
    [
        dict(compressor="e3m0", plugins=sdiloco.error_feedback()),
        dict(compressor=None, overlap=2, sync_every=4),
    ],
)
def test_offloaded_run_is_bitwise_the_plain_one(options):
    plain, _ = _run(False, **options)
    offloaded, _ = _run(True, **options)
    host = jax.tree.map(np.asarray, offloaded)
    assert_trees_equal(host, jax.tree.map(np.asarray, plain))
    # Syncs happened: θ_g moved away from the initial parameters.
    assert not tree_equal(plain.global_params, toy_params(jr.key(0)))
    for x in jax.tree.leaves((offloaded.global_params, offloaded.outer_state)):
        assert x.sharding.memory_kind == "pinned_host"
    for x in jax.tree.leaves((offloaded.replica_params, offloaded.inflight)):
        assert x.sharding.memory_kind == "device"


@pytest.mark.hlo
def test_offloaded_step_moves_pieces_between_memory_spaces():
    params = toy_params(jr.key(0))
    alg = toy_streaming(params, num_replicas=2, compressor="e3m0", offload=True)
    state = alg.init(params, jr.key(1))
    batch = toy_batches(jr.key(2), steps=1, replicas=2)[0]
    text = jax.jit(alg.step).lower(state, batch).as_text()
    # StableHLO marks each move with the target memory kind.
    assert 'mhlo.memory_kind = "pinned_host"' in text
    assert 'mhlo.memory_kind = "device"' in text


def test_offloaded_sharded_run_keeps_the_global_state_on_host():
    # Replicas sharded over 2 devices, θ_g and the outer state in host memory: the
    # same numbers as the offloaded simulation within float32 rounding (see
    # sdiloco/distributed/mesh.py for why not bitwise).
    params = toy_params(jr.key(0))
    mesh = distributed.replica_mesh(2, jax.devices()[:2])
    alg = toy_streaming(
        params,
        num_replicas=2,
        compressor="e3m0",
        offload=True,
        exchange=distributed.sharded_exchange(mesh),
    )
    state = distributed.shard_state(alg.init(params, jr.key(1)), mesh)
    step = distributed.sharded_step(alg.step, mesh)
    for batch in toy_batches(jr.key(2), steps=10, replicas=2):
        state, _ = step(state, distributed.shard_batch(batch, mesh, 2))
    reference, _ = _run(True, compressor="e3m0")
    for x in jax.tree.leaves((state.global_params, state.outer_state)):
        assert x.sharding.memory_kind == "pinned_host"
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(reference)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
