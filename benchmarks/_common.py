"""Helpers shared by the benchmark scripts (and the tests' multi-process jobs): the
machine, configs, batches, timing, and reading the output of several processes."""

import concurrent.futures
import os
import platform
import subprocess
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import sdiloco
from sdiloco.inner import inner_steps


def machine() -> str:
    """One line naming the machine: CPU model, cores, load average, JAX backend."""
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    device = jax.devices()[0]
    return (
        f"{cpu}, nproc={os.cpu_count()}, load average (1/5/15 min) {load}; "
        f"jax {jax.__version__} on {device.platform} ({device.device_kind})"
    )


def load() -> str:
    """The load average now (1/5/15 minutes)."""
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def run_config(
    preset: str,
    *,
    model: str = "tiny-s",
    replicas: int = 2,
    sync_every: int = 100,
    global_batch: int = 16,
    steps: int = 1000,
    **method: Any,
) -> Any:
    """A preset's `RunConfig` with the knobs the benchmarks vary."""
    from sdiloco.lab import config as config_lib  # the lab extra, only where used

    method = {"num_replicas": replicas, **method}
    if preset != "data_parallel":
        method["sync_every"] = sync_every
    return config_lib.preset(
        preset,
        model=model,
        method=method,
        data={"global_batch_size": global_batch},
        steps=steps,
    )


def build(config: Any) -> Any:
    """`sdiloco.lab.train.build`, under the standard dtype promotion optax's Adam needs."""
    from sdiloco.lab import train

    with jax.numpy_dtype_promotion("standard"):
        return train.build(config)


def fresh(tree: Any) -> Any:
    """A copy of every array of `tree`, so donating it cannot delete the model's arrays.

    `alg.init(model)` keeps the model's own arrays as θ_g; a donated state would delete
    them.
    """
    return jax.tree.map(
        lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, tree
    )


def inner_only(inner: Any) -> Callable[[Any, Any], tuple[Any, dict]]:
    """A step of `sdiloco.inner.inner_steps` alone: Streaming with no sync machinery."""
    from sdiloco.lab import model as model_lib

    def step(state, b):
        replicas, inner_state, losses, _ = inner_steps(
            model_lib.loss_with_aux,
            inner,
            state.replica_params,
            state.inner_state,
            b,
        )
        state = state._replace(replica_params=replicas, inner_state=inner_state)
        return state, {"loss/train": jnp.mean(losses)}

    return step


def random_batches(
    num: int, replicas: int, global_batch: int, seq_len: int, *, seed: int = 0
) -> list[dict[str, jax.Array]]:
    """`num` batches of uniform byte tokens `[M, B/M, L]`, already on the device.

    Random tokens cost the same FLOPs as text; the data pipeline is not what is timed.
    """
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num):
        w = rng.integers(0, 256, (global_batch, seq_len + 1), dtype=np.int32)
        shape = (replicas, global_batch // replicas, seq_len)
        out.append(
            {
                "inputs": jnp.asarray(w[:, :-1].reshape(shape)),
                "targets": jnp.asarray(w[:, 1:].reshape(shape)),
            }
        )
    return out


def jit_step(step: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """`step(state, batch)` jitted once with the state donated, as `sdiloco.jit_step`
    runs it, under the standard dtype promotion optax's Adam needs."""
    f = sdiloco.jit_step(step)

    def run(state, batch):
        with jax.numpy_dtype_promotion("standard"):
            return f(state, batch)

    return run


def timed(f: Callable[[], Any]) -> tuple[Any, float, float]:
    """`(f(), wall seconds, process CPU seconds)`, blocking until the result is ready."""
    w0, c0 = time.perf_counter(), time.process_time()
    out = jax.block_until_ready(f())
    return out, time.perf_counter() - w0, time.process_time() - c0


def xla_flags(devices: int) -> str:
    """`XLA_FLAGS` for a CPU subprocess: `devices` host devices and the environment's
    other XLA flags (none for a published figure; the suite's under pytest)."""
    count = "--xla_force_host_platform_device_count"
    others = [f for f in os.environ.get("XLA_FLAGS", "").split() if count not in f]
    return " ".join([f"{count}={devices}", *others])


def communicate_all(
    procs: list[subprocess.Popen], timeout: float
) -> list[tuple[Any, Any]]:
    """Every process's `communicate()` (stdout, stderr), read at once, one thread per
    process; one still running `timeout` seconds from now is killed (its output up
    to then is returned).

    Reading the processes one after the other can hang a job: a process whose pipe
    nobody reads blocks in its next write once the pipe holds 64 KiB (a progress bar
    writes that in about a minute), and if the process being read waits for it (an
    island that stays to serve heals until every island is done), neither moves
    until a timeout ends one of them."""
    deadline = time.monotonic() + timeout

    def finish(p: subprocess.Popen) -> tuple[Any, Any]:
        try:
            return p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            return p.communicate()

    if not procs:
        return []
    with concurrent.futures.ThreadPoolExecutor(len(procs)) as pool:
        return list(pool.map(finish, procs))
