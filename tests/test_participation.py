"""Elastic training: who takes part in a step is data (`sdiloco.participation`).

Properties: everyone present is the step without a participation, bitwise; a replica
absent for the whole run is an (M−1)-replica run; an absent replica's data and
parameters never reach θ_g and its state is never touched; a replica that comes
back holds θ_g and a live peer's inner state; random traces stay finite.
"""

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from helpers import (
    assert_trees_allclose,
    assert_trees_equal,
    plugin_state,
    tree_equal,
)
from hypothesis import given, settings, strategies as st

import sdiloco
from sdiloco.aggregation import token_weighted_mean
from sdiloco.participation import Participation, everyone


SHAPES = {"a": (6,), "b": (3, 4), "c": (5,)}


@pytest.fixture(autouse=True)
def standard_promotion():
    """optax's Adam computes `b1 ** count`, which strict promotion rejects."""
    with jax.numpy_dtype_promotion("standard"):
        yield


STEPS = 14


def _loss(params, batch):
    """A least-squares loss whose gradient depends on each replica's batch."""
    pred = params["b"] @ batch["x"][:4] + params["a"][:3].sum() + params["c"][0]
    return jnp.mean((pred - batch["y"]) ** 2)


def _params():
    keys = jr.split(jr.key(0), 3)
    return {k: jr.normal(key, s) for (k, s), key in zip(SHAPES.items(), keys)}


def _batches(num_replicas, steps=STEPS, seed=1):
    k1, k2 = jr.split(jr.key(seed))
    return [
        {
            "x": jr.normal(jr.fold_in(k1, t), (num_replicas, 6)),
            "y": jr.normal(jr.fold_in(k2, t), (num_replicas, 3)),
        }
        for t in range(steps)
    ]


def _streaming(num_replicas=3, compressor="e3m0", **kw):
    params = _params()
    frags = sdiloco.fragments_from_labels(params, {"a": 0, "b": 1, "c": 0})
    return sdiloco.streaming_diloco(
        _loss,
        inner=optax.adam(1e-2),
        outer=optax.sgd(0.7, momentum=0.9, nesterov=True),
        num_replicas=num_replicas,
        sync_every=4,
        fragments=frags,
        overlap=1,
        alpha=0.5,
        compressor=compressor,
        **kw,
    )


def _run(alg, batches, trace=None, state=None):
    """Run `alg` over `batches`; `trace[t]` is step t's participation (or None)."""
    state = alg.init(_params()) if state is None else state
    step = jax.jit(alg.step)
    for t, batch in enumerate(batches):
        p = None if trace is None else trace[t]
        state, _ = step(state, batch) if p is None else step(state, batch, p)
    return state


@pytest.mark.parametrize("compressor", [None, "e3m0"])
def test_everyone_present_is_the_step_without_participation_bitwise(compressor):
    plugins = () if compressor is None else sdiloco.error_feedback()
    alg = _streaming(compressor=compressor, plugins=plugins)
    batches = _batches(3)
    plain = _run(alg, batches)
    full = _run(alg, batches, [everyone(3)] * STEPS)
    assert_trees_equal(plain.global_params, full.global_params)
    assert_trees_equal(plain.replica_params, full.replica_params)
    assert_trees_equal(plain.inner_state, full.inner_state)


def test_data_parallel_everyone_present_is_bitwise_and_absent_is_m_minus_1():
    def make(m):
        return sdiloco.data_parallel(_loss, inner=optax.adam(1e-2), num_replicas=m)

    batches = _batches(3)
    plain = _run(make(3), batches)
    full = _run(make(3), batches, [everyone(3)] * STEPS)
    assert_trees_equal(plain.global_params, full.global_params)
    absent = Participation.of([True, False, True])
    elastic = _run(make(3), batches, [absent] * STEPS)
    two = [{k: v[jnp.asarray([0, 2])] for k, v in b.items()} for b in batches]
    assert_trees_allclose(
        elastic.global_params, _run(make(2), two).global_params, rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("compressor", [None, "e3m0"])
def test_a_replica_absent_for_the_whole_run_is_an_m_minus_1_run(compressor):
    batches = _batches(3)
    trace = [Participation.of([True, True, False])] * STEPS
    elastic = _run(_streaming(3, compressor), batches, trace)
    two = [{k: v[:2] for k, v in b.items()} for b in batches]
    reference = _run(_streaming(2, compressor), two)
    assert_trees_allclose(
        elastic.global_params, reference.global_params, rtol=1e-5, atol=1e-6
    )
    first_two = jax.tree.map(lambda x: x[:2], elastic.replica_params)
    assert_trees_allclose(first_two, reference.replica_params, rtol=1e-5, atol=1e-6)


def test_an_absent_replicas_data_and_parameters_never_reach_the_global_model():
    """Replica 2 is absent from step 3 on: its batches and (poisoned) parameters
    change nothing of θ_g, and its own state stays exactly as it was left."""
    alg = _streaming(3)
    batches = _batches(3)
    head = _run(alg, batches[:3])
    poisoned = head._replace(
        replica_params=jax.tree.map(lambda x: x.at[2].set(jnp.nan), head.replica_params)
    )
    other = [dict(b, x=b["x"].at[2].set(1e6)) for b in batches[3:]]
    trace = [Participation.of([True, True, False])] * (STEPS - 3)
    a = _run(alg, batches[3:], trace, head)
    b = _run(alg, other, trace, poisoned)
    assert_trees_equal(a.global_params, b.global_params)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(b.global_params))
    left = jax.tree.map(lambda x: x[2], head.inner_state)
    assert_trees_equal(jax.tree.map(lambda x: x[2], a.inner_state), left)
    assert_trees_equal(
        jax.tree.map(lambda x: x[2], a.replica_params),
        jax.tree.map(lambda x: x[2], head.replica_params),
    )


@pytest.mark.parametrize("peer", [True, False])
def test_a_replica_that_comes_back_holds_the_global_model(peer):
    """It takes θ_g and the inner state of a peer that stayed alive, or a fresh one
    from θ_g when none did (here all three were away at the last step, after two
    steps of training: the fresh state is not the one they left)."""
    alg = _streaming(3)
    batches = _batches(3)
    if peer:  # replica 1 away at t = 1, 2
        away = [Participation.of([True, False, True])] * 2
    else:  # everyone trains at t = 1, 2, and nobody is alive at t = 3
        away = [everyone(3)] * 2 + [Participation.of([False] * 3)]
    t = len(away)
    state = _run(alg, batches[:t], away)
    back = Participation.of([True, True, True], computes=[True, False, True])
    state, _ = jax.jit(alg.step)(state, batches[t], back)  # nothing arrives
    assert_trees_equal(
        jax.tree.map(lambda x: x[1], state.replica_params), state.global_params
    )
    inner = jax.tree.map(lambda x: x[1], state.inner_state)
    if peer:  # replica 0's state before its step at t = 3
        donor = _run(alg, batches[:t], away).inner_state
        assert_trees_equal(inner, jax.tree.map(lambda x: x[0], donor))
    else:
        left = jax.tree.map(lambda x: x[1], _run(alg, batches[:t], away).inner_state)
        assert not tree_equal(inner, left)
        assert_trees_equal(inner, optax.adam(1e-2).init(state.global_params))


@settings(max_examples=12, deadline=None)
@given(
    alive=st.lists(
        st.lists(st.booleans(), min_size=3, max_size=3), min_size=STEPS, max_size=STEPS
    ),
    skip=st.lists(
        st.lists(st.booleans(), min_size=3, max_size=3), min_size=STEPS, max_size=STEPS
    ),
)
def test_random_liveness_traces_stay_finite_and_leave_absent_replicas_alone(
    alive, skip
):
    alg = _streaming(3)
    step = jax.jit(alg.step)
    state = alg.init(_params())
    for t, batch in enumerate(_batches(3)):
        a = np.asarray(alive[t])
        p = Participation.of(a, computes=a & ~np.asarray(skip[t]))
        before = state
        state, metrics = step(state, batch, p)
        for m in np.flatnonzero(~a):  # untouched: parameters and inner state
            for field in ("replica_params", "inner_state"):
                now, then = getattr(state, field), getattr(before, field)
                assert_trees_equal(
                    jax.tree.map(lambda x: x[m], now),
                    jax.tree.map(lambda x: x[m], then),
                )
        finite = [
            np.isfinite(x).all()
            for x in jax.tree.leaves((state, metrics))
            if np.issubdtype(np.asarray(x).dtype, np.inexact)
        ]
        assert all(finite)


def test_no_replica_sending_skips_the_outer_step():
    alg = _streaming(3, compressor=None)
    batches = _batches(3)
    nobody = Participation.of([True] * 3, sends=[False] * 3)
    trace = [nobody] * STEPS
    state = _run(alg, batches, trace)
    assert_trees_equal(state.global_params, _params())  # no outer step ever applied
    assert state.senders.shape == (2, 3) and not state.senders.any()


@pytest.mark.parametrize(
    "bad, match",
    [
        (
            lambda: Participation.of([1, 1, 1]),
            r"Participation.alive has shape \(3,\) and dtype int",
        ),
        (lambda: Participation.of([True, True]), r"allowed: shape \(3,\)"),
        (
            lambda: Participation.of([True, False, True], computes=[True, True, True]),
            r"Participation.computes=\[True, True, True\] has a replica that is not alive",
        ),
    ],
)
def test_bad_participation_is_named_before_any_compute(bad, match):
    alg = _streaming(3)
    state = alg.init(_params())
    with pytest.raises(ValueError, match=match):
        alg.step(state, _batches(3)[0], bad())


def test_token_weighting_is_the_mean_weighted_by_the_steps_each_replica_took():
    """Float64 reference: after the first send (t = 4, τ = 1, float32 messages) the
    in-flight Δ̄ of fragment 0 is Σ w_m (θ_g − θ_m) / Σ w_m, w_m the inner steps
    replica m took in steps 1-4; with everyone at every step it equals the uniform
    mean bitwise."""
    from sdiloco.analysis import inflight_outer_gradients

    batches = _batches(3)
    computes = [
        [True, True, True],
        [True, False, True],
        [True, False, False],
        [True, True, False],
    ]
    trace = [Participation.of([True] * 3, computes=c) for c in computes]
    alg = _streaming(3, compressor=None, aggregator=token_weighted_mean())
    state = _run(alg, batches[:4], trace)
    w = np.sum(computes, axis=0).astype(np.float64)  # 4, 2, 2
    g = jax.tree.map(lambda x: np.asarray(x, np.float64), state.global_params)
    r = jax.tree.map(lambda x: np.asarray(x, np.float64), state.replica_params)
    got = inflight_outer_gradients(alg.spec, state)
    for k in ("a", "c"):  # fragment 0
        want = np.tensordot(w, g[k][None] - r[k], axes=1) / w.sum()
        np.testing.assert_allclose(np.asarray(got[k]), want, rtol=1e-5, atol=1e-6)
    uniform = _run(_streaming(3, compressor=None), batches, [everyone(3)] * STEPS)
    tokens = _run(
        _streaming(3, compressor=None, aggregator=token_weighted_mean()),
        batches,
        [everyone(3)] * STEPS,
    )
    assert_trees_equal(uniform.global_params, tokens.global_params)


def test_token_weighting_with_error_feedback_weighs_the_decoded_messages():
    """Token weighting acts after decoding, so it combines with error feedback: after
    the first send of fragment 1 (t = 6, E3M0, zero residual before it) its
    in-flight Δ̄ is Σ w_m Q(Δ_m) / Σ w_m, each replica's own reconstruction
    `Q(Δ_m) = Δ_m − e_m` (float64 reference), and each residual `e_m` is the
    replica's own, unweighted compression error."""
    from sdiloco.analysis import inflight_outer_gradients

    computes = [
        [True, True, True],
        [True, False, True],
        [True, False, False],
        [True, True, False],
        [False, True, True],
        [True, True, False],
    ]
    trace = [Participation.of([True] * 3, computes=c) for c in computes]
    alg = _streaming(
        3, aggregator=token_weighted_mean(), plugins=sdiloco.error_feedback()
    )
    state = _run(alg, _batches(3)[:6], trace)
    assert np.asarray(state.sent_at).tolist() == [4, 6]
    w = np.sum(computes, axis=0).astype(np.float64)  # 5, 4, 3
    g = np.asarray(state.global_params["b"], np.float64)
    delta = g[None] - np.asarray(state.replica_params["b"], np.float64)
    e = np.asarray(plugin_state(alg, state, sdiloco.plugins.ErrorFeedback)["b"])
    q = sdiloco.quantizer("e3m0")
    own = np.asarray(jax.vmap(q)(jnp.asarray(delta, jnp.float32)), np.float64)
    np.testing.assert_allclose(e, delta - own, atol=1e-6)
    assert np.abs(e).max() > 0  # E3M0 left something out: Q(Δ_m) is not Δ_m
    got = inflight_outer_gradients(alg.spec, state)["b"]
    want = np.tensordot(w, own, axes=1) / w.sum()
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    raw = np.tensordot(w, delta, axes=1) / w.sum()  # what Q left out is not in Δ̄
    assert not np.allclose(np.asarray(got), raw, rtol=1e-5, atol=1e-6)
