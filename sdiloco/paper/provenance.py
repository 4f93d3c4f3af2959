"""Records tied to the code and the machine that made them, and checking them.

Every run record written by `experiments.run_one` carries `"code"` (`code()`):

- `version`, `commit` (with "+dirty" when the checkout has changes) and `source`, a
  hash of every file of the package as imported, so an uncommitted change shows;
- `fingerprint` and `probes`, the numerics (below);
- `machine`: the CPU model, the instruction-set extensions XLA can use, the core
  count, the jax and jaxlib versions and `XLA_FLAGS` (`machine()`).

**The numerics fingerprint.** `probes()` trains or applies a few fixed tiny programs and
hashes what they compute (`PROBES`): Streaming DiLoCo with overlapped FP4, Data-Parallel,
DiLoCo with M = 4 and one replica absent for three steps then healed, MuLoCo (Muon
inside, 2-bit outer gradients with error feedback), Eager's merge, every
compressor format and stage on one fixed array, and every aggregator on fixed rows
with a replica absent. `fingerprint()` is the hash of the
first two, kept as it was computed before the other probes existed, so that every
record made since compares. Two pieces of code with equal probes compute the same
numbers, bitwise, on the same machine type; a change of numerics, of instruction set
(`XLA_FLAGS=--xla_cpu_max_isa=AVX2` changes it) or of machine type changes them.

- A record whose fingerprint differs from this code's is *stale*: `run_one` still reads
  it (re-training everything on every change would cost days of CPU), says so in its
  run log, and `python -m sdiloco.paper` prints per notebook how many of its records
  are current.
- `verify` retrains a sample of current records, one per notebook, with a seed that
  rotates with the commit, and compares them bitwise; a machine with no current
  headline record re-trains a headline cell instead and checks the seed-paired gap
  against the published interval (`verify_cell`).

Determinism, measured: same code, config, seed and machine type give bitwise equal
runs. Runs one float32 ulp apart drift apart like any chaotic system; how far is
measured in `docs/decisions.md` so that a reader knows which differences are noise.
"""

import functools
import hashlib
import json
import os
import pathlib
import platform
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from .. import __version__, aggregation, compression
from ..inflight import Group, Visit
from ..lab import objects, train
from ..lab.config import RunConfig, preset
from ..plugins import Send
from ..sim.chaos import Failures
from .plotting import git_commit


FINGERPRINT_ENV = "SDILOCO_FINGERPRINT"
"""Environment variable: this code's numerics (`{"fingerprint": ..., "probes": ...}` as
JSON), measured once by `python -m sdiloco.paper` and read by the notebooks it runs."""

PROBES: tuple[str, ...] = ("streaming_fp4", "data_parallel", "diloco_m4_absent")
PROBES += ("muloco", "eager", "compressors", "aggregators")
"""The probes, in the order they are hashed; the first two make `fingerprint()`."""

ISA_FLAGS: tuple[str, ...] = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)
"""The x86 extensions that decide which code XLA's CPU backend may generate."""

STAMP: tuple[str, ...] = ("version", "commit", "source", "fingerprint", "probes")
STAMP += ("machine",)
"""The fields of a fully stamped record's `code`."""


def _lab_probes() -> dict[str, RunConfig]:
    """The fixed tiny runs among the probes (tiny-xxxs, a few steps each)."""
    common: dict[str, Any] = {
        "model": "tiny-xxxs",
        "eval_every": 6,
        "eval_windows": 16,
        "log_every": 3,
        "data": {"global_batch_size": 4},
        "inner": {"warmup_steps": 2},
    }
    # Seed 6 of this trace: replica 2 is absent at steps 3-5 and heals at step 6.
    absent = Failures(failures=0.5, repair=0.25, seed=6)
    return {
        "streaming_fp4": preset(
            "streaming_overlap_fp4", tuned=False, steps=6, sync_every=2, **common
        ),
        "data_parallel": preset("data_parallel", tuned=False, steps=4, **common),
        # Muon inside with 2-bit error-feedback outer gradients; the Eager merge.
        # Added later: a record made before carries neither, and is still current.
        "muloco": preset("muloco", tuned=False, steps=6, sync_every=2, **common),
        "eager": preset("eager", tuned=False, steps=6, sync_every=2, **common),
        "diloco_m4_absent": preset(
            "diloco",
            tuned=False,
            steps=8,
            sync_every=2,
            failures=absent,
            **{
                **common,
                "method": {"num_replicas": 4},
                "data": {"global_batch_size": 8},
            },
        ),
    }


COMPRESSOR_SPECS: tuple[str, ...] = tuple(
    f"{f}:{g}" for f in compression.FORMATS for g in ("tensor", "row")
) + ("e3m0:row:sr", "int8mm", "int2mm:block64", "topk:0.1", "topk:0.05/32,int2")
COMPRESSOR_SPECS += ("dare:0.5", "dropout:0.5", "int2:row,ef:0.9")
"""Every format at both scale granularities, stochastic rounding, min-max, top-k,
chunked top-k chained with 2-bit, DARE, FedDropout and error feedback."""


def _compressor_probe(h: Any) -> None:
    """Each spec of `COMPRESSOR_SPECS` applied to one fixed array and key, into `h`
    (with error feedback: its accumulated input, what is sent and the residual)."""
    x = jr.normal(jr.key(0), (8, 96)) * jnp.logspace(-3, 1, 96)[None, :]
    key = jr.key(1)

    whole = Group((0,), (0,), (None,), (x.shape[1:],))  # one leaf, one fragment
    send = Send(Visit(whole, jnp.int32(0), (None,)), None, [], lambda g: g)

    def apply(codec, feedback, x, key):
        if feedback is None:
            sent = codec(x, key)
            return sent, sent
        (delta,), state = feedback.before_send(send, [x], [0.5 * x[::-1]])
        sent = codec(delta, key)
        _, (residual,) = feedback.after_send(send, [delta], [sent], [], state)
        return sent, residual

    stages = [compression.parse_with_feedback(spec) for spec in COMPRESSOR_SPECS]
    outs = jax.jit(lambda x, key: [apply(c, f, x, key) for c, f in stages])(x, key)
    for spec, out in zip(COMPRESSOR_SPECS, outs):
        h.update(spec.encode())
        for leaf in out:
            h.update(np.asarray(leaf).tobytes())


def _aggregator_probe(h: Any) -> None:
    """Each aggregator of `aggregation` on fixed rows of 5 replicas, one of which
    does not send and one of which is 10x the others, into `h`."""
    rows = [jr.normal(jr.key(2), (5, 7, 3)), jr.normal(jr.key(3), (5, 11))]
    rows = [r.at[4].multiply(10.0) for r in rows]
    sent = jnp.asarray([True, False, True, True, True])
    rows = [jnp.where(sent.reshape((-1,) + (1,) * (r.ndim - 1)), r, 0) for r in rows]
    steps = jnp.asarray([3, 0, 5, 1, 2], jnp.int32)
    everyone = (
        aggregation.mean(),
        aggregation.token_weighted_mean(),
        aggregation.trimmed_mean(0.25),
        aggregation.median(),
        aggregation.clipped_mean(),
        aggregation.clipped_mean(1.0),
    )
    outs = jax.jit(lambda rows: [a(rows, sent, steps) for a in everyone])(rows)
    for a, out in zip(everyone, outs):
        h.update(repr(a).encode())
        for leaf in out:
            h.update(np.asarray(leaf).tobytes())


@functools.cache
def _measure() -> tuple[str, dict[str, str]]:
    """(fingerprint, probes) of this code on this machine, or from the environment."""
    if os.environ.get(FINGERPRINT_ENV):
        value = os.environ[FINGERPRINT_ENV]
        if not value.startswith("{"):  # a bare fingerprint (no probes)
            return value, {}
        d = json.loads(value)
        return d["fingerprint"], d["probes"]
    legacy = hashlib.sha256()  # the first two probes, hashed as one stream
    probes = {}
    for name, config in _lab_probes().items():
        h = hashlib.sha256()
        with jax.numpy_dtype_promotion("standard"):
            history = train.run(config, progress=False)
        state = history.state
        params = (state.global_params, getattr(state, "replica_params", None))
        parts = [
            np.asarray(x).tobytes()
            for x in jax.tree.leaves(eqx.filter(params, eqx.is_array))
        ]
        parts.append(json.dumps(history.evals, sort_keys=True).encode())
        for part in parts:
            h.update(part)
            if name in PROBES[:2]:
                legacy.update(part)
        probes[name] = h.hexdigest()[:16]
    h = hashlib.sha256()
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("raise"):
        _compressor_probe(h)
    probes["compressors"] = h.hexdigest()[:16]
    h = hashlib.sha256()
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("raise"):
        _aggregator_probe(h)
    probes["aggregators"] = h.hexdigest()[:16]
    return legacy.hexdigest()[:16], probes


def fingerprint() -> str:
    """This code's numerics on this machine, as every record made since records carry
    it: 16 hex digits of a sha256 over the final parameters (θ_g and every replica's)
    and evaluations of the first two probes. Only numbers count: a new field of the
    state that changes no parameter leaves it unchanged."""
    return _measure()[0]


def probes() -> dict[str, str]:
    """16 hex digits per probe (`PROBES`): which part of the numerics differs."""
    return dict(_measure()[1])


def environment_value() -> str:
    """What `FINGERPRINT_ENV` is set to for a child process (measured once here)."""
    return json.dumps({"fingerprint": fingerprint(), "probes": probes()})


@functools.cache
def source() -> str:
    """16 hex digits of a sha256 over every file of the package as imported (its
    relative path and bytes), so an uncommitted change counts."""
    root = pathlib.Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            h.update(str(path.relative_to(root)).encode() + b"\0")
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


@functools.cache
def machine() -> dict[str, Any]:
    """Where a record is made: CPU model, ISA extensions, cores, jax, jaxlib, XLA flags."""
    from jaxlib import version as jaxlib_version

    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "model name":
                model = value.strip()
            elif name.strip() == "flags":
                flags = set(value.split())
            if model and flags:
                break
    except OSError:
        pass
    return {
        "cpu": model,
        "isa": [f for f in ISA_FLAGS if f in flags],
        "cpus": os.cpu_count(),
        "jax": jax.__version__,
        "jaxlib": jaxlib_version.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def code() -> dict[str, Any]:
    """What a record stores of the code and machine that made it (`STAMP`)."""
    return {
        "version": __version__,
        "commit": git_commit(),
        "source": source(),
        "fingerprint": fingerprint(),
        "probes": probes(),
        "machine": machine(),
    }


def is_current(record: Mapping[str, Any]) -> bool:
    """Whether a record was made by code with this code's numerics on this machine
    type: its fingerprint is this one and so is every probe it carries. A record
    whose config holds a user's object (`lab.objects`) cannot be re-created, so it
    is never current."""
    if not objects.recreatable(record.get("config", {})):
        return False
    c = record.get("code", {})
    if not c.get("fingerprint") or c["fingerprint"] != fingerprint():
        return False
    mine = probes()
    return all(mine.get(k, v) == v for k, v in c.get("probes", {}).items())


def is_stamped(record: Mapping[str, Any]) -> bool:
    """Whether a record carries every field of `STAMP`."""
    return all(record.get("code", {}).get(k) for k in STAMP)
