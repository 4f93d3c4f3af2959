"""FedPart freezing (`fedpart.py`), the outer-gradient cosine (`analysis.py`), the
sparsifier and freezing knobs of `StreamingConfig`, and the experiment/plotting helpers
the notebooks use."""

import functools as ft
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from helpers import arrays, toy_batches, toy_loss, toy_params
from hypothesis import given, settings, strategies as st

import sdiloco
from sdiloco.fedpart import active_fragment
from sdiloco.lab import config as config_lib
from sdiloco.paper import experiments, plotting


def _fragments(params, per=1):
    return sdiloco.fragments_by_layer(
        params, blocks=lambda p: p["blocks"], layers_per_fragment=per, pattern="strided"
    )


@given(
    h=st.integers(1, 12),
    p=st.integers(1, 6),
    t=st.integers(1, 80),
)
@settings(max_examples=60, deadline=None)
def test_active_fragment_is_the_next_to_send(h, p, t):
    schedule = sdiloco.make_schedule(h, p, 2)
    # Reference: walk forward from t until some fragment is sent; lowest index wins.
    s = t
    while True:
        due = [
            q for q, f in enumerate(schedule.first_send) if s >= f and (s - f) % h == 0
        ]
        if due:
            break
        s += 1
    assert int(active_fragment(schedule, jnp.asarray(t, jnp.int32))) == min(due)


def test_freeze_unsynced_updates_only_the_active_fragment():
    params = toy_params(jr.key(0), layers=4)
    frags = _fragments(params)  # fragment 0 = "v", fragments 1..4 = one layer each
    schedule = sdiloco.make_schedule(10, frags.num_fragments, 1)
    opt = sdiloco.freeze_unsynced(optax.sgd(0.1), frags, schedule)
    grads = jax.tree.map(jnp.ones_like, arrays(params))
    state = opt.init(arrays(params))
    for t in range(1, 31):
        updates, state = opt.update(grads, state, arrays(params))
        active = int(active_fragment(schedule, jnp.asarray(t, jnp.int32)))
        nonzero_v = bool(np.any(np.asarray(updates["v"]) != 0))
        assert nonzero_v == (active == 0)
        rows = np.any(np.asarray(updates["blocks"]["W"]) != 0, axis=(1, 2))
        expected = np.asarray(frags.labels[0]) == active  # W's per-row labels
        np.testing.assert_array_equal(rows, expected)
        # The active fragment gets exactly sgd's update.
        if active == 0:
            np.testing.assert_allclose(np.asarray(updates["v"]), -0.1)


def test_freeze_unsynced_rejects_mismatched_schedule():
    params = toy_params(jr.key(0), layers=4)
    frags = _fragments(params)
    with pytest.raises(ValueError, match="P=5"):
        sdiloco.freeze_unsynced(optax.sgd(0.1), frags, sdiloco.make_schedule(10, 3, 1))


@ft.cache
def _algorithm(replicas):
    """One algorithm (and one compiled step) per M, shared by every example."""
    params = toy_params(jr.key(0), layers=4)
    alg = sdiloco.streaming_diloco(
        toy_loss,
        inner=optax.sgd(0.05),
        num_replicas=replicas,
        sync_every=50,
        fragments=_fragments(params, per=2),
        overlap=1,
    )
    return alg, eqx.filter_jit(alg.step)


def _trained_state(seed, replicas=3, steps=5):
    params = toy_params(jr.key(seed), layers=4)
    alg, step = _algorithm(replicas)
    state = alg.init(params)
    for batch in toy_batches(jr.key(seed + 1), steps=steps, replicas=replicas):
        state, _ = step(state, batch)
    return params, state


@given(seed=st.integers(0, 2**16), replicas=st.integers(2, 4))
@settings(max_examples=10, deadline=None)
def test_outer_gradient_cosine_matches_float64_reference(seed, replicas):
    params, state = _trained_state(seed, replicas)
    for per in (1, 2):
        frags = _fragments(params, per)
        ours = np.asarray(sdiloco.outer_gradient_cosine(state, frags))
        # Reference: flatten each replica's Δ restricted to each fragment, in float64.
        g = jax.tree.leaves(arrays(state.global_params))
        r = jax.tree.leaves(arrays(state.replica_params))
        ref = []
        for p in range(frags.num_fragments):
            vecs = []
            for m in range(replicas):
                parts = []
                for xg, xr, lab in zip(g, r, frags.labels):
                    d = np.asarray(xg, np.float64) - np.asarray(xr[m], np.float64)
                    if lab.ndim == 0:
                        if int(lab) == p:
                            parts.append(d.ravel())
                    else:
                        parts.append(d[np.asarray(lab) == p].ravel())
                vecs.append(np.concatenate(parts))
            pairs = [
                vecs[a] @ vecs[b] / (np.linalg.norm(vecs[a]) * np.linalg.norm(vecs[b]))
                for a in range(replicas)
                for b in range(replicas)
                if a != b
            ]
            ref.append(np.mean(pairs))
        np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5)


def test_outer_gradient_cosine_is_one_for_identical_replicas_and_needs_two():
    params, state = _trained_state(0)
    same = state._replace(
        replica_params=jax.tree.map(
            lambda x: jnp.broadcast_to(x[:1], x.shape), state.replica_params
        )
    )
    np.testing.assert_allclose(
        np.asarray(sdiloco.outer_gradient_cosine(same, _fragments(params))),
        1.0,
        rtol=1e-5,
    )
    one = state._replace(
        replica_params=jax.tree.map(lambda x: x[:1], state.replica_params)
    )
    with pytest.raises(ValueError, match="M >= 2"):
        sdiloco.outer_gradient_cosine(one, _fragments(params))


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"sparsifier": "zip"}, "sparsifier"),
        ({"sparsifier": "dare"}, "quantizer"),  # the default quantizer is e3m0
        ({"sparsifier": "dare", "quantizer": None, "drop_rate": 1.0}, "drop_rate"),
        ({"kind": "diloco", "freeze_unsynced": True}, "freeze_unsynced"),
    ],
)
def test_method_config_rejects_bad_compression_and_freezing(changes, field):
    with pytest.raises(ValueError, match=field):
        config_lib.method_from_dict(changes)


@pytest.mark.parametrize("kind", ["fed_dropout", "dare", "top_k"])
def test_sparsifier_bits_follow_the_drop_rate(kind):
    c = config_lib.preset(
        "streaming_overlap",
        model="tiny-xxs",
        method={"quantizer": None, "sparsifier": kind, "drop_rate": 0.75},
    )
    fp32 = experiments.bits_per_param_per_sync(
        config_lib.preset("streaming_overlap", model="tiny-xxs")
    )
    ours = experiments.bits_per_param_per_sync(c)
    assert fp32 == pytest.approx(32.0)
    # A quarter of the values kept (Top-K also sends their indices).
    assert 0.25 * 32 <= ours <= (0.25 * 64 + 1 if kind == "top_k" else 0.25 * 32 + 1)


def test_summarize_mean_std_over_seeds():
    mk = lambda name, seed, v: experiments.Result(  # noqa: E731
        name, seed, config_lib.RunConfig(), [{"step": 1, "eval/global": v}], [], {}
    )
    stats = experiments.summarize([mk("a", 0, 1.0), mk("a", 1, 3.0), mk("b", 0, 2.0)])
    assert stats["a"] == {
        "mean": 2.0,
        "std": pytest.approx(2**0.5),
        "min": 1.0,
        "max": 3.0,
        "n": 2,
    }
    assert stats["b"]["std"] == 0.0 and stats["b"]["n"] == 1
    assert experiments.mean_pm(stats["a"], 2) == "2.00 ± 1.41"


def test_save_table_writes_markdown_csv_and_metadata(tmp_path, monkeypatch):
    monkeypatch.setenv("SDILOCO_FIGURES_DIR", str(tmp_path))
    rows = [{"method": "DP", "loss": 2.5}, {"method": "ours", "loss": 2.25}]
    plotting.save_table(
        rows, "t", title="T", notebook="nb", config={"a": 1}, seeds=[0, 1]
    )
    assert (tmp_path / "t.md").read_text().splitlines()[2:5] == [
        "| method | loss |",
        "|---|---|",
        "| DP | 2.500 |",
    ]
    assert (tmp_path / "t.csv").read_text().splitlines()[0] == "method,loss"
    meta = json.loads((tmp_path / "t.json").read_text())
    assert meta["notebook"] == "nb" and meta["seeds"] == [0, 1]
    assert meta["results"] == rows and meta["versions"]["jax"] == jax.__version__
    assert len(meta["git_commit"]) >= 7
