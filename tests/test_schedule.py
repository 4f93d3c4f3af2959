"""The schedule: each fragment sent exactly once every H steps, arriving τ later."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import sdiloco
from sdiloco.schedule import NEVER


def test_paper_example():
    # §2.2: H = 100, P = 2 -> fragments sync at 100, 200, ... and 150, 250, ...
    s = sdiloco.make_schedule(100, 2, 2, overlap=0)
    sent = np.stack([np.asarray(s.sent(jnp.int32(t))) for t in range(1, 401)])
    assert (np.flatnonzero(sent[:, 0]) + 1).tolist() == [100, 200, 300, 400]
    assert (np.flatnonzero(sent[:, 1]) + 1).tolist() == [150, 250, 350]


@given(
    h=st.integers(1, 40),
    p=st.integers(1, 12),
    taus=st.lists(st.integers(0, 39), min_size=1, max_size=4),
    custom=st.booleans(),
    data=st.data(),
)
def test_each_fragment_sent_once_per_period_and_arrives_tau_later(
    h, p, taus, custom, data
):
    taus = [t % h for t in taus]
    first = None
    if custom:
        first = data.draw(st.lists(st.integers(1, 3 * h), min_size=p, max_size=p))
    s = sdiloco.make_schedule(h, p, len(taus), overlap=taus, first_send=first)
    f = np.asarray(s.first_send)
    horizon = int(f.max()) + 3 * h
    sent_at = jnp.full((p,), NEVER, jnp.int32)
    sends, outer, merges, arriving = [], [], [], []
    sent_fn = jax.jit(s.sent)
    for t in range(1, horizon + 1):
        tt = jnp.int32(t)
        sent = np.asarray(sent_fn(tt))
        sent_at = jnp.where(jnp.asarray(sent), tt, sent_at)
        sends.append(sent)
        outer.append(np.asarray(s.outer_due(tt, sent_at)))
        merges.append(np.asarray(s.merge_due(tt, sent_at)))
        arriving.append(np.asarray(s.arriving(tt, sent_at)))
    sends, outer, merges, arriving = map(np.stack, (sends, outer, merges, arriving))
    # Some replica merges exactly when a fragment arrives; an outer step (which the
    # step runs only when something arrives) is always at an arrival.
    np.testing.assert_array_equal(arriving, merges.any(axis=1))
    assert not np.any(outer & ~arriving)
    for q in range(p):
        steps = np.flatnonzero(sends[:, q]) + 1
        assert steps[0] == f[q] and np.all(np.diff(steps) == h)
        # Outer step at the earliest arrival, each replica merges at send + its tau.
        assert (np.flatnonzero(outer[:, q]) + 1).tolist() == [
            t + min(taus) for t in steps if t + min(taus) <= horizon
        ]
        for m, tau in enumerate(taus):
            assert (np.flatnonzero(merges[:, m, q]) + 1).tolist() == [
                t + tau for t in steps if t + tau <= horizon
            ]


def test_default_first_send_is_spread_over_one_period():
    for h, p in [(100, 9), (30, 3), (7, 7), (5, 12)]:
        f = sdiloco.default_first_send(h, p)
        assert f[0] == h and all(h <= x < 2 * h or (p > h and x == 2 * h) for x in f)
        assert list(f) == sorted(f)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sync_every=0, num_fragments=1, num_replicas=2), "sync_every"),
        (dict(sync_every=5, num_fragments=1, num_replicas=2, overlap=5), "tau"),
        (dict(sync_every=5, num_fragments=1, num_replicas=2, overlap=-1), "tau"),
        (
            dict(sync_every=5, num_fragments=1, num_replicas=2, overlap=(1, 2, 3)),
            "per replica",
        ),
        (
            dict(sync_every=5, num_fragments=2, num_replicas=2, first_send=(0, 3)),
            "first_send",
        ),
        (
            dict(sync_every=5, num_fragments=2, num_replicas=2, first_send=(3,)),
            "one per",
        ),
        (dict(sync_every=5, num_fragments=0, num_replicas=2), "num_fragments"),
        (dict(sync_every=5, num_fragments=1, num_replicas=0), "num_replicas"),
    ],
)
def test_bad_schedule(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sdiloco.make_schedule(**kwargs)
