"""Tests for sdiloco.aggregation: how the senders' outer gradients become one.

Each aggregator against a float64 NumPy reference under partial participation
(hypothesis draws the rows, who sent and their steps), with a non-finite row, and
with nobody sending; then the seam in the algorithm: a median is correct when one
replica does not send (the old rescale by M / senders behind its back would break
it), and the same aggregator gives the same numbers on the mesh's exchange.
"""

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from helpers import toy_batches, toy_loss, toy_params
from hypothesis import given, settings, strategies as st

import sdiloco
from sdiloco import aggregation, communication, distributed


M = 4


def _rows(data, m, shapes):
    """Random rows `[m, ...]` per piece, float32, and a sent mask with >= 1 sender."""
    seed = data.draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    scale = data.draw(st.sampled_from([1e-3, 1.0, 1e3]))
    rows = [(rng.standard_normal((m,) + s) * scale).astype(np.float32) for s in shapes]
    sent = np.asarray(data.draw(st.lists(st.booleans(), min_size=m, max_size=m)))
    sent[data.draw(st.integers(0, m - 1))] = True
    steps = np.asarray(data.draw(st.lists(st.integers(0, 9), min_size=m, max_size=m)))
    return rows, sent, steps


def _mean_ref(rows, sent):
    return [r[sent].astype(np.float64).mean(0) for r in rows]


def _trimmed_ref(rows, sent, trim):
    n = int(sent.sum())
    k = min(int(np.floor(trim * n)), (n - 1) // 2)
    out = []
    for r in rows:
        s = np.sort(r[sent].astype(np.float64), axis=0)
        out.append(s[k : n - k].mean(0))
    return out


def _clipped_ref(rows, sent, max_norm, factor):
    norms = np.sqrt(
        sum(
            (r[sent].astype(np.float64) ** 2).reshape(int(sent.sum()), -1).sum(1)
            for r in rows
        )
    )
    threshold = factor * np.median(norms) if max_norm is None else max_norm
    scale = np.minimum(1.0, threshold / np.maximum(norms, 1e-30))
    return [
        (r[sent].astype(np.float64) * scale.reshape((-1,) + (1,) * (r.ndim - 1))).mean(
            0
        )
        for r in rows
    ]


def _weighted_ref(rows, sent, steps):
    w = np.where(sent, steps, 0).astype(np.float64)
    if w.sum() == 0:
        return _mean_ref(rows, sent)
    return [
        (r.astype(np.float64) * w.reshape((-1,) + (1,) * (r.ndim - 1))).sum(0) / w.sum()
        for r in rows
    ]


CASES = {
    "mean": (aggregation.mean(), lambda r, s, w: _mean_ref(r, s)),
    "token_weighted_mean": (aggregation.token_weighted_mean(), _weighted_ref),
    "trimmed_mean": (
        aggregation.trimmed_mean(0.25),
        lambda r, s, w: _trimmed_ref(r, s, 0.25),
    ),
    "median": (
        aggregation.median(),
        lambda r, s, w: [np.median(x[s].astype(np.float64), 0) for x in r],
    ),
    "clipped_mean": (
        aggregation.clipped_mean(),
        lambda r, s, w: _clipped_ref(r, s, None, 2.0),
    ),
    "clipped_mean_fixed": (
        aggregation.clipped_mean(0.5),
        lambda r, s, w: _clipped_ref(r, s, 0.5, 2.0),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
@settings(max_examples=25, deadline=None)
@given(data=st.data(), m=st.integers(1, 7))
def test_each_aggregator_matches_its_float64_reference_under_partial_participation(
    name, data, m
):
    aggregate, reference = CASES[name]
    rows, sent, steps = _rows(data, m, [(3,), (2, 5)])
    # a replica that does not send has a row of zeros, as every exchange gives it
    rows = [np.where(sent.reshape((-1,) + (1,) * (r.ndim - 1)), r, 0) for r in rows]
    got = aggregate(
        [jnp.asarray(r) for r in rows], jnp.asarray(sent), jnp.asarray(steps, jnp.int32)
    )
    for g, ref, r in zip(got, reference(rows, sent, steps), rows):
        assert g.shape == ref.shape and g.dtype == jnp.float32
        tol = 1e-5 * (np.abs(r).max() + 1e-30)
        np.testing.assert_allclose(np.asarray(g, np.float64), ref, rtol=1e-5, atol=tol)


@pytest.mark.parametrize("name", ["trimmed_mean", "median", "clipped_mean"])
def test_a_robust_aggregator_leaves_out_a_non_finite_sender(name):
    aggregate, reference = CASES[name]
    rng = np.random.default_rng(0)
    rows = [rng.standard_normal((5, 3)).astype(np.float32)]
    sent = np.asarray([True, True, True, False, True])
    rows[0][3] = 0.0
    poisoned = [r.copy() for r in rows]
    poisoned[0][1, 2] = np.nan
    got = aggregate([jnp.asarray(poisoned[0])], jnp.asarray(sent), None)[0]
    without = sent.copy()
    without[1] = False
    np.testing.assert_allclose(
        np.asarray(got), reference(rows, without, None)[0], rtol=1e-6
    )
    assert np.all(np.isfinite(np.asarray(got)))


@pytest.mark.parametrize("name", ["mean", "token_weighted_mean"])
def test_a_mean_passes_a_non_finite_sender_on_to_the_nonfinite_policy(name):
    aggregate, _ = CASES[name]
    rows = jnp.ones((3, 2)).at[1, 0].set(jnp.inf)
    got = aggregate([rows], jnp.ones(3, bool), jnp.ones(3, jnp.int32))[0]
    assert not np.all(np.isfinite(np.asarray(got)))


@pytest.mark.parametrize("name", list(CASES))
def test_with_nobody_sending_every_aggregator_returns_zeros(name):
    aggregate, _ = CASES[name]
    got = aggregate([jnp.zeros((3, 2))], jnp.zeros(3, bool), jnp.zeros(3, jnp.int32))
    np.testing.assert_array_equal(np.asarray(got[0]), np.zeros(2))


def test_the_token_weighted_mean_without_steps_is_the_plain_mean():
    rows = [jnp.arange(6.0).reshape(3, 2)]
    sent = jnp.asarray([True, False, True])
    got = aggregation.token_weighted_mean()(rows, sent, None)
    np.testing.assert_array_equal(
        np.asarray(got[0]), np.asarray(aggregation.mean()(rows, sent, None)[0])
    )


def test_bad_aggregator_configs_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"trim=0.5; allowed: \[0, 0.5\)"):
        aggregation.trimmed_mean(0.5)
    with pytest.raises(ValueError, match="max_norm=-1.0; allowed: a positive number"):
        aggregation.clipped_mean(-1.0)


# ------------------------------------------------------------------ in the algorithm


def _one_round(aggregator, sends, *, exchange=communication.simulated_exchange):
    """One round of M = 4 replicas (fp32 Δ, outer SGD with lr 1, α = 0, τ = 0):
    returns θ_g before, the replicas before the send, and θ_g after."""
    params = toy_params(jr.key(0))
    alg = sdiloco.streaming_diloco(
        toy_loss,
        inner=optax.sgd(0.3),
        outer=optax.sgd(1.0),
        num_replicas=M,
        sync_every=2,
        overlap=0,
        alpha=0.0,
        aggregator=aggregator,
        exchange=exchange,
    )
    state = alg.init(params)
    batches = toy_batches(jr.key(1), steps=2, replicas=M)
    step = jax.jit(alg.step)
    state, _ = step(state, batches[0])
    before = state
    part = sdiloco.Participation.of([True] * M, [True] * M, sends)
    after, metrics = step(state, batches[1], part)
    return before, after, metrics, alg, batches


def test_a_median_is_correct_when_one_replica_does_not_send():
    sends = [True, True, False, True]
    before, after, metrics, alg, batches = _one_round(aggregation.median(), sends)
    assert bool(np.asarray(metrics["sync/applied"])[0])
    # each replica's inner SGD step, computed here from the state before the step
    grads = jax.vmap(jax.grad(toy_loss))(before.replica_params, batches[1])
    replicas = np.asarray(before.replica_params["v"], np.float64) - 0.3 * np.asarray(
        grads["v"], np.float64
    )
    g0 = np.asarray(before.global_params["v"], np.float64)
    deltas = g0[None] - replicas
    expected = g0 - np.median(deltas[np.asarray(sends)], axis=0)
    np.testing.assert_allclose(
        np.asarray(after.global_params["v"]), expected, rtol=1e-5, atol=1e-6
    )
    # the non-sender's zero row, had it been counted, would move the median
    with_zero = g0 - np.median(np.where(np.asarray(sends)[:, None], deltas, 0), axis=0)
    assert not np.allclose(with_zero, expected, rtol=1e-3)


@pytest.mark.parametrize("name", ["median", "trimmed_mean", "clipped_mean", "mean"])
def test_an_aggregator_gives_the_same_step_on_the_mesh(name):
    aggregate, _ = CASES[name]
    sends = [True, False, True, True]
    mesh = distributed.replica_mesh(M, jax.devices()[:4])
    _, sim, _, _, _ = _one_round(aggregate, sends)
    _, sharded, _, _, _ = _one_round(
        aggregate, sends, exchange=distributed.sharded_exchange(mesh)
    )
    for a, b in zip(
        jax.tree.leaves(sim.global_params), jax.tree.leaves(sharded.global_params)
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    if name == "median":  # and it is the median that ran there, not the mean
        mean = _one_round(aggregation.mean(), sends)[1].global_params["v"]
        assert not np.allclose(np.asarray(sharded.global_params["v"]), np.asarray(mean))


def test_the_posted_exchange_aggregates_over_the_senders_it_recorded():
    """A posted exchange aggregates at the arrival, from the messages and who sent
    them as the send recorded (`StreamingState.senders`): with a median and one
    replica silent at the send, θ_g equals the in-step exchange's."""
    params = toy_params(jr.key(0))
    sends = [True, False, True, True]
    common = dict(
        inner=optax.sgd(0.3),
        num_replicas=M,
        sync_every=2,
        overlap=1,
        compressor="e3m0",
        aggregator=aggregation.median(),
    )
    ref = sdiloco.streaming_diloco(toy_loss, **common)
    posted = sdiloco.streaming_diloco(
        toy_loss, exchange=distributed.posted_exchange(), **common
    )
    batches = toy_batches(jr.key(1), steps=3, replicas=M)
    part = sdiloco.Participation.of([True] * M, [True] * M, sends)
    a, b = ref.init(params), posted.init(params)
    for t, batch in enumerate(batches, start=1):
        p = part if t == 2 else sdiloco.everyone(M)
        a, _ = jax.jit(ref.step)(a, batch, p)
        b, _ = jax.jit(posted.step)(b, batch, p)
        # what a courier does between the steps: every replica's messages delivered
        b = b._replace(inbox=jnp.swapaxes(b.outbox, 0, 1))
    assert np.asarray(b.senders)[0].tolist() == sends
    for x, y in zip(jax.tree.leaves(a.global_params), jax.tree.leaves(b.global_params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert not np.array_equal(np.asarray(b.global_params["v"]), np.asarray(params["v"]))
