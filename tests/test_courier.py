"""The posted exchange and its courier: the numbers of the in-step exchange, with the
messages moved between steps.

In the simulation the posted run is bitwise the in-step run (the same encode, the same
decode, the mean in the same order; only the float in-flight slot is filled at the
arrival instead of at the send, so it is left out of the comparison). On a mesh
(compute devices plus one communication device) the run agrees with the simulation
within the tolerance of `tests/test_distributed.py`, and neither of the step's two
programs holds a collective: the only bytes between replicas are the courier's.
"""

import time
from typing import cast

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import (
    assert_trees_allclose,
    assert_trees_equal,
    toy_batches,
    toy_params,
    toy_streaming,
    tree_allclose,
)

import sdiloco
from sdiloco import analysis, distributed
from sdiloco.lab import config as config_lib, train
from sdiloco.lab.checkpoint import Checkpointer


M = 2
TOL = dict(rtol=1e-5, atol=1e-6)
CASES = {
    "e3m0_ef": dict(compressor="e3m0", plugins=sdiloco.error_feedback()),
    "fp32_tau2": dict(overlap=2),
    "e3m0_tau_per_replica": dict(compressor="e3m0", overlap=(1, 2)),
    "fp32_tau0": dict(overlap=0),  # DiLoCo: the messages move between the halves
    "e3m0_ef_tau0": dict(
        compressor="e3m0", plugins=sdiloco.error_feedback(), overlap=0
    ),
}


def _training(state):
    """The state without the posted buffers and the float in-flight slots."""
    return state._replace(outbox=None, inbox=None, inflight=None)


def _pair(params, **kw):
    ref = toy_streaming(params, num_replicas=M, **kw)
    posted = toy_streaming(
        params, num_replicas=M, exchange=distributed.posted_exchange(), **kw
    )
    return ref, posted


@pytest.mark.parametrize("case", sorted(CASES))
def test_posted_simulation_is_bitwise_the_in_step_exchange(case):
    params = toy_params(jr.key(5))
    batches = toy_batches(jr.key(6), steps=13, replicas=M)
    ref_alg, alg = _pair(params, **CASES[case])
    ref, state = ref_alg.init(params, jr.key(7)), alg.init(params, jr.key(7))
    step, courier = sdiloco.jit_step(ref_alg), distributed.Courier(alg)
    applied = 0
    for batch in batches:
        ref, ref_m = step(ref, batch)
        state, m = courier(state, batch)
        for k in ("sync/sent", "sync/applied", "sync/merged", "loss/replicas"):
            np.testing.assert_array_equal(np.asarray(m[k]), np.asarray(ref_m[k]))
        applied += int(np.asarray(m["sync/applied"]).sum())
        assert_trees_equal(_training(state), _training(ref))
    assert applied >= 4
    assert not tree_allclose(state.global_params, params)
    # One message per send, each delivered at its arrival step.
    assert len(courier.events) == applied + sum(
        1 for e in courier.events if e["arrival_step"] > len(batches)
    )


def test_posted_state_holds_packed_messages():
    params = toy_params(jr.key(5))
    _, alg = _pair(params, compressor="e3m0")
    state = alg.init(params, jr.key(7))
    sizes = alg.spec.message_bytes(params)
    bits = alg.bits_per_fragment(params)
    # e3m0: two codes per byte plus the f32 scales, the accounting's bits in bytes.
    np.testing.assert_array_equal(sizes, [-(-int(b) // 8) for b in bits])
    k = alg.spec.layout(params).num_slots
    assert state.outbox.shape == (M, k, sizes.max())
    assert state.inbox.shape == (k, M, sizes.max())
    assert state.outbox.dtype == state.inbox.dtype == jnp.uint8


def test_a_courier_started_mid_flight_posts_again():
    """A checkpoint holds the outbox: a fresh courier re-sends what is in flight."""
    params = toy_params(jr.key(5))
    batches = toy_batches(jr.key(6), steps=12, replicas=M)
    _, alg = _pair(params, compressor="e3m0", overlap=2)
    whole = distributed.Courier(alg)
    state = alg.init(params, jr.key(7))
    for batch in batches:
        state, _ = whole(state, batch)
    first = distributed.Courier(alg)
    half = alg.init(params, jr.key(7))
    for batch in batches[:7]:
        half, _ = first(half, batch)
    sent_at = np.asarray(half.sent_at)
    assert np.any((sent_at >= 0) & (7 < sent_at + 2)), "nothing in flight at step 7"
    saved = jax.tree.map(lambda x: np.asarray(x), half)  # what a checkpoint keeps
    resumed = jax.tree.map(jnp.asarray, saved)
    second = distributed.Courier(alg)
    for batch in batches[7:]:
        resumed, _ = second(resumed, batch)
    assert_trees_equal(_training(resumed), _training(state))


@pytest.mark.hlo
def test_courier_on_a_mesh_agrees_and_its_programs_hold_no_collective():
    params = toy_params(jr.key(5))
    batches = toy_batches(jr.key(6), steps=10, replicas=M)
    kw = dict(compressor="e3m0", plugins=sdiloco.error_feedback())
    mesh, comm = distributed.courier_meshes(M, jax.devices()[:3])
    assert comm.devices.size == 1 and comm.devices.flat[0] not in mesh.devices.flat
    ref_alg = toy_streaming(params, num_replicas=M, **kw)
    alg = toy_streaming(
        params, num_replicas=M, exchange=distributed.posted_exchange(mesh), **kw
    )
    ref = ref_alg.init(params, jr.key(7))
    state = distributed.shard_state(alg.init(params, jr.key(7)), mesh)
    courier = distributed.Courier(alg, mesh, comm)
    step = sdiloco.jit_step(ref_alg)
    for batch in batches:
        ref, ref_m = step(ref, batch)
        state, m = courier(state, distributed.shard_batch(batch, mesh, M))
    courier.close()
    host = courier.host(m)
    np.testing.assert_allclose(
        host["loss/train"], np.asarray(ref_m["loss/train"]), 1e-5
    )
    np.testing.assert_allclose(
        host["loss/replicas"], np.asarray(ref_m["loss/replicas"]), 1e-5
    )
    assert_trees_allclose(jax.device_get(_training(state)), _training(ref), **TOL)
    assert all("waited" in e for e in courier.events if e["arrival_step"] <= 10)
    # The two programs of a step hold no collective: replicas meet only through the
    # courier's all-gather on the communication device.
    batch = distributed.shard_batch(batches[0], mesh, M)
    first, second = courier.programs
    text = first.lower(state, batch).compile().as_text()
    assert distributed.collectives(text, mesh) == []
    state, local = first(state, batch)
    text = second.lower(state, local).compile().as_text()
    assert distributed.collectives(text, mesh) == []


def test_bad_input():
    params = toy_params(jr.key(5))
    with pytest.raises(ValueError, match="posted_exchange"):
        distributed.Courier(toy_streaming(params, num_replicas=M))
    _, alg = _pair(params)
    with pytest.raises(ValueError, match="comm_mesh"):
        distributed.Courier(alg, distributed.replica_mesh(M, jax.devices()[:2]))
    with pytest.raises(ValueError, match="no device left to compute"):
        distributed.courier_meshes(M, jax.devices()[:1])
    with pytest.raises(ValueError, match="posted exchange"):
        analysis.inflight_outer_gradients(alg.spec, alg.init(params))
    with pytest.raises(ValueError, match="metrics"):
        distributed.sharded_step(alg.step, distributed.replica_mesh(M), metrics="x")


# ---------------------------------------------------------------- failures


def _mesh_run(params, steps, timeout=600.0):
    """A posted e3m0 run on a mesh of 2 compute devices and a courier."""
    mesh, comm = distributed.courier_meshes(M, jax.devices()[:3])
    alg = toy_streaming(
        params,
        num_replicas=M,
        compressor="e3m0",
        exchange=distributed.posted_exchange(mesh),
    )
    state = distributed.shard_state(alg.init(params, jr.key(7)), mesh)
    courier = distributed.Courier(alg, mesh, comm, timeout=timeout)
    batches = [
        distributed.shard_batch(b, mesh, M)
        for b in toy_batches(jr.key(6), steps=steps, replicas=M)
    ]
    return courier, state, batches


def _until_error(courier, state, batches):
    """Steps until the courier raises; the error and the state last passed in."""
    for batch in batches:
        try:
            state, _ = courier(state, batch)
        except distributed.CourierError as error:
            return error, state
    raise AssertionError("no CourierError")


def test_a_failed_transfer_names_the_fragment_and_leaves_the_state_intact():
    params = toy_params(jr.key(5))
    courier, state, batches = _mesh_run(params, steps=12)

    def broken(x):
        raise RuntimeError("link down")

    with courier:
        # every all-gather of the courier fails
        gathering = cast(distributed.MeshAllGather, courier.transport)
        gathering._gather = broken  # pyright: ignore[reportAttributeAccessIssue]
        error, state = _until_error(courier, state, batches)
    message = str(error)
    assert "fragment " in message and "sent at step" in message, message
    assert "processes [0]" in message and "link down" in message, message
    # The step that raised donated nothing: its input is readable and whole.
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))
    step = int(state.step)
    assert step + 1 == int(message.split("due at step ")[1].split(")")[0])
    assert jnp.all(jnp.isfinite(state.global_params["v"]))


def test_a_stuck_transfer_times_out_within_the_bound():
    params = toy_params(jr.key(5))
    courier, state, batches = _mesh_run(params, steps=12, timeout=0.5)
    gathering = cast(distributed.MeshAllGather, courier.transport)
    gather = gathering._gather

    def stuck(x):
        time.sleep(6.0)  # a dead peer: the bytes never come in time
        return gather(x)

    gathering._gather = stuck  # pyright: ignore[reportAttributeAccessIssue]
    start = time.perf_counter()
    with pytest.raises(distributed.CourierError, match="within timeout=0.5 s"):
        with courier:
            for batch in batches:
                start = time.perf_counter()
                state, _ = courier(state, batch)
    # The step that raised waited once, for the bound (plus compiling its programs),
    # and leaving the courier did not wait for the stuck transfer.
    assert time.perf_counter() - start < 4.0
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))


def test_a_courier_given_another_state_reads_its_step():
    """The host's step counter follows the state: a state the courier did not return
    (here: one step behind) is read again, and the step is the same as a fresh
    courier's."""
    params = toy_params(jr.key(5))
    batches = toy_batches(jr.key(6), steps=6, replicas=M)
    _, alg = _pair(params, compressor="e3m0")
    courier = distributed.Courier(alg)
    state = alg.init(params, jr.key(7))
    for batch in batches[:4]:
        state, _ = courier(state, batch)
    copy = jax.tree.map(jnp.copy, state)  # not the object the courier returned
    a, _ = courier(copy, batches[4])
    b, _ = distributed.Courier(alg)(jax.tree.map(jnp.copy, state), batches[4])
    assert int(a.step) == int(b.step) == 5
    assert_trees_equal(_training(a), _training(b))


@pytest.mark.integration
def test_a_failed_run_keeps_its_last_checkpoint(tmp_path, monkeypatch):
    """`train.run` with a courier whose transfers start failing after step 6: the run
    stops with the courier's error, its couriers and checkpointer released, and the
    step-4 checkpoint restores; resumed with a working link it completes."""
    config = config_lib.preset(
        "streaming_overlap_fp4",
        model="tiny-xxs",
        steps=12,
        method={"sync_every": 4},
        data={"global_batch_size": 8},
        checkpoint_every=4,
        eval_every=12,
        eval_windows=64,
    )
    move = distributed.MeshAllGather.move

    def failing(self, x, fragment, sent):
        if sent + 1 > 6:  # arriving after step 6 (τ = 1)
            raise RuntimeError("link down")
        return move(self, x, fragment, sent)

    with jax.numpy_dtype_promotion("standard"):
        monkeypatch.setattr(distributed.MeshAllGather, "move", failing)
        with pytest.raises(distributed.CourierError, match="link down"):
            train.run(config, tmp_path, courier=True, progress=False)
        ckpt = Checkpointer(str(tmp_path / "checkpoints"), config.to_json())
        try:
            assert ckpt.latest_step() == 4
        finally:
            ckpt.close()
        monkeypatch.setattr(distributed.MeshAllGather, "move", move)
        history = train.run(config, tmp_path, courier=True, progress=False)
    assert int(history.state.step) == 12
