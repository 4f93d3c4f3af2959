"""Tests for sdiloco.aggregation: how the senders' outer gradients become one.

Each aggregator against a float64 NumPy reference under partial participation
(hypothesis draws the rows, who sent and their steps), with a non-finite row, and
with nobody sending; then the seam in the algorithm: a median is correct when one
replica does not send (the old rescale by M / senders behind its back would break
it), and the same aggregator gives the same numbers on the mesh's exchange.
Decoupled DiLoCo's aggregators (steps weighting, radial-directional, quorum) the
same way, each in a real step too: a round short of its quorum leaves the state
as a round nobody sent.
"""

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from helpers import toy_batches, toy_loss, toy_params, tree_difference
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


@pytest.mark.parametrize(
    "name",
    [
        "mean",
        "token_weighted_mean",
        "steps_weighted_mean",
        "radial_directional",
        "quorum",
    ],
)
def test_a_mean_passes_a_non_finite_sender_on_to_the_nonfinite_policy(name):
    aggregate, _ = {**CASES, **DECOUPLED}[name]
    rows = jnp.ones((3, 2)).at[1, 0].set(jnp.inf)
    got = aggregate([rows], jnp.ones(3, bool), jnp.ones(3, jnp.int32))[0]
    assert not np.all(np.isfinite(np.asarray(got)))


@pytest.mark.parametrize(
    "name", list(CASES) + ["steps_weighted_mean", "radial_directional", "quorum"]
)
def test_with_nobody_sending_every_aggregator_returns_zeros(name):
    aggregate, _ = {**CASES, **DECOUPLED}[name]
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


@pytest.mark.parametrize(
    "name", ["median", "trimmed_mean", "clipped_mean", "mean", "radial_directional"]
)
def test_an_aggregator_gives_the_same_step_on_the_mesh(name):
    aggregate, _ = {**CASES, **DECOUPLED}[name]
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


# ------------------------------------------------- Decoupled DiLoCo's aggregators


def _weights_ref(sent, steps, power):
    """Normalised float64 weights `steps ** power` of the senders (equal where they
    sum to 0 or the steps are unknown); None when nobody sent."""
    w = sent.astype(np.float64)
    if steps is not None:
        w = np.where(sent, steps.astype(np.float64) ** power, 0.0)
    if w.sum() == 0:
        w = sent.astype(np.float64)
    return None if w.sum() == 0 else w / w.sum()


def _steps_weighted_ref(rows, sent, steps, power):
    w = _weights_ref(sent, steps, power)
    if w is None:
        return [np.zeros(r.shape[1:]) for r in rows]
    return [np.tensordot(w, r.astype(np.float64), 1) for r in rows]


def _radial_ref(rows, sent, steps, power=0.0, plain_shapes=(), scope="piece"):
    w = _weights_ref(sent, steps, power)
    if w is None:
        return [np.zeros(r.shape[1:]) for r in rows]
    x = [r.astype(np.float64) for r in rows]
    plain = [k for k, r in enumerate(x) if r.shape[1:] in plain_shapes]
    radial = [k for k in range(len(x)) if k not in plain]
    groups = [[k] for k in radial] if scope == "piece" else [radial] * bool(radial)
    out = {k: np.tensordot(w, x[k], 1) for k in plain}
    for group in groups:
        norms = np.sqrt(sum((x[k].reshape(len(w), -1) ** 2).sum(1) for k in group))
        safe = np.where(norms > 0, norms, 1.0)
        units = [x[k] / safe.reshape((-1,) + (1,) * (x[k].ndim - 1)) for k in group]
        direction = [np.tensordot(w, u, 1) for u in units]
        length = np.sqrt(sum((d**2).sum() for d in direction))
        for k, d in zip(group, direction):
            out[k] = (w @ norms) * d / (length if length > 0 else 1.0)
    return [out[k] for k in range(len(x))]


def _quorum_ref(k, inner):
    def reference(rows, sent, steps):
        n = int(sent.sum())
        if n == 0:
            return [np.zeros(r.shape[1:]) for r in rows]
        if n < k:
            return [np.full(r.shape[1:], np.nan) for r in rows]
        return inner(rows, sent, steps)

    return reference


def _median_ref(rows, sent, steps):
    finite = sent & np.all([np.isfinite(r.reshape(len(r), -1)).all(1) for r in rows], 0)
    if not finite.any():
        return [np.zeros(r.shape[1:]) for r in rows]
    return [np.median(r[finite].astype(np.float64), 0) for r in rows]


DECOUPLED = {
    "steps_weighted_mean": (
        aggregation.steps_weighted_mean(2.0),
        lambda r, s, w: _steps_weighted_ref(r, s, w, 2.0),
    ),
    "steps_weighted_mean_sqrt": (
        aggregation.steps_weighted_mean(0.5),
        lambda r, s, w: _steps_weighted_ref(r, s, w, 0.5),
    ),
    "radial_directional": (aggregation.radial_directional(), _radial_ref),
    "radial_directional_fragment": (
        aggregation.radial_directional(1.0, plain_shapes=[(3,)], scope="fragment"),
        lambda r, s, w: _radial_ref(r, s, w, 1.0, ((3,),), "fragment"),
    ),
    "quorum": (aggregation.quorum(3), _quorum_ref(3, lambda r, s, w: _mean_ref(r, s))),
    "quorum_median": (
        aggregation.quorum(2, aggregation.median()),
        _quorum_ref(2, _median_ref),
    ),
}


@pytest.mark.parametrize("name", list(DECOUPLED))
@settings(max_examples=20, deadline=None)
@given(
    data=st.data(),
    m=st.integers(1, 7),
    who=st.sampled_from(["drawn", "nobody", "one"]),
    poison=st.booleans(),
)
def test_each_decoupled_aggregator_matches_its_float64_reference(
    name, data, m, who, poison
):
    """Hypothesis over M = 1..7 and who sent (drawn, nobody, a single sender), with
    or without a sender whose row holds a NaN; NaN where the reference has NaN."""
    aggregate, reference = DECOUPLED[name]
    rows, sent, steps = _rows(data, m, [(3,), (2, 5)])
    if who != "drawn":
        one = data.draw(st.integers(0, m - 1))
        sent = np.arange(m) == one if who == "one" else np.zeros(m, bool)
    rows = [np.where(sent.reshape((-1,) + (1,) * (r.ndim - 1)), r, 0) for r in rows]
    if poison and sent.any():
        rows[1][np.flatnonzero(sent)[-1], 1, 2] = np.nan
    got = aggregate(
        [jnp.asarray(r) for r in rows], jnp.asarray(sent), jnp.asarray(steps, jnp.int32)
    )
    for g, ref, r in zip(got, reference(rows, sent, steps), rows):
        assert g.shape == ref.shape and g.dtype == jnp.float32
        tol = 1e-5 * (np.nanmax(np.abs(r), initial=0.0) + 1e-30)
        np.testing.assert_allclose(np.asarray(g, np.float64), ref, rtol=1e-5, atol=tol)
    if who == "nobody":
        assert all(np.array_equal(np.asarray(g), np.zeros(g.shape)) for g in got)


def test_steps_weighted_mean_is_the_mean_and_the_token_weighted_mean_bitwise():
    """`power = 0` (or unknown steps) is the plain mean and `power = 1` the
    token-weighted mean, bit for bit."""
    rng = np.random.default_rng(1)
    rows = [
        jnp.asarray(rng.standard_normal((5,) + s), jnp.float32) for s in [(3,), (2, 4)]
    ]
    sent = jnp.asarray([True, False, True, True, True])
    steps = jnp.asarray([3, 0, 1, 7, 2], jnp.int32)
    pairs = [
        (aggregation.steps_weighted_mean(0.0), aggregation.mean(), steps),
        (aggregation.steps_weighted_mean(2.0), aggregation.mean(), None),
        (
            aggregation.steps_weighted_mean(1.0),
            aggregation.token_weighted_mean(),
            steps,
        ),
        (
            aggregation.radial_directional(plain_shapes=((3,), (2, 4))),
            aggregation.mean(),
            steps,
        ),
    ]
    for new, old, s in pairs:
        for a, b in zip(new(rows, sent, s), old(rows, sent, s)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_radial_directional_keeps_the_norm_where_the_mean_shrinks():
    """Two senders at right angles with norms 1 and 3: the mean has norm √10 / 2,
    the radial-directional average norm 2, along the mean direction of the units."""
    rows = [jnp.asarray([[1.0, 0.0], [0.0, 3.0]])]
    got = aggregation.radial_directional()(rows, jnp.ones(2, bool), None)[0]
    np.testing.assert_allclose(np.asarray(got), [np.sqrt(2.0), np.sqrt(2.0)], rtol=1e-6)


@pytest.mark.parametrize(
    "make, match",
    [
        (
            lambda: aggregation.steps_weighted_mean(-1.0),
            r"steps_weighted_mean power=-1.0; allowed: a finite number >= 0",
        ),
        (
            lambda: aggregation.steps_weighted_mean(float("inf")),
            r"steps_weighted_mean power=inf; allowed: a finite number >= 0",
        ),
        (
            lambda: aggregation.radial_directional(float("nan")),
            r"radial_directional power=nan; allowed: a finite number >= 0",
        ),
        (
            lambda: aggregation.radial_directional(plain_shapes=((50304, -1),)),
            r"radial_directional plain_shapes=\(\(50304, -1\),\); allowed: a tuple "
            r"of shapes",
        ),
        (
            lambda: aggregation.radial_directional(scope="layer"),
            r"radial_directional scope='layer'; allowed: \('piece', 'fragment'\)",
        ),
        (lambda: aggregation.quorum(0), r"quorum k=0; allowed: an int >= 1"),
    ],
)
def test_bad_decoupled_aggregator_configs_are_refused_naming_the_field(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_a_round_without_its_quorum_leaves_the_state_as_if_nobody_sent():
    """Outer Nesterov momentum built by a first round, α = 0.5: a second round with 2
    of 4 senders under `quorum(3)` leaves θ_g, the outer state and the replicas
    bitwise as a round nobody sent (a zero outer gradient would move them); with 3
    senders it is the mean's round, bitwise."""
    params = toy_params(jr.key(0))
    batches = toy_batches(jr.key(1), steps=4, replicas=M)

    def runner(aggregator):
        alg = sdiloco.streaming_diloco(
            toy_loss,
            inner=optax.sgd(0.3),
            outer=optax.sgd(0.7, momentum=0.9, nesterov=True),
            num_replicas=M,
            sync_every=2,
            overlap=0,
            alpha=0.5,
            aggregator=aggregator,
        )
        step = jax.jit(alg.step)

        def run(sends):
            state = alg.init(params)
            for t, batch in enumerate(batches, start=1):
                part = sdiloco.Participation.of([True] * M, [True] * M, sends)
                state, metrics = step(state, batch, part if t == 4 else None)
            return state, metrics

        return run

    def kept(state):
        return (state.global_params, state.outer_state, state.replica_params)

    quorum, mean = runner(aggregation.quorum(3)), runner(aggregation.mean())
    short, metrics = quorum([True, True, False, False])
    nobody, _ = mean([False] * M)
    assert tree_difference(kept(short), kept(nobody)) is None
    assert not bool(metrics["sync/applied"][0]) and bool(metrics["sync/nonfinite"][0])
    zeros = runner(lambda rows, sent, steps: [jnp.zeros(r.shape[1:]) for r in rows])
    moved, _ = zeros([True, True, False, False])
    assert tree_difference(moved.global_params, nobody.global_params) is not None
    three = [True, True, True, False]
    assert tree_difference(kept(quorum(three)[0]), kept(mean(three)[0])) is None
    assert tree_difference(quorum(three)[0].global_params, nobody.global_params)


def test_steps_weighted_mean_weighs_a_straggler_in_a_step():
    """Replica 1 skips the first of H = 3 steps: its steps are 2, the others' 3. With
    `power = 2` (outer SGD, lr 1, α = 0), θ_g moves by `Σ w_m Δ_m / Σ w_m`,
    `w = steps²`; with `power = 1` the step is the token-weighted mean's, bitwise."""
    params = toy_params(jr.key(0))
    batches = toy_batches(jr.key(1), steps=3, replicas=M)
    late = sdiloco.Participation.of([True] * M, [True, False, True, True])

    def run(aggregator):
        alg = sdiloco.streaming_diloco(
            toy_loss,
            inner=optax.sgd(0.3),
            outer=optax.sgd(1.0),
            num_replicas=M,
            sync_every=3,
            overlap=0,
            alpha=0.0,
            aggregator=aggregator,
        )
        state, step = alg.init(params), jax.jit(alg.step)
        state, _ = step(state, batches[0], late)
        state, _ = step(state, batches[1])
        before = state
        return before, step(state, batches[2])[0]

    before, after = run(aggregation.steps_weighted_mean(2.0))
    assert np.asarray(after.sent_steps)[0].tolist() == [3, 2, 3, 3]
    grads = jax.vmap(jax.grad(toy_loss))(before.replica_params, batches[2])
    w = np.asarray([9.0, 4.0, 9.0, 9.0])
    for g0, r, grad, new in zip(
        *(jax.tree.leaves(x) for x in (before.global_params, before.replica_params)),
        jax.tree.leaves(grads),
        jax.tree.leaves(after.global_params),
    ):
        deltas = np.asarray(g0, np.float64)[None] - (
            np.asarray(r, np.float64) - 0.3 * np.asarray(grad, np.float64)
        )
        expected = np.asarray(g0, np.float64) - np.tensordot(w / w.sum(), deltas, 1)
        np.testing.assert_allclose(np.asarray(new), expected, rtol=1e-5, atol=1e-6)
    token = run(aggregation.token_weighted_mean())[1]
    ones = run(aggregation.steps_weighted_mean(1.0))[1]
    assert tree_difference(token.global_params, ones.global_params) is None


def test_radial_directional_in_a_step():
    """One round of M = 4 with replica 1 silent (outer SGD, lr 1, α = 0): θ_g moves by
    the radial-directional average of the senders' Δ per piece, the leaf `v`
    (shape (3,), named in `plain_shapes`) by their mean."""
    sends = [True, False, True, True]
    aggregate = aggregation.radial_directional(plain_shapes=((3,),))
    before, after, metrics, _, batches = _one_round(aggregate, sends)
    assert bool(np.asarray(metrics["sync/applied"])[0])
    grads = jax.vmap(jax.grad(toy_loss))(before.replica_params, batches[1])
    g0 = [np.asarray(x, np.float64) for x in jax.tree.leaves(before.global_params)]
    replicas = [
        np.asarray(r, np.float64) - 0.3 * np.asarray(g, np.float64)
        for r, g in zip(jax.tree.leaves(before.replica_params), jax.tree.leaves(grads))
    ]
    deltas = [g[None] - r for g, r in zip(g0, replicas)]
    sent = np.asarray(sends)
    ref = _radial_ref(deltas, sent, None, plain_shapes=((3,),))
    mean = _mean_ref(deltas, sent)
    for g, new, x, y in zip(g0, jax.tree.leaves(after.global_params), ref, mean):
        np.testing.assert_allclose(np.asarray(new), g - x, rtol=1e-5, atol=1e-6)
        assert np.allclose(x, y) == (x.shape == (3,))  # only `v` is the mean
