"""The machine-independent parts of `benchmarks/`: compile count, bits, state bytes,
what the sync-heavy benchmark times, and reading several processes' output."""

import importlib
import pathlib
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import sdiloco
from sdiloco.compression import formats


_ROOT = str(pathlib.Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:  # `benchmarks` is a package at the repository root
    sys.path.insert(0, _ROOT)
bits = importlib.import_module("benchmarks.bits")
compile_count = importlib.import_module("benchmarks.compile_count")
memory = importlib.import_module("benchmarks.memory")
step_throughput = importlib.import_module("benchmarks.step_throughput")
_common = importlib.import_module("benchmarks._common")
compare_versions = importlib.import_module("benchmarks.compare_versions")
sync_heavy = importlib.import_module("benchmarks.sync_heavy")


H = 4


@pytest.fixture(autouse=True)
def standard_promotion():
    """optax's AdamW (`b1 ** count`) is not clean under strict dtype promotion."""
    with jax.numpy_dtype_promotion("standard"):
        yield


@pytest.mark.integration
def test_streaming_step_compiles_once_and_metrics_match_the_accounting():
    steps = 3 * H  # >= 2H, and every fragment is sent and arrives at least twice
    config = _common.run_config(
        "streaming_overlap_fp4", model="tiny-xs", sync_every=H, global_batch=4
    )
    out = compile_count.count_compiles(config, steps)
    assert out["traces"] == 1
    assert sum(out["compiles"].values()) == 1, out["compiles"]
    assert min(out["sends"]) >= 2 and min(out["applied"]) >= 2
    assert np.min(out["merges"]) >= 2
    # The step's metrics are the exact accounting of bits_per_fragment × schedule.
    alg_bits = bits.bits_per_fragment(config)
    expected = bits.accounting(alg_bits, bits.sent_matrix(config, len(alg_bits), steps))
    assert bits.accounting(alg_bits, out["sent"])["per_step"] == expected["per_step"]
    assert out["bits"] == [float(b) for b in expected["per_step"]]


@pytest.mark.integration
def test_bits_of_the_paper_1b_run():
    steps, n = 24_300, 1_273_598_976  # Table 1 (25B tokens); PAPER_SCALES["1B"]
    rows = bits.table("1B", sync_every=100, steps=steps)
    dp = rows["Data-Parallel (bf16 gradients)"]
    diloco = rows["DiLoCo (fp32)"]
    fp32 = rows["Streaming DiLoCo (fp32, no overlap)"]
    fp4 = rows["Streaming DiLoCo, overlapped FP4"]
    assert dp["num_params"] == n
    assert dp["total"] == 16 * n * steps and dp["peak"] == 16 * n
    assert diloco["total"] == 32 * n * (steps // 100) and diloco["peak"] == 32 * n
    # Fragment p is sent at f_p + kH <= T, f_p = 100 + round(100 p / 9).
    first = [100 + (200 * p + 9) // 18 for p in range(9)]
    assert fp4["sends"] == sum((steps - f) // 100 + 1 for f in first)
    # A block fragment: 4 bits per element and one float32 scale per layer and leaf.
    leaves_per_layer = bits.abstract("1B", lambda m: len(jax.tree.leaves(m.blocks)))
    assert fp4["bits_per_fragment"][1] == 4 * fp4["max_fragment"] + 32 * 3 * (
        leaves_per_layer
    )
    r = bits.ratios(rows)
    # ~400x fewer bits than Data-Parallel (Table 1: 441 TB / 1.10 TB = 400.9).
    assert r["Streaming DiLoCo, overlapped FP4/total"] == pytest.approx(400, rel=0.01)
    assert 399.9 < r["Streaming DiLoCo, overlapped FP4/period"] <= 400
    # Peak ÷ L/|p| = 8 against DiLoCo at the same precision (the embedding is its
    # own, smaller fragment, so N/|p_max| is slightly above 8); ×8 more with FP4.
    peak = r["Streaming DiLoCo (fp32, no overlap)/peak_vs_diloco"]
    assert peak == pytest.approx(n / fp32["max_fragment"]) and 8 <= peak < 8.5
    assert r["Streaming DiLoCo, overlapped FP4/peak_vs_diloco"] == pytest.approx(
        8 * peak, rel=1e-4
    )


@pytest.mark.integration
def test_state_bytes_match_the_analytic_count():
    for preset in ("streaming_overlap_fp4", "data_parallel"):
        config = _common.run_config(preset, model="tiny-xs")
        run = _common.build(config)
        state = run.init_state()
        parts = memory.measured(state)
        p = len(run.algorithm.bits_per_fragment(run.model))
        method = "data_parallel" if preset == "data_parallel" else "streaming"
        n = bits.num_params(run.model)
        slot = None
        if method == "streaming":  # one slot of the largest fragment
            frags = config.method.fragments(run.model)
            assert state.inflight.shape == (1, max(frags.sizes()))
            largest = slot = int(max(frags.sizes()))
        expected = memory.analytic(
            n, method, replicas=2, num_fragments=p, inflight_values=slot
        )
        assert parts == expected
    fields = sdiloco.StreamingState.replica_fields
    analytic = memory.analytic(n, "streaming", replicas=2, inflight_values=largest)
    streaming = memory.per_replica(analytic, fields, 2)
    dp = memory.per_replica(memory.analytic(n, "data_parallel", replicas=2), (), 2)
    # Paper §2.5: 5/3 of Data-Parallel; ours adds one slot of the largest fragment.
    assert (streaming - 4 * largest) / dp == pytest.approx(5 / 3, rel=1e-4)
    assert streaming / dp < 2


@pytest.mark.parametrize("format", ["e3m0", "e2m1", "int4", "e4m3"])
def test_rounding_by_search_gives_the_library_codes(format):
    scales = jnp.logspace(-6, 2, 300, dtype=jnp.float32)[None]
    x = jr.normal(jr.key(0), (4, 300)) * scales
    q = sdiloco.quantizer(format, granularity="row")
    mags = formats.magnitudes(format)
    mids = (mags[1:] + mags[:-1]) / 2
    # Row 1's amax is the top value, so its midpoints are exact ties; row 0 is not
    # finite.
    ties = jnp.asarray([mags[-1], 0.0, *mids, *-mids], jnp.float32)
    x = x.at[1, : ties.size].set(ties).at[1, ties.size :].set(0.0)
    x = x.at[0, :4].set(jnp.asarray([0.0, jnp.nan, jnp.inf, -jnp.inf]))
    expected = jax.jit(q.quantize)(x)
    patched = jax.jit(step_throughput.with_search_rounding(lambda x, _: q.quantize(x)))(
        x, None
    )
    assert np.array_equal(expected.codes, patched.codes)
    assert np.array_equal(expected.scale, patched.scale, equal_nan=True)


def test_compare_versions_loads_a_copy_of_the_package_under_its_own_name(tmp_path):
    """Two versions in one process: the copy is a module of its own (its submodules
    too), not the installed `sdiloco`; a directory without the package is refused."""
    copy = compare_versions.load(str(pathlib.Path(sdiloco.__file__).parent), "sdl_copy")
    assert copy is not sdiloco and copy.__name__ == "sdl_copy"
    assert copy.streaming_diloco is not sdiloco.streaming_diloco
    assert sys.modules["sdl_copy.streaming"].__name__ == "sdl_copy.streaming"
    with pytest.raises(SystemExit, match="not a copy of the sdiloco package"):
        compare_versions.load(str(tmp_path), "sdl_missing")


def _python(code: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True
    )


def test_communicate_all_reads_every_pipe_at_once(tmp_path):
    """B writes 256 KiB, then leaves a file that A waits for (as an island that
    stays to serve heals waits for the others to finish). Read A alone and B blocks
    in its write once its pipe is full: A never ends. Read both at once: both end."""
    flag = str(tmp_path / "b-wrote")
    a = _python(
        f"import os, time\nwhile not os.path.exists({flag!r}): time.sleep(0.01)\n"
        "print('a')"
    )
    b = _python(
        f"import pathlib, sys\nsys.stdout.write('x' * (256 << 10))\nsys.stdout.flush()"
        f"\npathlib.Path({flag!r}).touch()"
    )
    with pytest.raises(subprocess.TimeoutExpired):
        a.communicate(timeout=3)  # the hang of reading one after the other
    outputs = _common.communicate_all([a, b], timeout=60)
    assert [out for out, _ in outputs] == ["a\n", "x" * (256 << 10)]
    assert a.returncode == b.returncode == 0


def test_communicate_all_kills_what_outlives_the_timeout():
    slow, quick = _python("import time; time.sleep(60)"), _python("print('done')")
    start = time.monotonic()
    outputs = _common.communicate_all([slow, quick], timeout=2)
    assert time.monotonic() - start < 20
    assert slow.returncode == -signal.SIGKILL and quick.returncode == 0
    assert outputs[1][0] == "done\n"


@pytest.mark.integration
def test_sync_heavy_bare_program_syncs_where_the_streaming_program_does():
    """`bare_program` sends and receives each fragment at the steps where the float32
    Streaming program does (read off that program's own metrics over three periods),
    and its arithmetic is the float32 send and arrival: checked in float64 NumPy."""
    params, inner, frags, period = sync_heavy.workload(layers=4, dim=16, batch=2)
    step, state = sync_heavy.streaming_program(params, inner, frags, None)
    h = sync_heavy.H
    when = sync_heavy.bare_schedule(frags.num_fragments)
    assert when.overlap == (1,) * sync_heavy.M  # `bare_step` receives at t - 1's sends
    for t in range(1, 3 * h + 1):
        state, metrics = step(state, period[(t - 1) % h])
        np.testing.assert_array_equal(when.sent(t), np.asarray(metrics["sync/sent"]))
        np.testing.assert_array_equal(
            when.sent(t - 1), np.asarray(metrics["sync/applied"])
        )

    send, arrive, outer = sync_heavy.bare_sync(2, None)
    rng = np.random.default_rng(0)
    g, r, mom = rng.normal(size=5), rng.normal(size=(2, 5)), rng.normal(size=5)
    mean, finite = send(jnp.asarray(g, jnp.float32), jnp.asarray(r, jnp.float32))
    np.testing.assert_allclose(mean, (g - r).mean(0), rtol=1e-6, atol=1e-6)
    assert bool(finite)
    r_bad = r.copy()
    r_bad[1, 3] = np.inf
    assert not bool(send(jnp.asarray(g, jnp.float32), jnp.asarray(r_bad))[1])
    state = outer.init(jnp.asarray(g, jnp.float32))
    state = (state[0]._replace(trace=jnp.asarray(mom, jnp.float32)),) + state[1:]
    new_g, _, new_r = arrive(
        jnp.asarray(g, jnp.float32),
        state,
        jnp.asarray(mean),
        jnp.asarray(r, jnp.float32),
    )
    d = np.asarray(mean, np.float64)
    mom_new = 0.9 * mom + d  # optax's Nesterov SGD: update = -lr (d + 0.9 mom_new)
    g_new = g - 0.4 * (d + 0.9 * mom_new)
    np.testing.assert_allclose(new_g, g_new, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new_r, 0.5 * r + 0.5 * g_new, rtol=1e-5, atol=1e-6)


def test_sync_heavy_traffic_reads_xla_bytes_against_closed_form_floors():
    """`traffic` reads XLA's bytes accessed in units of N: a plain AdamW step of M
    replicas moves at least what the update alone must (each replica reads its
    parameters, gradient and two moments and writes three: 7 N), and the compiled
    bare syncs at least the least a sync can move ((M + 2) + (2M + 5) N a period)."""
    a = jnp.ones(1000)  # an elementwise add reads two arrays and writes one
    assert sync_heavy.bytes_accessed(jax.jit(lambda x, y: x + y), a, a) == 3 * 4000
    params, inner, frags, period = sync_heavy.workload(layers=4, dim=16, batch=2)
    moved = sync_heavy.traffic(params, inner, frags, period[0])
    leaves = jax.tree.leaves(params)
    assert moved["N"] == 4 * sum(x.size for x in leaves)
    step, state = sync_heavy.plain_program(params, inner, sync_heavy.M)
    plain = sync_heavy.bytes_accessed(step, state, period[0])
    assert moved["plain"] == pytest.approx(plain / moved["N"])
    assert moved["plain"] >= 7 * sync_heavy.M
    assert moved["least"] == (sync_heavy.M + 2) + (2 * sync_heavy.M + 5)
    assert moved["bare"] >= moved["least"]
    assert 0.9 < moved["bound_bare"] <= moved["bound_least"] < 1
