"""The pieces of the Streaming step, each alone: send, outer_update, merge_arrivals.

Each piece is checked against a float64 NumPy computation of the same line of
Alg. 2 on a hand-built state, and for touching nothing outside its fragments.
"""

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st

import sdiloco
from sdiloco.analysis import inflight_outer_gradients
from sdiloco.communication import simulated_exchange
from sdiloco.inflight import Visit, make_layout
from sdiloco.jit import JittedStep
from sdiloco.schedule import make_schedule
from sdiloco.streaming import (
    StreamingSpec,
    merge_arrivals,
    outer_update,
    send,
    streaming_init,
)


SHAPES = {"a": (4,), "b": (3, 2), "c": (5,)}


def _setup(num_replicas, overlap, alpha, seed, compressor=None, first_send=(2, 3)):
    """A spec over two fragments ({a, c} and {b}) and a state with random replicas."""
    params = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}
    frags = sdiloco.fragments_from_labels(params, {"a": 0, "b": 1, "c": 0})
    spec = StreamingSpec(
        loss_fn=lambda p, b: 0.0,
        inner=optax.sgd(0.1),
        outer=optax.sgd(0.7, momentum=0.9, nesterov=True),
        schedule=make_schedule(4, 2, num_replicas, overlap, first_send),
        fragments=frags,
        compressor=compressor,
        plugin=sdiloco.plugins.chain(sdiloco.alpha_merge(alpha)),
        aggregator=sdiloco.aggregation.mean(),
        nonfinite="skip",
        exchange=simulated_exchange,
    )
    keys = jr.split(jr.key(seed), 4)
    g = {k: jr.normal(keys[0], s) for k, s in SHAPES.items()}
    r = {k: jr.normal(keys[1], (num_replicas,) + s) for k, s in SHAPES.items()}
    state = streaming_init(spec, g)._replace(replica_params=r)
    return spec, state


def _with_inflight(spec, state, tree, p):
    """`state` with `tree`'s elements of fragment p stored in p's in-flight slot."""
    layout = make_layout(spec.fragments, spec.schedule)
    group = layout.groups[layout.group_of[p]]
    j = layout.index_in_group[p]
    pieces = Visit.of(group, j).gather(jax.tree.leaves(tree))
    return state._replace(inflight=layout.write(state.inflight, group, p, pieces))


FRAGMENT_OF = {"a": 0, "b": 1, "c": 0}


@settings(max_examples=10)
@given(
    m=st.sampled_from([1, 2, 3]),
    t=st.integers(1, 12),
    seed=st.integers(0, 2**16),
)
def test_send_stores_the_replica_mean_of_the_sent_fragment_only(m, t, seed):
    spec, state = _setup(m, 1, 0.5, seed)
    state = state._replace(step=jnp.asarray(t, jnp.int32))
    new = send(spec, state)
    sent = spec.schedule.sent(state.step)
    expect_sent = [t >= f and (t - f) % 4 == 0 for f in (2, 3)]
    np.testing.assert_array_equal(np.asarray(sent), expect_sent)
    got = inflight_outer_gradients(spec, new)  # in flight until t + τ = t + 1
    for k in SHAPES:
        g = np.asarray(state.global_params[k], np.float64)
        r = np.asarray(state.replica_params[k], np.float64)
        expect = np.mean(g[None] - r, 0) if expect_sent[FRAGMENT_OF[k]] else 0 * g
        np.testing.assert_allclose(np.asarray(got[k]), expect, atol=1e-6)
    if not any(expect_sent):  # nothing sent: the buffer is bitwise untouched
        np.testing.assert_array_equal(new.inflight, state.inflight)
    np.testing.assert_array_equal(np.asarray(new.sent_at), np.where(expect_sent, t, -1))
    for field in ("global_params", "replica_params", "outer_state", "inner_state"):
        assert jax.tree.all(
            jax.tree.map(
                lambda x, y: bool(jnp.all(x == y)),
                getattr(new, field),
                getattr(state, field),
            )
        )


def test_send_flags_a_nonfinite_fragment():
    spec, state = _setup(2, 1, 0.5, 0)
    r = dict(state.replica_params)
    r["b"] = r["b"].at[1, 0, 0].set(jnp.inf)
    state = state._replace(replica_params=r, step=jnp.asarray(3, jnp.int32))
    new = send(spec, state)
    np.testing.assert_array_equal(np.asarray(new.sent_at), [-1, 3])
    np.testing.assert_array_equal(np.asarray(new.inflight_ok), [True, False])


@pytest.mark.parametrize("due", [0, 1])
def test_outer_update_steps_only_the_due_fragment_like_optax(due):
    spec, state = _setup(2, 1, 0.5, 3)
    sent_at = np.full(2, -1, np.int32)
    sent_at[due] = 5
    inflight = {k: jr.normal(jr.key(due), s) for k, s in SHAPES.items()}
    state = _with_inflight(spec, state, inflight, due)
    state = state._replace(step=jnp.asarray(6, jnp.int32), sent_at=jnp.asarray(sent_at))
    new, applied, failed = outer_update(spec, state)
    np.testing.assert_array_equal(np.asarray(applied), np.arange(2) == due)
    assert not np.any(np.asarray(failed))
    # Reference: optax's own SGD-Nesterov on the fragment's elements alone.
    keys = [k for k in SHAPES if FRAGMENT_OF[k] == due]
    sub = {k: state.global_params[k] for k in keys}
    opt = optax.sgd(0.7, momentum=0.9, nesterov=True)
    updates, _ = opt.update({k: inflight[k] for k in keys}, opt.init(sub), sub)
    for k in SHAPES:
        if k in keys:
            np.testing.assert_allclose(
                new.global_params[k], sub[k] + updates[k], rtol=1e-6, atol=1e-7
            )
        else:
            np.testing.assert_array_equal(new.global_params[k], state.global_params[k])
    np.testing.assert_array_equal(new.replica_params["a"], state.replica_params["a"])


def test_outer_update_skips_a_nonfinite_fragment():
    spec, state = _setup(2, 1, 0.5, 4)
    inflight = {k: jnp.ones(s) for k, s in SHAPES.items()}
    state = _with_inflight(spec, state, inflight, 0)
    state = state._replace(
        step=jnp.asarray(6, jnp.int32),
        sent_at=jnp.asarray([5, 5], jnp.int32),
        inflight_ok=jnp.asarray([True, False]),
    )
    new, applied, failed = outer_update(spec, state)
    np.testing.assert_array_equal(np.asarray(applied), [True, False])
    np.testing.assert_array_equal(np.asarray(failed), [False, True])
    np.testing.assert_array_equal(new.global_params["b"], state.global_params["b"])
    assert not np.array_equal(new.global_params["a"], state.global_params["a"])


@settings(max_examples=10)
@given(
    tau2=st.integers(0, 3),
    t=st.integers(5, 9),
    alpha=st.sampled_from([0.0, 0.3, 0.5, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_merge_arrivals_mixes_each_replica_at_its_own_arrival(tau2, t, alpha, seed):
    spec, state = _setup(2, (1, tau2), alpha, seed)
    state = state._replace(
        step=jnp.asarray(t, jnp.int32), sent_at=jnp.asarray([5, -1], jnp.int32)
    )
    new, merged = merge_arrivals(spec, state)
    expect = np.array([[t == 5 + 1, False], [t == 5 + tau2, False]])
    np.testing.assert_array_equal(np.asarray(merged), expect)
    for k in SHAPES:
        g = np.asarray(state.global_params[k], np.float64)
        r = np.asarray(state.replica_params[k], np.float64)
        for m in range(2):
            got = np.asarray(new.replica_params[k][m], np.float64)
            if expect[m, FRAGMENT_OF[k]]:
                np.testing.assert_allclose(
                    got, alpha * r[m] + (1 - alpha) * g, rtol=1e-6, atol=1e-6
                )
            else:
                np.testing.assert_array_equal(got, r[m])
    np.testing.assert_array_equal(new.global_params["a"], state.global_params["a"])


def test_merge_restores_a_failed_fragment_to_global():
    spec, state = _setup(2, 1, 0.5, 5)
    state = state._replace(
        step=jnp.asarray(6, jnp.int32),
        sent_at=jnp.asarray([5, 5], jnp.int32),
        inflight_ok=jnp.asarray([True, False]),
    )
    new, _ = merge_arrivals(spec, state)
    for m in range(2):
        np.testing.assert_array_equal(
            new.replica_params["b"][m], state.global_params["b"]
        )


def test_state_declares_its_replica_fields():
    spec, state = _setup(3, 1, 0.5, 0)
    assert sdiloco.replica_fields(state) == (
        "replica_params",
        "inner_state",
        "plugin_state",
        "outbox",
    )
    for name in sdiloco.replica_fields(state):
        for x in jax.tree.leaves(getattr(state, name)):
            assert x.shape[0] == 3
    dp = sdiloco.data_parallel(lambda p, b: 0.0, inner=optax.sgd(0.1)).init(
        state.global_params
    )
    assert sdiloco.replica_fields(dp) == ()
    share = sdiloco.per_replica_bytes(state)
    n_bytes = 4 * sum(int(np.prod(s)) for s in SHAPES.values())
    assert share["replica_params"] == n_bytes  # one replica's slice of [3, ...]
    assert share["global_params"] == n_bytes  # shared: held whole
    # The plug-ins' state carries M too: error feedback's residual and Eager's
    # stand-ins, one of each per replica and parameter.
    plugin = sdiloco.plugins.chain(sdiloco.error_feedback(), sdiloco.eager())
    stateful = streaming_init(spec._replace(plugin=plugin), state.global_params)
    leaves = jax.tree.leaves(stateful.plugin_state)
    assert len(leaves) == 2 * len(SHAPES) and all(x.shape[0] == 3 for x in leaves)
    assert sdiloco.per_replica_bytes(stateful)["plugin_state"] == 2 * n_bytes
    assert isinstance(state, sdiloco.AlgorithmState)
    assert isinstance(simulated_exchange, sdiloco.Exchange)


def test_stochastic_compressor_needs_a_key():
    alg = sdiloco.streaming_diloco(
        lambda p, b: 0.0,
        inner=optax.sgd(0.1),
        num_replicas=2,
        sync_every=4,
        compressor=sdiloco.quantizer("e3m0", rounding="stochastic"),
    )
    params = {"a": jnp.zeros(3)}
    with pytest.raises(ValueError, match="key"):
        alg.init(params)
    alg.init(params, jr.key(0))  # with a key it builds


def test_jitted_step_keeps_static_leaves_in_place_and_compiles_once_per_value():
    traces = []

    def fn(state, batch):
        traces.append(state["scale"])
        new = {"a": state["a"] * state["scale"] + batch, "name": state["name"] + "!"}
        new["scale"] = state["scale"]
        return new, {"sum": jnp.sum(new["a"]), "tag": state["name"]}

    step = JittedStep(fn)
    state = {"a": jnp.arange(3.0), "name": "x", "scale": 2.0}
    new, metrics = step(state, jnp.ones(3))
    assert state["a"].is_deleted()  # donated
    # Non-array leaves are static: kept, passed to fn as Python values, rebuilt in
    # place (the dict's keys sort "a" < "name" < "scale": one array between two).
    np.testing.assert_array_equal(new["a"], [1.0, 3.0, 5.0])
    assert new["name"] == "x!" and new["scale"] == 2.0 and metrics["tag"] == "x"
    assert float(metrics["sum"]) == 9.0
    step({"a": jnp.zeros(3), "name": "x", "scale": 2.0}, jnp.ones(3))
    assert traces == [2.0]  # same structure and statics: no new trace
    new, _ = step({"a": jnp.ones(3), "name": "x", "scale": 3.0}, jnp.ones(3))
    assert traces == [2.0, 3.0]  # a new static value compiles again
    np.testing.assert_array_equal(new["a"], [4.0, 4.0, 4.0])
    text = step.lower({"a": jnp.ones(3), "name": "x", "scale": 3.0}, jnp.ones(3))
    assert "multiply" in text.as_text()


def test_jit_step_donates_the_state_and_takes_an_algorithm_or_a_step():
    params = {"a": jnp.ones(2), "b": jnp.ones((2, 2))}
    alg = sdiloco.data_parallel(
        lambda p, b: jnp.sum((p["a"] @ p["b"][0]) * b["x"][0]),
        inner=optax.sgd(0.1),
        num_replicas=2,
    )
    batch = {"x": jnp.ones((2, 2))}
    results = []
    for arg in (alg, alg.step):
        step = sdiloco.jit_step(arg)
        s0 = alg.init(params)
        s1, _ = step(s0, batch)  # the first call copies: the caller's params survive
        assert not params["a"].is_deleted()
        s2, _ = step(s1, batch)  # later calls reuse the state's buffers
        assert s1.global_params["a"].is_deleted()
        results.append(s2.global_params)
    assert all(bool(jnp.all(x == y)) for x, y in zip(*map(jax.tree.leaves, results)))
