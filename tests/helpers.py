"""Shared test helpers: a toy stacked-block model with a closed-form gradient, tree checks."""

import os
import pathlib
import socket
import subprocess
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax

import sdiloco
from benchmarks._common import communicate_all, xla_flags


def toy_params(key, *, dim=3, hidden=2, layers=4, dtype=jnp.float32):
    """Parameters of `toy_loss`: a linear part and L stacked tanh blocks."""
    k1, k2, k3 = jr.split(key, 3)
    return {
        "v": jr.normal(k1, (dim,), dtype) * 0.5,
        "blocks": {
            "W": jr.normal(k2, (layers, dim, hidden), dtype) * 0.5,
            "u": jr.normal(k3, (layers, hidden), dtype) * 0.5,
        },
    }


def toy_predict(params, x):
    """`x @ v + sum_l tanh(x @ W_l) @ u_l`."""
    hidden = jnp.tanh(jnp.einsum("bd,ldh->lbh", x, params["blocks"]["W"]))
    return x @ params["v"] + jnp.einsum("lbh,lh->b", hidden, params["blocks"]["u"])


def toy_loss(params, batch):
    """Half mean squared error of `toy_predict`."""
    r = toy_predict(params, batch["x"]) - batch["y"]
    return 0.5 * jnp.mean(r * r)


def toy_batches(key, *, steps, replicas, batch=4, dim=3, dtype=jnp.float32):
    """`steps` batches, each with a leading replica axis: {"x": [M, B, d], "y": [M, B]}."""
    kx, ky = jr.split(key)
    x = jr.normal(kx, (steps, replicas, batch, dim), dtype)
    y = jnp.sin(x.sum(-1)) + 0.1 * jr.normal(ky, (steps, replicas, batch), dtype)
    return [{"x": x[t], "y": y[t]} for t in range(steps)]


def tree_difference(a, b, *, rtol=None, atol=None) -> str | None:
    """None when two pytrees of arrays agree, else where they first differ and by how
    much. Bitwise (NaNs equal) without tolerances; with them, `np.isclose`."""
    flat_a, def_a = jax.tree_util.tree_flatten_with_path(a)
    flat_b, def_b = jax.tree_util.tree_flatten_with_path(b)
    if def_a != def_b:
        return f"the structures differ:\n  {def_a}\n  {def_b}"
    for (path, x), (_, y) in zip(flat_a, flat_b):
        name, x, y = (
            jax.tree_util.keystr(path) or "(root)",
            np.asarray(x),
            np.asarray(y),
        )
        if x.shape != y.shape or (rtol is None and x.dtype != y.dtype):
            return f"leaf {name}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}"
        if rtol is None and x.dtype.kind in "fcV":  # bitwise, NaNs equal
            width = f"u{x.itemsize}" if x.itemsize > 1 else "u1"
            same = x.view(width) == y.view(width)
        elif rtol is None:
            same = x == y
        else:
            x64, y64 = x.astype(np.float64), y.astype(np.float64)
            same = np.isclose(x64, y64, rtol=rtol, atol=atol, equal_nan=True)
        if not np.all(same):
            first = np.unravel_index(np.argmin(same), same.shape) if same.ndim else ()
            gap = np.abs(x.astype(np.float64) - y.astype(np.float64))
            return (
                f"leaf {name}: {np.size(same) - np.count_nonzero(same)} of "
                f"{np.size(same)} elements differ; first at {first}: {x[first]!r} vs "
                f"{y[first]!r}; largest |difference| {np.nanmax(gap):.3g}"
            )
    return None


def tree_equal(a, b) -> bool:
    """Bitwise equality of two pytrees of arrays (NaNs equal), same structure/dtypes."""
    return tree_difference(a, b) is None


def tree_allclose(a, b, *, rtol=1e-6, atol=1e-6) -> bool:
    """Closeness of two pytrees of arrays with the same structure and dtypes."""
    return tree_difference(a, b, rtol=rtol, atol=atol) is None


def assert_trees_equal(a, b) -> None:
    """Bitwise equality; the failure names the first differing leaf and the gap."""
    difference = tree_difference(a, b)
    assert difference is None, difference


def assert_trees_allclose(a, b, *, rtol=1e-6, atol=1e-6) -> None:
    """Closeness; the failure names the first differing leaf and the gap."""
    difference = tree_difference(a, b, rtol=rtol, atol=atol)
    assert difference is None, difference


def arrays(tree):
    """The inexact-array part of a pytree."""
    return eqx.filter(tree, eqx.is_inexact_array)


def relaxed(opt: optax.GradientTransformation) -> optax.GradientTransformation:
    """`opt` traced under standard dtype promotion.

    The test suite runs under `jax_numpy_dtype_promotion="strict"` to keep sdiloco's own
    code explicit about dtypes, but optax's Adam computes `b1 ** count` (float ** int32),
    which strict promotion rejects. Only the optimizer's internals are relaxed.
    """

    def init(params):
        with jax.numpy_dtype_promotion("standard"):
            return opt.init(params)

    def update(updates, state, params=None):
        with jax.numpy_dtype_promotion("standard"):
            return opt.update(updates, state, params)

    return optax.GradientTransformation(init, update)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that the OS reports free (bind to port 0, then close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def session_folder(tmp_path_factory) -> pathlib.Path:
    """A folder of this pytest run's own that every xdist worker shares: under
    pytest-xdist a worker's base folder sits in the run's, which is its parent."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def toy_streaming(
    params, *, num_replicas, layers_per_fragment=1, offload=False, **kwargs
):
    """Streaming DiLoCo on the toy model: AdamW(0.05) inner, strided fragments of
    `layers_per_fragment` blocks, H = 3, τ = 1, α = 0.5 unless `kwargs` say otherwise
    (`offload`: `sdiloco.offload` of it)."""
    frags = sdiloco.fragments_by_layer(
        params, blocks=lambda p: p["blocks"], layers_per_fragment=layers_per_fragment
    )
    options = dict(
        inner=relaxed(optax.adamw(0.05)),
        num_replicas=num_replicas,
        sync_every=3,
        fragments=frags,
        overlap=1,
        alpha=0.5,
    )
    alg = sdiloco.streaming_diloco(toy_loss, **{**options, **kwargs})
    return sdiloco.offload(alg) if offload else alg


def plugin_state(alg, state, kind):
    """The state of `alg`'s plug-in of type `kind` (e.g. `sdiloco.plugins.ErrorFeedback`),
    its leaf lists put back in the shape of the parameters (`[M, ...]` leaves)."""
    (found,) = [
        s
        for p, s in zip(alg.spec.plugin.plugins, state.plugin_state)
        if isinstance(p, kind)
    ]
    like = eqx.filter(state.global_params, eqx.is_inexact_array)
    return jax.tree.unflatten(jax.tree.structure(like), found)


def cpu_env(devices: int, *paths: str) -> dict:
    """The environment of a test subprocess: CPU only, `devices` CPU devices, the
    tests' other XLA flags (so that it compiles as the test does), and `paths` (the
    repository, the tests) on PYTHONPATH."""
    return dict(
        os.environ,
        XLA_FLAGS=xla_flags(devices),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join(paths),
    )


def start_processes(argv, num_processes: int, env: dict, cwd) -> list:
    """Start `python *argv(i)` for i in range(num_processes), output captured."""
    return [
        subprocess.Popen(
            [sys.executable, *argv(i)],
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(num_processes)
    ]


def wait_until(condition, timeout: float, poll: float = 0.01) -> None:
    """Poll `condition()` until it is true or `timeout` seconds pass; the caller then
    asserts it (for state another thread or process updates asynchronously)."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(poll)


def finish_processes(procs, timeout: float) -> list[str]:
    """The processes' outputs (stdout, stderr merged into it), all read at once
    (`communicate_all`: a process whose pipe is not read stalls once it holds
    64 KiB); fails on a non-zero exit, and kills any still running past `timeout`
    seconds (so a hung job fails the test instead of hanging it)."""
    outputs = [out for out, _ in communicate_all(procs, timeout)]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-4000:]
    return outputs
