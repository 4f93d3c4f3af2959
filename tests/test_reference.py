"""Reference numerics: sdiloco against an independent float64 NumPy Streaming DiLoCo.

The NumPy code below is written from docs/contract.md §1 for this test alone: its own
gradients (closed form for the toy model), its own AdamW and Nesterov, its own fragment
assignment and schedule. No sdiloco code is used by it.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from helpers import relaxed, toy_batches, toy_loss, toy_params

import sdiloco


LR, B1, B2, EPS, WD = 0.05, 0.9, 0.99, 1e-8, 0.1
OUTER_LR, MU = 0.4, 0.9


def _np_grads(p, x, y):
    """Closed-form gradient of 0.5 * mean((x v + sum_l tanh(x W_l) u_l - y)^2)."""
    z = np.tanh(np.einsum("bd,ldh->lbh", x, p["W"]))
    r = x @ p["v"] + np.einsum("lbh,lh->b", z, p["u"]) - y
    dpred = r / x.shape[0]
    return {
        "v": x.T @ dpred,
        "W": np.einsum(
            "bd,lbh->ldh", x, dpred[None, :, None] * p["u"][:, None, :] * (1 - z**2)
        ),
        "u": np.einsum("lbh,b->lh", z, dpred),
    }


def _flat(p):
    """The toy parameters as NumPy arrays named as the references name them."""
    return {
        "v": np.asarray(p["v"]),
        "W": np.asarray(p["blocks"]["W"]),
        "u": np.asarray(p["blocks"]["u"]),
    }


def _np_labels(layers, k, single):
    """Fragment of every element: v -> 0, layer l -> 1 + l mod (L / k) (strided)."""
    if single:
        return {
            "v": np.zeros(1, int),
            "W": np.zeros(layers, int),
            "u": np.zeros(layers, int),
        }, 1
    pb = layers // k
    lab = 1 + np.arange(layers) % pb
    return {"v": np.zeros(1, int), "W": lab, "u": lab}, pb + 1


def _region(labels, name, p, shape):
    lab = labels[name]
    if name == "v":
        return np.full(shape, lab[0] == p)
    return np.broadcast_to((lab == p).reshape((-1,) + (1,) * (len(shape) - 1)), shape)


def _reference(params, batches, *, H, k, taus, alpha, single):
    M = len(taus)
    layers = params["W"].shape[0]
    labels, P = _np_labels(layers, k, single)
    first = [H + int(np.floor(p * H / P + 0.5)) for p in range(P)]
    g = {n: v.copy() for n, v in params.items()}
    mom = {n: np.zeros_like(v) for n, v in params.items()}
    reps = [{n: v.copy() for n, v in params.items()} for _ in range(M)]
    adam = [
        (
            {n: np.zeros_like(v) for n, v in params.items()},
            {n: np.zeros_like(v) for n, v in params.items()},
        )
        for _ in range(M)
    ]
    inflight = {}
    for t, (xs, ys) in enumerate(batches, start=1):
        for m in range(M):  # 1. inner AdamW
            grads = _np_grads(reps[m], xs[m], ys[m])
            mu, nu = adam[m]
            for n in params:
                mu[n] = B1 * mu[n] + (1 - B1) * grads[n]
                nu[n] = B2 * nu[n] + (1 - B2) * grads[n] ** 2
                upd = (mu[n] / (1 - B1**t)) / (np.sqrt(nu[n] / (1 - B2**t)) + EPS)
                reps[m][n] = reps[m][n] - LR * (upd + WD * reps[m][n])
        for p in range(P):  # 2. send
            if t >= first[p] and (t - first[p]) % H == 0:
                delta = {n: sum(g[n] - r[n] for r in reps) / M for n in params}
                inflight[p] = (delta, t)
        for p, (
            delta,
            sent,
        ) in inflight.items():  # 3. outer step at the earliest arrival
            if t == sent + min(taus):
                for n in params:
                    reg = _region(labels, n, p, g[n].shape)
                    new_mom = delta[n] + MU * mom[n]
                    g[n] = np.where(
                        reg, g[n] - OUTER_LR * (delta[n] + MU * new_mom), g[n]
                    )
                    mom[n] = np.where(reg, new_mom, mom[n])
        for p, (delta, sent) in inflight.items():  # merge on each replica at its tau
            for m, tau in enumerate(taus):
                if t == sent + tau:
                    for n in params:
                        reg = _region(labels, n, p, g[n].shape)
                        reps[m][n] = np.where(
                            reg, alpha * reps[m][n] + (1 - alpha) * g[n], reps[m][n]
                        )
    return g, reps


@pytest.mark.parametrize(
    "H, k, taus, alpha, single",
    [
        (3, 4, (0, 0, 0), 0.0, False),  # P = 2, blocking
        (4, 2, (1, 1, 1), 0.5, False),  # P = 3, overlap
        (5, 1, (0, 1, 2), 0.5, False),  # P = 5, a different tau per replica
        (3, 1, (2, 2, 2, 2), 0.25, False),  # P = 5 > H: two fragments per step, M = 4
        (2, 2, (1, 0, 1), 1.0, False),  # alpha = 1
        (3, 4, (0, 0, 0), 0.0, True),  # vanilla DiLoCo
    ],
)
def test_matches_float64_numpy_reference(H, k, taus, alpha, single):
    with jax.enable_x64(True):
        M = len(taus)
        params = toy_params(jr.key(0), dtype=jnp.float64)
        batches = toy_batches(jr.key(1), steps=4 * H + 3, replicas=M, dtype=jnp.float64)
        frags = (
            None
            if single
            else sdiloco.fragments_by_layer(
                params, blocks=lambda p: p["blocks"], layers_per_fragment=k
            )
        )
        alg = sdiloco.streaming_diloco(
            toy_loss,
            inner=relaxed(optax.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD)),
            outer=optax.sgd(OUTER_LR, momentum=MU, nesterov=True),
            num_replicas=M,
            sync_every=H,
            fragments=frags,
            overlap=taus,
            alpha=alpha,
        )
        state = alg.init(params)
        step = eqx.filter_jit(alg.step)
        applied = 0
        for b in batches:
            state, metrics = step(state, b)
            applied += int(np.asarray(metrics["sync/applied"]).sum())
        assert applied >= 2

        np_batches = [(np.asarray(b["x"]), np.asarray(b["y"])) for b in batches]
        g, reps = _reference(
            _flat(params), np_batches, H=H, k=k, taus=taus, alpha=alpha, single=single
        )
        for n, v in _flat(state.global_params).items():
            np.testing.assert_allclose(v, g[n], rtol=1e-12, atol=1e-12)
            assert not np.allclose(v, _flat(params)[n])
        for m in range(M):
            for n, v in _flat(sdiloco.replica_params(state, m)).items():
                np.testing.assert_allclose(v, reps[m][n], rtol=1e-12, atol=1e-12)


# ------------------------------------------- beyond the paper: stages and Eager merges


def _np_top2_of_4_int2(x):
    """float64 `chain(chunked_top_k(0.5, chunk=4), quantizer("int2"))` of one group:
    the 2 largest |x| of every 4 elements, then `_np_int2` of those."""
    flat = np.asarray(x, np.float64).reshape(-1)
    rows = np.zeros(-(-flat.size // 4) * 4)
    rows[: flat.size] = flat
    rows = rows.reshape(-1, 4)
    kept = np.zeros_like(rows)
    for r, row in enumerate(rows):
        idx = np.argsort(-np.abs(row), kind="stable")[:2]
        kept[r, idx] = row[idx]
    return _np_int2(kept).reshape(-1)[: flat.size].reshape(np.shape(x))


def _np_int2(x):
    """float64 `quantizer("int2")` of one group: ±amax or 0 (nearest, a tie to 0),
    with amax sent as float32 metadata."""
    amax = np.float64(np.float32(np.abs(x).max()))
    return np.where(np.abs(x) > 0.5 * amax, np.sign(x) * amax, 0.0)


def _np_compress(delta, compress):
    """`compress` per group: the whole of `v`, one row (layer) of `W` and `u`."""
    if compress is None:
        return delta
    out = {"v": compress(delta["v"])}
    for n in ("W", "u"):
        out[n] = np.stack([compress(row) for row in delta[n]])
    return out


def _reference_beyond(params, batches, *, H, k, taus, compress, beta, mu, eager):
    """The paper's algorithm with error feedback (decay β) around `compress`, outer
    SGD with momentum μ (Nesterov), and the α = 0.5 merge or the Eager merge."""
    M, names = len(taus), list(params)
    labels, P = _np_labels(params["W"].shape[0], k, False)
    first = [H + int(np.floor(p * H / P + 0.5)) for p in range(P)]
    g = {n: v.copy() for n, v in params.items()}
    mom = {n: np.zeros_like(v) for n, v in params.items()}
    reps = [{n: v.copy() for n, v in params.items()} for _ in range(M)]
    err = [{n: np.zeros_like(v) for n, v in params.items()} for _ in range(M)]
    stand = [{n: v.copy() for n, v in params.items()} for _ in range(M)]
    adam = [
        tuple({n: np.zeros_like(params[n]) for n in names} for _ in range(2))
        for _ in range(M)
    ]

    def nesterov(g_, d, m_):
        new_m = d + mu * m_
        return g_ - OUTER_LR * (d + mu * new_m), new_m

    inflight = {}
    for t, (xs, ys) in enumerate(batches, start=1):
        for m in range(M):  # inner AdamW
            grads = _np_grads(reps[m], xs[m], ys[m])
            m1, m2 = adam[m]
            for n in names:
                m1[n] = B1 * m1[n] + (1 - B1) * grads[n]
                m2[n] = B2 * m2[n] + (1 - B2) * grads[n] ** 2
                upd = (m1[n] / (1 - B1**t)) / (np.sqrt(m2[n] / (1 - B2**t)) + EPS)
                reps[m][n] = reps[m][n] - LR * (upd + WD * reps[m][n])
        for p in range(P):  # send: EF around the compressor, then the stand-in
            if not (t >= first[p] and (t - first[p]) % H == 0):
                continue
            own = []
            for m in range(M):
                acc = {n: g[n] - reps[m][n] + beta * err[m][n] for n in names}
                sent = _np_compress(acc, compress)
                for n in names:
                    reg = _region(labels, n, p, g[n].shape)
                    err[m][n] = np.where(reg, acc[n] - sent[n], err[m][n])
                own.append(sent)
                if eager:
                    for n in names:
                        reg = _region(labels, n, p, g[n].shape)
                        new, _ = nesterov(g[n], sent[n], mom[n])
                        stand[m][n] = np.where(reg, new, stand[m][n])
                        reps[m][n] = np.where(reg, new, reps[m][n])
            inflight[p] = ({n: sum(o[n] for o in own) / M for n in names}, t)
        for p, (delta, sent_t) in inflight.items():  # outer step at the first arrival
            if t == sent_t + min(taus):
                for n in names:
                    reg = _region(labels, n, p, g[n].shape)
                    new, new_m = nesterov(g[n], delta[n], mom[n])
                    g[n], mom[n] = (
                        np.where(reg, new, g[n]),
                        np.where(reg, new_m, mom[n]),
                    )
        for p, (delta, sent_t) in inflight.items():  # merge at each replica's tau
            for m, tau in enumerate(taus):
                if t != sent_t + tau:
                    continue
                for n in names:
                    reg = _region(labels, n, p, g[n].shape)
                    if eager:
                        new = reps[m][n] - stand[m][n] + g[n]
                    else:
                        new = 0.5 * reps[m][n] + 0.5 * g[n]
                    reps[m][n] = np.where(reg, new, reps[m][n])
    return g, reps


@pytest.mark.parametrize(
    "spec, beta, mu, merge, taus",
    [
        ("topk:0.5/4,int2,ef:0.9", 0.9, 0.0, "alpha", (1, 1)),  # SparseLoCo's update
        ("int2,ef", 1.0, MU, "alpha", (1, 1)),  # MuLoCo's compression (2-bit + EF)
        (None, 0.0, MU, "eager", (1, 1)),  # Eager updates, float32 wire
        ("topk:0.5/4,int2,ef:0.9", 0.9, MU, "eager", (2, 1, 2)),  # all at once
    ],
)
def test_beyond_the_paper_matches_float64_numpy_reference(spec, beta, mu, merge, taus):
    H, k = 4, 2
    compress = {"int2,ef": _np_int2, None: None}.get(spec, _np_top2_of_4_int2)
    with jax.enable_x64(True):
        M = len(taus)
        params = toy_params(jr.key(0), dtype=jnp.float64)
        batches = toy_batches(jr.key(1), steps=4 * H + 3, replicas=M, dtype=jnp.float64)
        outer = optax.sgd(OUTER_LR, momentum=mu or None, nesterov=bool(mu))
        alg = sdiloco.streaming_diloco(
            toy_loss,
            inner=relaxed(optax.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD)),
            outer=outer,
            num_replicas=M,
            sync_every=H,
            fragments=sdiloco.fragments_by_layer(
                params, blocks=lambda p: p["blocks"], layers_per_fragment=k
            ),
            overlap=taus,
            compressor=spec,
            plugins=sdiloco.alpha_merge(0.5) if merge == "alpha" else sdiloco.eager(),
        )
        state = alg.init(params)
        step = eqx.filter_jit(alg.step)
        for b in batches:
            state, _ = step(state, b)

        np_batches = [(np.asarray(b["x"]), np.asarray(b["y"])) for b in batches]
        g, reps = _reference_beyond(
            _flat(params),
            np_batches,
            H=H,
            k=k,
            taus=taus,
            compress=compress,
            beta=beta,
            mu=mu,
            eager=merge == "eager",
        )
        for n, v in _flat(state.global_params).items():
            np.testing.assert_allclose(v, g[n], rtol=1e-10, atol=1e-12)
            assert not np.allclose(v, _flat(params)[n])
        for m in range(M):
            for n, v in _flat(sdiloco.replica_params(state, m)).items():
                np.testing.assert_allclose(v, reps[m][n], rtol=1e-10, atol=1e-12)
