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

        def flat(p):
            return {
                "v": np.asarray(p["v"]),
                "W": np.asarray(p["blocks"]["W"]),
                "u": np.asarray(p["blocks"]["u"]),
            }

        np_batches = [(np.asarray(b["x"]), np.asarray(b["y"])) for b in batches]
        g, reps = _reference(
            flat(params), np_batches, H=H, k=k, taus=taus, alpha=alpha, single=single
        )
        for n, v in flat(state.global_params).items():
            np.testing.assert_allclose(v, g[n], rtol=1e-12, atol=1e-12)
            assert not np.allclose(v, flat(params)[n])
        for m in range(M):
            for n, v in flat(sdiloco.replica_params(state, m)).items():
                np.testing.assert_allclose(v, reps[m][n], rtol=1e-12, atol=1e-12)
