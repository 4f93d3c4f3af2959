"""Tests for sdiloco.merging: the merges as plug-ins of the algorithm.

Limit cases of Eager (τ = 0 is α = 0; one replica is the outer step without delay),
a merge written by a user, the plug-in state checkpointed, restored and healed like
the rest of the state, and bad input. The float64 reference of Eager's update is in
`test_reference.py`.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from helpers import relaxed, toy_batches, toy_loss, toy_params, tree_difference

import sdiloco
from sdiloco.lab.checkpoint import Checkpointer


def _alg(*, M=2, tau=1, merge="eager", alpha=0.5, compressor=None, H=4):
    params = toy_params(jr.key(0))
    plugins = sdiloco.eager() if merge == "eager" else merge
    plugins = () if merge == "alpha" else plugins
    alpha = alpha if merge == "alpha" else None
    return params, sdiloco.streaming_diloco(
        toy_loss,
        inner=relaxed(optax.adamw(0.05)),
        num_replicas=M,
        sync_every=H,
        fragments=sdiloco.fragments_by_layer(
            params, blocks=lambda p: p["blocks"], layers_per_fragment=2
        ),
        overlap=tau,
        alpha=alpha,
        compressor=compressor,
        plugins=plugins,
    )


def _merge_state(alg, state, params):
    """The merging plug-in's state as a tree like `params` (`[M, ...]` leaves)."""
    chain = alg.spec.plugin
    k = next(i for i, p in enumerate(chain.plugins) if p.merges)
    arrays = eqx.filter(params, eqx.is_inexact_array)
    return jax.tree.unflatten(jax.tree.structure(arrays), state.plugin_state[k])


def _run(alg, params, steps, M, state=None):
    state = alg.init(params, jr.key(7)) if state is None else state
    step = sdiloco.jit_step(alg)
    dtype = jax.tree.leaves(params)[0].dtype
    batches = toy_batches(jr.key(1), steps=steps, replicas=M, dtype=dtype)
    for b in batches[int(state.step) :]:
        state, metrics = step(state, b)
    return state


@pytest.mark.two_programs
def test_eager_with_no_overlap_is_alpha_zero_bitwise():
    """τ = 0: the stand-in is replaced in the step that applies it, so the replica
    takes θ_g, as with α = 0."""
    params, eager = _alg(tau=0)
    _, alpha0 = _alg(tau=0, merge="alpha", alpha=0.0)
    a, b = _run(eager, params, 14, 2), _run(alpha0, params, 14, 2)
    assert tree_difference(a.replica_params, b.replica_params) is None
    assert tree_difference(a.global_params, b.global_params) is None
    assert tree_difference(a.global_params, params, rtol=1e-3, atol=0) is not None


def test_eager_with_one_replica_is_the_outer_step_without_delay():
    """M = 1: the stand-in is the real outer step, so with any τ the replica trains
    as with τ = 0, α = 0 (up to the rounding of θ_m − θ̃ + θ_g)."""
    with jax.enable_x64(True):
        params, eager = _alg(M=1, tau=3)
        _, now = _alg(M=1, tau=0, merge="alpha", alpha=0.0)
        params = jax.tree.map(lambda x: x.astype(jnp.float64), params)
        a, b = _run(eager, params, 17, 1), _run(now, params, 17, 1)
        # α = 0.5 with the same delay is not the same (the check can fail)
        _, late = _alg(M=1, tau=3, merge="alpha")
        c = _run(late, params, 17, 1)
    assert (
        tree_difference(a.replica_params, b.replica_params, rtol=1e-12, atol=1e-14)
        is None
    )
    # (θ_g itself lags by τ: some fragment is always in flight with H = 4, τ = 3)
    assert (
        tree_difference(c.replica_params, b.replica_params, rtol=1e-6, atol=0)
        is not None
    )


class Halfway(sdiloco.Plugin):
    """A user's merge: on arrival, move halfway from the replica to θ_g, and keep a
    count of the merges per element (to exercise plug-in state)."""

    merges = True

    def init(self, params, num_replicas, num_fragments):
        return [jnp.zeros((num_replicas,) + x.shape, x.dtype) for x in params]

    def on_arrival(self, arrival, replicas, state):
        v, new, counts = arrival.visit, [], []
        pieces = zip(
            v.gather(replicas, 1), v.gather(arrival.global_), v.gather(state, 1)
        )
        for r, g, c in pieces:
            g = arrival.fetch(g)[None]
            due = arrival.due.reshape((-1,) + (1,) * (r.ndim - 1))
            mixed = jnp.where(arrival.ok, 0.5 * r + 0.5 * g, g)
            new.append(jnp.where(due, mixed, r))
            counts.append(c + due.astype(c.dtype))
        return v.scatter(replicas, new, 1), v.scatter(state, counts, 1)


@pytest.mark.two_programs
def test_a_users_policy_is_the_alpha_merge_it_restates():
    params, mine = _alg(merge=Halfway())
    _, alpha = _alg(merge="alpha", alpha=0.5)
    a, b = _run(mine, params, 14, 2), _run(alpha, params, 14, 2)
    assert tree_difference(a.replica_params, b.replica_params) is None
    counts = np.asarray(
        _merge_state(mine, a, params)["v"]
    )  # fragment 0 merged at steps 5, 9, 13
    np.testing.assert_array_equal(counts, np.full_like(counts, 3.0))


def test_policy_state_is_checkpointed_and_restored_bitwise(tmp_path):
    params, alg = _alg(compressor="int4,ef")
    whole = _run(alg, params, 14, 2)
    half = _run(alg, params, 9, 2)
    fresh = alg.init(params).plugin_state
    assert tree_difference(half.plugin_state, fresh) is not None
    ckpt = Checkpointer(tmp_path, config_json="{}")
    ckpt.save(9, half, {})
    template = alg.init(params, jr.key(7))
    restored, _ = ckpt.restore(template)
    assert tree_difference(restored.plugin_state, half.plugin_state) is None
    resumed = _run(alg, params, 14, 2, state=restored)
    assert tree_difference(resumed, whole) is None


def test_a_replica_that_comes_back_starts_its_policy_state_from_theta_g():
    params, alg = _alg()
    state = _run(alg, params, 9, 2)
    step = jax.jit(alg.step)
    batch = toy_batches(jr.key(2), steps=1, replicas=2)[0]
    gone = sdiloco.Participation.of([True, False])
    state, _ = step(state, batch, gone)
    back = sdiloco.everyone(2)
    state, _ = step(state, batch, back)
    g = np.asarray(state.global_params["v"])
    np.testing.assert_array_equal(
        np.asarray(_merge_state(alg, state, params)["v"])[1], g
    )


def test_bad_merge_is_refused_before_any_compute():
    with pytest.raises(ValueError, match="alpha=0.3 with plugins that merge"):
        sdiloco.streaming_diloco(
            toy_loss, inner=optax.sgd(0.1), alpha=0.3, plugins=sdiloco.eager()
        )
    with pytest.raises(ValueError, match="each merge the outer step; allowed: one"):
        sdiloco.streaming_diloco(
            toy_loss,
            inner=optax.sgd(0.1),
            plugins=(sdiloco.eager(), sdiloco.alpha_merge(0.5)),
        )
    with pytest.raises(ValueError, match=r"alpha=1.5; must be in \[0, 1\]"):
        sdiloco.AlphaMerge(1.5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_eager_compiles_once_and_keeps_the_state_stable(dtype):
    params, alg = _alg(compressor="topk:0.5/4,int2:sr,ef:0.9")
    params = jax.tree.map(lambda x: x.astype(dtype), params)
    step = eqx.filter_jit(eqx.debug.assert_max_traces(alg.step, max_traces=1))
    state = alg.init(params, jr.key(0))
    before = jax.tree.map(lambda x: (x.shape, x.dtype), state)
    for b in toy_batches(jr.key(1), steps=10, replicas=2, dtype=dtype):
        state, metrics = step(state, b)
        assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == before
    stand_ins = jax.tree.leaves(_merge_state(alg, state, params))
    assert stand_ins and all(x.dtype == dtype for x in stand_ins)
    cond_step = jax.jit(
        lambda s, b, p: jax.lax.cond(p, lambda s: alg.step(s, b)[0], lambda s: s, s)
    )
    cond_step(state, b, True)


def test_a_replica_that_does_not_send_applies_no_stand_in():
    """Eager with a replica that computes but does not send at fragment 0's second
    send (step 8): it keeps its parameters, and its policy state is θ_g (no stand-in
    to swap out on arrival), while the sender holds its stand-in."""
    params, alg = _alg(tau=1)
    state = _run(alg, params, 7, 2)
    batch = toy_batches(jr.key(2), steps=1, replicas=2)[0]
    quiet = sdiloco.Participation.of([True, True], [True, True], [True, False])
    before = state
    state, metrics = jax.jit(alg.step)(state, batch, quiet)
    assert bool(np.asarray(metrics["sync/sent"])[0])  # fragment 0 ("v") was sent
    g = np.asarray(state.global_params["v"])
    stand_in = np.asarray(_merge_state(alg, state, params)["v"])
    np.testing.assert_array_equal(stand_in[1], g)
    mine = stand_in[0]
    np.testing.assert_array_equal(mine, np.asarray(state.replica_params["v"])[0])
    assert not np.array_equal(mine, g)  # the sender did step from θ_g
    # the stale state of the last round would have been the sender's old stand-in
    assert not np.array_equal(np.asarray(_merge_state(alg, before, params)["v"])[1], g)
