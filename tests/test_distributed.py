"""Replicas sharded over devices and processes: the same results as the simulation.

Numerics. In the exchange, every replica's reconstruction of every message is bitwise
the simulation's (same quantizer, same keys, integer codes moved verbatim); the mean is
the same fixed-order `communication.average` of the same values (checked here within
M - 1 roundings). A whole sharded step is not bitwise: XLA:CPU compiles the per-device
program (an `[M/D, ...]` slice of the replica axis, a size-1 axis squeezed away) with
different dot kernels and operand layouts than the `[M, ...]` program, so the inner
step differs by float32 rounding (a few ulp per step). Over the steps here the
parameters agree to 1e-5 relative + 1e-6 absolute (measured: ~1e-7); a quantization
code would only differ if a value sat within those ulps of a rounding boundary. The
two-process run is bitwise the single-process sharded run (the same per-device
program; an all-gather moves bytes exactly).
"""

import contextlib
import math
import os
import pathlib
import re
import socket
import time

import distributed_worker
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from helpers import (
    assert_trees_allclose,
    assert_trees_equal,
    cpu_env,
    finish_processes,
    free_port,
    plugin_state,
    relaxed,
    start_processes,
    toy_batches,
    toy_loss,
    toy_params,
    toy_streaming,
    tree_allclose,
    tree_equal,
)
from hypothesis import given, settings, strategies as st
from jax.sharding import PartitionSpec

import sdiloco
from sdiloco import communication, distributed


M = 4
ROOT = pathlib.Path(__file__).resolve().parent.parent
TOL = dict(rtol=1e-5, atol=1e-6)


@contextlib.contextmanager
def _fresh_compile():
    """Compile without the persistent cache: its executables keep the op names
    (read by `wire_bytes`) of whatever program was cached under the same key."""
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)


def _frags(params):
    # v (a whole leaf) is fragment 0; blocks' rows 0, 2 -> 1 and 1, 3 -> 2.
    return sdiloco.fragments_by_layer(
        params, blocks=lambda p: p["blocks"], layers_per_fragment=2
    )


def _streaming(params, exchange, **kw):
    kw = {"compressor": "e3m0", **kw}
    return toy_streaming(
        params, num_replicas=M, layers_per_fragment=2, exchange=exchange, **kw
    )


def _host(tree):
    return jax.tree.map(
        lambda x: np.asarray(x) if isinstance(x, jax.Array) else x, tree
    )


# ------------------------------------------------------------------------ wire format


@given(
    n=st.sampled_from([0, 1, 7, 16]),
    batch=st.sampled_from([(), (3,)]),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=10)
def test_pack4_roundtrip(n, batch, seed):
    codes = np.random.default_rng(seed).integers(0, 16, batch + (n,), dtype=np.uint8)
    packed = jax.jit(distributed.pack4)(jnp.asarray(codes))
    assert packed.dtype == jnp.uint8 and packed.shape == batch + ((n + 1) // 2,)
    padded = np.concatenate([codes, np.zeros(batch + (n % 2,), np.uint8)], axis=-1)
    expected = padded[..., 0::2] | (padded[..., 1::2] << 4)  # NumPy reference
    np.testing.assert_array_equal(np.asarray(packed), expected)
    unpacked = jax.jit(distributed.unpack4, static_argnums=1)(packed, n)
    np.testing.assert_array_equal(np.asarray(unpacked), codes)


# ----------------------------------------------------------------------- the exchange


def _deltas(params, key):
    leaves = jax.tree.leaves(params)
    keys = jr.split(key, len(leaves))
    scales = [1.0, 3.0, 0.01]
    return [jr.normal(k, (M,) + x.shape) * s for k, x, s in zip(keys, leaves, scales)]


class _Jitter(sdiloco.Compressor):
    """A keyed compressor that is not a Quantizer: `x · (1 + u / 8)`, u ~ U[0, 1)."""

    needs_key = True

    def __call__(self, x, key=None):
        return x * (1 + jr.uniform(key, x.shape, x.dtype) / 8)

    def bits(self, shape):
        return 32 * math.prod(shape)


@pytest.mark.parametrize(
    "compressor, devices",
    [
        (sdiloco.quantizer("e3m0", rounding="stochastic"), 4),
        (sdiloco.quantizer("e3m0"), 2),  # two replicas per device
        (sdiloco.quantizer("int4", granularity="row"), 4),
        (sdiloco.quantizer("e4m3", granularity="block", block_size=5), 4),
        (sdiloco.quantizer("bf16"), 4),
        (None, 4),
        (_Jitter(), 4),  # a compressor without a message of its own: dense values
        # Messages with integer fields of several widths, sparse values, seeds:
        ("int2,ef", 4),
        ("topk:0.02/64,int2,ef:0.9", 4),
        ("topk:0.02/64,int2,ef:0.9", 2),
        ("int8mm", 4),
        ("topk:0.1", 4),
        ("dare:0.5", 4),
        ("topk:0.05/32,int4:sr", 4),
    ],
)
def test_exchange_equals_the_simulation(compressor, devices):
    if isinstance(compressor, str):  # what the step exchanges: the stages before EF
        compressor, _ = sdiloco.compression.parse_with_feedback(compressor)
    params = toy_params(jr.key(0))
    frags = _frags(params)
    deltas = _deltas(params, jr.key(1))
    key = jr.key_data(jr.key(2))
    mesh = distributed.replica_mesh(M, jax.devices()[:devices])
    exchange = distributed.sharded_exchange(mesh)
    mean, own = jax.jit(exchange, static_argnums=(0, 1))(compressor, frags, deltas, key)
    ref_mean, ref_own = jax.jit(
        communication.simulated_exchange, static_argnums=(0, 1)
    )(compressor, frags, deltas, key)
    # What every replica reconstructs of every other's message is bitwise the same.
    assert_trees_equal(_host(own), _host(ref_own))
    assert all(x.sharding.spec == PartitionSpec("replica") for x in own)
    # The mean is the same fixed-order `communication.average` of the same [M, ...]
    # values; checked within M - 1 roundings of partial sums.
    for got, ref, values in zip(mean, ref_mean, ref_own):
        bound = M * np.finfo(np.float32).eps * np.mean(np.abs(np.asarray(values)), 0)
        assert np.all(np.abs(np.asarray(got) - np.asarray(ref)) <= bound)
    if compressor is not None:  # the compressor did something
        assert not tree_equal(_host(own), _host(deltas))


@pytest.mark.hlo
def test_exchange_all_gathers_each_fragment_once():
    params = toy_params(jr.key(0))
    frags = _frags(params)
    deltas = _deltas(params, jr.key(3))
    key = jr.key_data(jr.key(4))
    compressor = sdiloco.quantizer("e3m0")
    exchange = distributed.sharded_exchange(distributed.replica_mesh(M))
    fn = jax.jit(exchange, static_argnums=(0, 1))
    with _fresh_compile():
        compiled = fn.lower(compressor, frags, deltas, key).compile()
    mean, own = compiled(deltas, key)
    ref_mean, ref_own = communication.simulated_exchange(compressor, frags, deltas, key)
    assert_trees_equal(mean, ref_mean)
    assert_trees_equal(own, ref_own)
    # One all-gather per fragment, attributed to it by its named scope.
    assert sorted(distributed.wire_bytes(compiled.as_text(), M)) == [0, 1, 2]


# ---------------------------------------------------------------- the sharded step


@pytest.fixture(scope="module")
def sharded_run():
    """e3m0 with error feedback, simulated and sharded over 4 devices (compiled once)."""
    params = toy_params(jr.key(5))
    batches = toy_batches(jr.key(6), steps=10, replicas=M)  # about 3H
    mesh = distributed.replica_mesh(M)
    kw = dict(plugins=sdiloco.error_feedback())
    sim = _streaming(params, communication.simulated_exchange, **kw)
    alg = _streaming(params, distributed.sharded_exchange(mesh), **kw)
    ref_state = sim.init(params, jr.key(7))
    state = distributed.shard_state(alg.init(params, jr.key(7)), mesh)
    ref_step = eqx.filter_jit(sim.step)
    with _fresh_compile():
        compiled = (
            distributed.sharded_step(alg.step, mesh)
            .lower(state, distributed.shard_batch(batches[0], mesh, M))
            .compile()
        )
    ref_metrics, metrics = [], []
    for batch in batches:
        ref_state, m = ref_step(ref_state, batch)
        ref_metrics.append(m)
        state, m = compiled(state, distributed.shard_batch(batch, mesh, M))
        metrics.append(m)
    return dict(
        params=params,
        alg=alg,
        ref=(ref_state, ref_metrics),
        sharded=(state, metrics),
        text=compiled.as_text(),
    )


def test_sharded_step_equals_simulation(sharded_run):
    ref_state, ref_metrics = sharded_run["ref"]
    state, metrics = sharded_run["sharded"]
    for a, b in zip(ref_metrics, metrics):
        for name in ("sync/sent", "sync/applied", "sync/merged", "comm/bits"):
            np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]))
    assert_trees_allclose(_host(state), _host(ref_state), **TOL)
    assert not tree_allclose(state.global_params, sharded_run["params"])
    residual = plugin_state(
        sharded_run["alg"], ref_state, sdiloco.plugins.ErrorFeedback
    )
    assert np.abs(np.asarray(residual["v"])).max() > 0
    # A fragment sent at the last step is still in flight (τ = 1).
    assert int(state.step) in np.asarray(state.sent_at).tolist()
    assert any(np.asarray(m["sync/applied"]).any() for m in metrics)
    # The state kept its layout: replica leaves split, the rest replicated.
    assert jax.tree.leaves(state.plugin_state)  # the residual
    for x in jax.tree.leaves((state.replica_params, state.plugin_state)):
        assert x.sharding.spec == PartitionSpec("replica")
    for x in jax.tree.leaves((state.global_params, state.inflight)):
        assert x.sharding.is_fully_replicated


@pytest.mark.hlo
def test_compiled_sync_all_gathers_the_packed_payload(sharded_run):
    alg, params, text = sharded_run["alg"], sharded_run["params"], sharded_run["text"]
    bits = alg.bits_per_fragment(params)
    sizes = _frags(params).sizes()
    wire = distributed.wire_bytes(text, M)
    # One uint8 message per fragment: the 4-bit codes, two per byte, and the f32
    # scales; exactly the accounting's bits, rounded up to a whole byte.
    assert wire == {p: math.ceil(b / 8) for p, b in enumerate(bits)}
    for p, n in enumerate(sizes):
        assert wire[p] < 4 * n  # less than the fp32 fragment
    # Nothing else of fragment size crosses the wire: no fp32 all-reduce/all-gather.
    for c in distributed.collectives(text):
        if c.dtype != "u8":
            assert c.bytes_per_device < 4 * min(sizes), c


FRONTIER = [
    None,
    "bf16",
    "e4m3",
    "e3m0",
    "e2m1",
    "int8mm",
    "int2,ef",
    "topk:0.02/64,int2,ef:0.9",
]
"""The recipes of the bits-vs-loss frontier whose compiled wire is checked."""


@pytest.mark.hlo
@pytest.mark.parametrize("recipe", FRONTIER)
def test_compiled_wire_is_the_accounting(recipe):
    """Per recipe, the bytes one replica sends per fragment in the compiled step are
    `Algorithm.bits_per_fragment / 8` within 1 %: the wire carries what the chain
    encodes (integer fields at their widths), not a dense reconstruction. The leaves
    are large enough (1024 and 2 x 1024 x 16 elements per fragment) that the padding,
    at most one byte per width, is far below 1 %."""
    params = toy_params(jr.key(12), dim=1024, hidden=16)
    mesh = distributed.replica_mesh(M)
    alg = _streaming(params, distributed.sharded_exchange(mesh), compressor=recipe)
    state = distributed.shard_state(alg.init(params, jr.key(13)), mesh)
    batch = toy_batches(jr.key(14), steps=1, replicas=M, dim=1024)[0]
    with _fresh_compile():
        text = (
            distributed.sharded_step(alg.step, mesh)
            .lower(state, distributed.shard_batch(batch, mesh, M))
            .compile()
            .as_text()
        )
    bits = alg.bits_per_fragment(params)
    wire = distributed.wire_bytes(text, M)
    assert sorted(wire) == list(range(len(bits)))
    for p, b in enumerate(bits):
        assert b / 8 <= wire[p] <= 1.01 * b / 8, (recipe, p, wire[p], b / 8)
        if recipe is not None:
            assert wire[p] < 4 * _frags(params).sizes()[p]  # below fp32
    # Nothing else of fragment size crosses the wire: every message is the u8 one.
    for c in distributed.collectives(text):
        if c.dtype != "u8":
            assert c.bytes_per_device < min(bits) / 8, c


def _callers(text: str) -> dict[str, set[str]]:
    """HLO computation name -> the names of the computations that call it."""
    out: dict[str, set[str]] = {}
    current = None
    for line in text.splitlines():
        if line and not line.startswith(" ") and "{" in line:
            head = line.split(" (")[0].split()
            current = head[-1].lstrip("%")
            continue
        if current is None:
            continue
        for name in re.findall(
            r"(?:body|condition|to_apply|calls|branch_computations=\{[^}]*)=?%?"
            r"([\w.\-]+)",
            line,
        ):
            out.setdefault(name, set()).add(current)
        for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
            for name in group.split(","):
                out.setdefault(name.strip().lstrip("%"), set()).add(current)
    return out


@pytest.mark.hlo
def test_diloco_exchanges_only_inside_the_loop_over_due_fragments():
    """A regression: with one fragment group, XLA hoisted the send (Δ, encoding and
    the all-gather) out of the loop over due fragments, so a sharded DiLoCo sent the
    whole model at every step. Every all-gather must be reachable from the entry
    computation only through that loop (a `while`)."""
    params = toy_params(jr.key(5))
    mesh = distributed.replica_mesh(M)
    alg = sdiloco.diloco(
        toy_loss,
        inner=relaxed(optax.adamw(0.05)),
        num_replicas=M,
        sync_every=3,
        exchange=distributed.sharded_exchange(mesh),
    )
    state = distributed.shard_state(alg.init(params), mesh)
    batch = distributed.shard_batch(
        toy_batches(jr.key(6), steps=1, replicas=M)[0], mesh, M
    )
    with _fresh_compile():
        text = distributed.sharded_step(alg.step, mesh).lower(state, batch).compile()
        text = text.as_text()
    callers = _callers(text)
    loops = {m.group(1) for m in re.finditer(r"while\(.*?body=%?([\w.\-]+)", text)}
    holders = set()
    current = None
    for line in text.splitlines():
        if line and not line.startswith(" ") and "{" in line:
            current = line.split(" (")[0].split()[-1].lstrip("%")
        elif "all-gather(" in line and "u8" in line:
            holders.add(current)
    assert holders, "no all-gather of the packed message"

    def through_loop(name, seen=()):
        if name in loops:
            return True
        parents = callers.get(name, set()) - set(seen)
        return bool(parents) and all(through_loop(p, (*seen, name)) for p in parents)

    for name in holders:
        assert through_loop(name), f"the all-gather in {name} runs outside the loop"


# --------------------------------------------------------------------- Data-Parallel


@pytest.mark.hlo
def test_data_parallel_sharded_all_reduces_gradients():
    params = toy_params(jr.key(10))
    mesh = distributed.replica_mesh(M)
    dp = sdiloco.data_parallel(
        toy_loss, inner=relaxed(optax.adamw(0.05)), num_replicas=M
    )
    batches = toy_batches(jr.key(11), steps=4, replicas=M)
    ref_state, state = dp.init(params), distributed.shard_state(dp.init(params), mesh)
    step = distributed.sharded_step(dp.step, mesh)
    compiled = step.lower(state, distributed.shard_batch(batches[0], mesh, M)).compile()
    ref_step = eqx.filter_jit(dp.step)
    for batch in batches:
        ref_state, _ = ref_step(ref_state, batch)
        state, _ = compiled(state, distributed.shard_batch(batch, mesh, M))
    assert_trees_allclose(_host(state), _host(ref_state), **TOL)
    reduced = {
        c.shape
        for c in distributed.collectives(compiled.as_text())
        if c.kind == "all-reduce" and c.dtype == "f32"
    }
    assert {x.shape for x in jax.tree.leaves(params)} <= reduced


# ------------------------------------------------------------------------ bad input


def test_bad_input():
    with pytest.raises(ValueError, match="num_replicas"):
        distributed.replica_mesh(3)
    mesh = distributed.replica_mesh(M)
    with pytest.raises(ValueError, match="replica_fields"):
        distributed.state_shardings((1, 2), mesh)
    with pytest.raises(ValueError, match="leading axis"):
        distributed.shard_batch({"x": np.zeros((2, 3))}, mesh, M)
    with pytest.raises(ValueError, match="do not fit"):
        distributed.unpack4(jnp.zeros((2,), jnp.uint8), 5)
    with pytest.raises(ValueError, match=r"data \(devices per replica\)=3"):
        distributed.replica_mesh(2, data=3)
    with pytest.raises(ValueError, match="multiple of the 4 replica-axis rows"):
        distributed.replica_mesh(2, data=1)
    with pytest.raises(ValueError, match="not a multiple of the 2 devices per replica"):
        distributed.shard_batch(
            {"x": np.zeros((2, 3))}, distributed.replica_mesh(2, data=2), 2
        )


def test_process_replicas_single_process():
    assert distributed.process_replicas(distributed.replica_mesh(M), M) == [0, 1, 2, 3]
    mesh = distributed.replica_mesh(8, jax.devices()[:2])
    assert distributed.process_replicas(mesh, 8) == list(range(8))


# ---------------------------------------------------------------- multiple processes


def test_free_port_is_bindable():
    port = free_port()
    assert 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))


@pytest.mark.multiprocess
def test_two_processes_equal_single_process(tmp_path):
    port = free_port()
    out = tmp_path / "params.npz"
    worker = str(ROOT / "tests" / "distributed_worker.py")
    start = time.monotonic()
    procs = start_processes(
        lambda i: [worker, f"127.0.0.1:{port}", "2", str(i), str(out)],
        2,
        cpu_env(1, str(ROOT), str(ROOT / "tests")),
        ROOT,
    )
    try:
        # The references, computed here while the two processes run.
        mesh = distributed.replica_mesh(2, jax.devices()[:2])
        sharded = distributed_worker._flat(distributed_worker.run_sharded(mesh))
        alg, params, batches = distributed_worker.problem()
        state = alg.init(params, jr.key(2))
        step = eqx.filter_jit(alg.step)
        for batch in batches:
            state, _ = step(state, batch)
        simulated = distributed_worker._flat(_host(state.global_params))
    finally:  # kills them past 180 s, and on an error above
        finish_processes(procs, timeout=max(1.0, 180 - (time.monotonic() - start)))
    got = dict(np.load(out))
    assert got.keys() == sharded.keys() == simulated.keys()
    for k in got:
        # Bitwise the single-process sharded run (one replica per device)...
        np.testing.assert_array_equal(got[k], sharded[k])
        # ...and, within float32 rounding, the vmapped single-device simulation.
        np.testing.assert_allclose(got[k], simulated[k], **TOL)
    assert not np.allclose(got["['v']"], np.asarray(params["v"]))


@pytest.mark.hlo
def test_collectives_name_the_mesh_axes_of_every_group_format():
    # The three ways XLA writes device groups, and collective-permute's pairs.
    mesh = distributed.replica_mesh(2, data=2)  # devices 0,1 | 2,3 (rows: replicas)
    lines = [
        (("replica",), "replica_groups={{0,2},{1,3}}"),
        (("data",), "replica_groups={{0,1},{2,3}}"),
        (("data",), "replica_groups=[2,2]<=[4]"),
        (("replica", "data"), "replica_groups={}"),
        (("replica",), "replica_groups=[2,2]<=[2,2]T(1,0)"),
    ]
    for axes, groups in lines:
        text = f"  %ag = f32[4]{{0}} all-gather(f32[2]{{0}} %x), {groups}, dimensions={{0}}"
        (c,) = distributed.collectives(text, mesh)
        assert c.axes == axes, (groups, c.axes)
    named = "  %ar = f32[4]{0} all-reduce(%x), replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_1'}"
    assert distributed.collectives(named, mesh)[0].axes == ("data",)
    permute = (
        "  %cp = f32[4]{0} collective-permute(%x), source_target_pairs={{0,2},{2,0}}"
    )
    assert distributed.collectives(permute, mesh)[0].axes == ("replica",)


def test_a_test_subprocess_compiles_with_the_suites_xla_flags(monkeypatch):
    # A subprocess a test compares with bitwise must compile as the test does: it gets
    # its own device count and every other XLA flag of the suite (conftest.py).
    monkeypatch.setenv(
        "XLA_FLAGS",
        "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0",
    )
    env = cpu_env(2, "repo", "tests")
    assert env["XLA_FLAGS"].split() == [
        "--xla_force_host_platform_device_count=2",
        "--xla_backend_optimization_level=0",
    ]
    assert env["JAX_PLATFORMS"] == "cpu"
    assert env["PYTHONPATH"].split(os.pathsep) == ["repo", "tests"]
