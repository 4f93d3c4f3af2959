"""Records tied to the code that made them: a numerics fingerprint, and retraining.

Every run record written by `experiments.run_one` carries `"code"`: the library
version, the git commit of the checkout (when there is one) and `fingerprint()`, a
hash of the final state of two fixed tiny runs (Streaming DiLoCo with overlapped FP4,
and Data-Parallel) trained by this code on this machine. Two pieces of code with the
same fingerprint compute the same numbers, bitwise, on the same machine type; a change
to the numerics (or a machine whose XLA rounds otherwise) changes it.

- A record whose fingerprint differs from this code's is *stale*: `run_one` still
  reads it (re-training everything on every change would cost days of CPU), but says
  so in its run log, and `python -m sdiloco.paper` prints how many records each
  notebook read stale and stores the count in `paper_figures/runtimes.json`.
- `verify(k)` retrains k records made with this code's fingerprint and compares their
  evaluations bitwise (`python -m sdiloco.paper --verify K`; CI runs it on a sample).

Determinism, measured: same code, config, seed and machine type give bitwise equal
runs (`verify`). Runs one float32 ulp apart drift apart like any chaotic system; how
far is measured in `docs/decisions.md` so that a reader knows which differences are
noise.
"""

import functools
import hashlib
import json
import os
import pathlib
import random
from typing import Any

import equinox as eqx
import jax
import numpy as np

from .. import __version__
from ..lab import train
from ..lab.config import RunConfig, preset
from .plotting import git_commit


FINGERPRINT_ENV = "SDILOCO_FINGERPRINT"
"""Environment variable: this code's fingerprint, computed once by `python -m
sdiloco.paper` and read by the notebooks it executes."""


def _probes() -> list[RunConfig]:
    """The fixed tiny runs whose final state is the fingerprint."""
    common: dict[str, Any] = {
        "model": "tiny-xxxs",
        "eval_every": 6,
        "eval_windows": 16,
        "log_every": 3,
        "data": {"global_batch_size": 4},
        "inner": {"warmup_steps": 2},
    }
    return [
        preset("streaming_overlap_fp4", tuned=False, steps=6, sync_every=2, **common),
        preset("data_parallel", tuned=False, steps=4, **common),
    ]


@functools.cache
def fingerprint() -> str:
    """This code's numerics on this machine: 16 hex digits of a sha256 over the final
    parameters (θ_g and every replica's) and the evaluations of `_probes()`
    (`$SDILOCO_FINGERPRINT` if set). Only numbers count: a new field of the state
    that changes no parameter leaves it unchanged."""
    if os.environ.get(FINGERPRINT_ENV):
        return os.environ[FINGERPRINT_ENV]
    h = hashlib.sha256()
    for config in _probes():
        with jax.numpy_dtype_promotion("standard"):
            history = train.run(config, progress=False)
        state = history.state
        params = (state.global_params, getattr(state, "replica_params", None))
        for leaf in jax.tree.leaves(eqx.filter(params, eqx.is_array)):
            h.update(np.asarray(leaf).tobytes())
        h.update(json.dumps(history.evals, sort_keys=True).encode())
    return h.hexdigest()[:16]


def code() -> dict[str, str]:
    """What a record stores of the code that made it."""
    return {
        "version": __version__,
        "commit": git_commit(),
        "fingerprint": fingerprint(),
    }


def is_current(record: dict) -> bool:
    """Whether a record was made by code with this code's fingerprint."""
    return record.get("code", {}).get("fingerprint") == fingerprint()


OTHER_MACHINE_RTOL = 0.01
"""How far a record made on another machine type (another fingerprint) may differ
when retrained here: three times the largest drift measured between two runs one
rounding apart (0.3 %, docs/decisions.md)."""


def verify(records: pathlib.Path, k: int, seed: int = 0) -> list[dict[str, Any]]:
    """Retrain up to `k` fingerprinted records and compare them with what they hold.

    The sample favours short runs: `k` drawn (with `seed`) from the fingerprinted
    records with the fewest steps × parameters (the 4k cheapest), so that CI can
    afford it. A record made by code with this fingerprint must match bitwise; one
    made with another fingerprint (another machine type, or other numerics) within
    `OTHER_MACHINE_RTOL` of each held-out loss.

    Returns:
        One row per record retrained: its key, whether its fingerprint is this
        code's, whether its evaluations matched exactly, the largest relative
        difference of a held-out loss, and whether it `passed`.
    """
    candidates = []
    for path in sorted(records.glob("*.json")):
        d = json.loads(path.read_text())
        if d.get("code", {}).get("fingerprint"):
            config = RunConfig.from_json(json.dumps(d["config"]))
            cost = config.steps * train.build(config).model_config.num_params()
            candidates.append((cost, path.stem, config, d))
    candidates.sort(key=lambda x: x[0])
    pool = candidates[: 4 * k]
    chosen = random.Random(seed).sample(pool, min(k, len(pool)))
    rows = []
    for _, key, config, d in chosen:
        with jax.numpy_dtype_promotion("standard"):
            evals = train.run(config, progress=False).evals
        gaps = [
            abs(a[m] - b[m]) / abs(b[m])
            for a, b in zip(evals, d["evals"])
            for m in a
            if m.startswith("eval/")
        ]
        gap = max(gaps, default=float("inf"))
        same = is_current(d)
        equal = evals == d["evals"]
        rows.append(
            {
                "key": key,
                "same_fingerprint": same,
                "equal": equal,
                "max_rel_gap": gap,
                "passed": equal if same else gap <= OTHER_MACHINE_RTOL,
            }
        )
    return rows
