"""Tests for sdiloco.plugins: the hooks around the exchange, with state of their own.

Error feedback against a float64 NumPy reference with a replica that does not
send; what every shipped plug-in does when a round's outer gradient is not finite
(each check fails on a mutant that keeps the replica instead of restoring θ_g, or
keeps a poisoned residual); the fault plug-in; composition order; and bad input.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from helpers import toy_batches, toy_loss, toy_params

import sdiloco
from sdiloco import plugins
from sdiloco.sim.faults import bad_replica


M = 3


def _alg(plugin_list, *, alpha=None, compressor=None, tau=1):
    params = toy_params(jr.key(0))
    alg = sdiloco.streaming_diloco(
        toy_loss,
        inner=optax.sgd(0.2),
        num_replicas=M,
        sync_every=4,
        fragments=sdiloco.fragments_by_layer(
            params, blocks=lambda p: p["blocks"], layers_per_fragment=2
        ),
        overlap=tau,
        alpha=alpha,
        compressor=compressor,
        plugins=plugin_list,
    )
    return params, alg


def _run(alg, params, steps, participation=None):
    state = alg.init(params, jr.key(7))
    step = jax.jit(alg.step)
    for t, b in enumerate(toy_batches(jr.key(1), steps=steps, replicas=M)):
        part = None if participation is None else participation(t + 1)
        state, metrics = step(state, b, part) if part is not None else step(state, b)
    return state, metrics


def _tree(params, leaves):
    arrays = eqx.filter(params, eqx.is_inexact_array)
    return jax.tree.unflatten(jax.tree.structure(arrays), leaves)


def test_error_feedback_matches_float64_with_a_replica_that_does_not_send():
    """One send of fragment 0 ("v", first sent at step 4) with replica 2 silent:
    the senders' residuals are `Δ + β·e − Q(Δ + β·e)` in float64, the silent
    replica keeps its residual (zero here)."""
    beta = 0.5
    params, alg = _alg((sdiloco.error_feedback(beta),), compressor="int2")
    quiet = sdiloco.Participation.of([True] * M, [True] * M, [True, True, False])
    before, _ = _run(alg, params, 3)
    after, _ = _run(alg, params, 4, lambda t: quiet if t == 4 else None)
    q = sdiloco.quantizer("int2")
    g = np.asarray(before.global_params["v"], np.float64)
    grads = jax.vmap(jax.grad(toy_loss))(
        before.replica_params, toy_batches(jr.key(1), steps=4, replicas=M)[3]
    )
    replicas = np.asarray(before.replica_params["v"]) - 0.2 * np.asarray(grads["v"])
    residual = np.asarray(_tree(params, after.plugin_state[0])["v"], np.float64)
    for m in range(2):
        delta = g - replicas[m].astype(np.float64)  # e = 0 before the first send
        sent = np.asarray(q(jnp.asarray(delta, jnp.float32)), np.float64)
        np.testing.assert_allclose(residual[m], delta - sent, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(residual[2], 0.0)
    assert np.any(residual[:2] != 0.0)


@pytest.mark.parametrize(
    "merge", [sdiloco.eager(), sdiloco.alpha_merge(0.5), sdiloco.alpha_merge(1.0)]
)
def test_a_failed_round_restores_theta_g_on_every_replica_that_merges(merge):
    """Replica 0 sends NaN at every send: every round fails (nonfinite='skip'),
    so after each arrival every replica's fragment is θ_g exactly. A merge that
    kept the replica (Eager's `where(ok, fixed, replica)`) fails this."""
    params, alg = _alg((bad_replica("nan"), merge), tau=1)
    # fragment 0 ("v") is sent at 4, 8 and arrives (τ = 1) at 5, 9
    state, metrics = _run(alg, params, 9)
    assert bool(np.asarray(metrics["sync/nonfinite"])[0])
    g = np.asarray(state.global_params["v"])
    np.testing.assert_array_equal(
        np.asarray(state.replica_params["v"]), np.stack([g] * M)
    )
    np.testing.assert_array_equal(g, np.asarray(params["v"]))  # no outer step taken


def test_error_feedback_forgets_the_residual_of_a_failed_round():
    """A residual poisoned by a NaN send is zeroed when the failed round arrives,
    so the fragment's next rounds can succeed (a mutant that keeps it fails)."""
    params, alg = _alg((_NanOnce(), sdiloco.error_feedback(1.0)), compressor="int4")
    state, metrics = _run(alg, params, 13)  # "v": sent at 4 (NaN), 8, 12
    residual = jax.tree.leaves(state.plugin_state[1])
    assert all(np.all(np.isfinite(np.asarray(e))) for e in residual)
    assert bool(np.asarray(metrics["sync/applied"])[0])  # the round sent at 12


class _NanOnce(plugins.Plugin):
    """Replica 0 sends NaN at its first send only (a count per replica)."""

    def init(self, params, num_replicas, num_fragments):
        return jnp.zeros((num_replicas,), jnp.int32)

    def before_send(self, send, deltas, state):
        first = state[0] == 0
        deltas = [d.at[0].set(jnp.where(first, jnp.nan, d[0])) for d in deltas]
        return deltas, state.at[0].add(1)


def test_a_plugin_state_is_fresh_for_a_replica_that_comes_back():
    params, alg = _alg((sdiloco.error_feedback(1.0),), compressor="int2")
    gone = sdiloco.Participation.of([True, True, False])
    back = sdiloco.everyone(M)
    state, _ = _run(
        alg, params, 10, lambda t: gone if t == 9 else (back if t == 10 else None)
    )
    residual = _tree(params, state.plugin_state[0])
    assert all(np.all(np.asarray(e)[2] == 0) for e in jax.tree.leaves(residual))
    assert any(np.any(np.asarray(e)[0] != 0) for e in jax.tree.leaves(residual))


@pytest.mark.parametrize("kind", ["sign", "scale", "noise", "nan"])
def test_a_bad_replica_changes_only_its_own_message(kind):
    params = toy_params(jr.key(0))
    frags = sdiloco.single_fragment(params)
    from sdiloco.inflight import Visit, make_layout

    layout = make_layout(frags, sdiloco.make_schedule(4, 1, M))
    send = plugins.Send(Visit.of(layout.groups[0], 0), None, [], lambda g: g)
    deltas = [
        jr.normal(jr.key(i), (M,) + x.shape)
        for i, x in enumerate(jax.tree.leaves(params))
    ]
    plugin = bad_replica(kind, replica=1)
    state = plugin.init(jax.tree.leaves(params), M, 1)
    out, state = plugin.before_send(send, deltas, state)
    for d, o in zip(deltas, out):
        np.testing.assert_array_equal(np.asarray(o)[[0, 2]], np.asarray(d)[[0, 2]])
        assert not np.array_equal(np.asarray(o)[1], np.asarray(d)[1])
    assert state.tolist() == [0, 1, 0]
    if kind == "sign":
        np.testing.assert_array_equal(np.asarray(out[0])[1], -np.asarray(deltas[0])[1])


def test_plugins_compose_in_order_and_bad_input_is_one_line():
    chained = plugins.chain(sdiloco.error_feedback(0.5), sdiloco.eager())
    assert chained.merges and len(chained.plugins) == 2
    _, alg = _alg(chained, compressor="int4")
    assert [type(p).__name__ for p in alg.spec.plugin.plugins] == [
        "ErrorFeedback",
        "Eager",
    ]
    _, alg = _alg((), compressor="int4,ef:0.5", alpha=0.3)
    names = [type(p).__name__ for p in alg.spec.plugin.plugins]
    assert names == ["ErrorFeedback", "AlphaMerge"]
    assert alg.spec.plugin.plugins[1].alpha == 0.3
    with pytest.raises(ValueError, match="alpha=0.3 with plugins that merge"):
        _alg(sdiloco.eager(), alpha=0.3)
    with pytest.raises(
        ValueError, match="each merge the outer step; allowed: one merge"
    ):
        plugins.chain(sdiloco.eager(), sdiloco.alpha_merge(0.5))
    with pytest.raises(ValueError, match="beta=1.5 is not allowed"):
        sdiloco.error_feedback(1.5)
    with pytest.raises(ValueError, match="kind='flip'; allowed"):
        bad_replica("flip")
    with pytest.raises(ValueError, match="ends in error feedback .ef. and plugins"):
        _alg((sdiloco.error_feedback(0.5),), compressor="int2,ef")
    with pytest.raises(ValueError, match="ends in error feedback, a plug-in"):
        sdiloco.compression.parse("int2,ef")
