"""The elastic job on Ray: one actor per replica island, one syncer, one command.

`python -m sdiloco train --elastic --replicas M ... --out DIR` runs the whole job:
it starts a local Ray instance (dashboard off, token authentication on, the object
store sized to the job), or joins an existing cluster with `--address`, and makes

- the **syncer** (`distributed.syncer.Syncer`), an actor that carries control only:
  who takes part in each round, who heals from whom, who may join;
- one **island** actor per replica (`Island`), placed one per node where the
  cluster has several (`SPREAD`). Each runs today's program, `train.run(config,
  out/island-m, transport=RayTransport(...))`: the same loop, checkpoints and
  history, training replica m alone, its messages and heals moved through Ray's
  object store (`distributed.ray_transport`).

Failures. Ray restarts a killed island (up to `max_restarts`); the restarted actor
resumes its checkpoint, then heals from a live peer and rejoins at its next send.
A stopped island is left out of a round at the syncer's grace deadline. A lost
syncer (or Ray head) ends every island with one line each; their checkpoints stay,
and the same command resumes the whole job from them: the islands at the newest
checkpoint restore it, the others heal from them.

At the end each island writes `out/island-<m>.json` (its summary) and
`out/island-<m>.eqx` (θ_g); `out/island-<m>.step` says how far it is,
`out/island-<m>.pid` which process it is, and `out/syncer.json` holds the rounds'
decisions.
"""

import dataclasses
import hashlib
import json
import math
import os
import time
from typing import Any

import equinox as eqx
import jax
import numpy as np

from .config import RunConfig


AGREED_EXCEPT = (
    "name",
    "eval_every",
    "eval_windows",
    "eval_params",
    "log_every",
    "checkpoint_every",
    "keep_checkpoints",
)
"""The config fields an island may set for itself; every other field (model, seed,
optimizers, method, data, steps) must be the job's."""


EVAL_AT_END = True
"""Islands score θ_g on the held-out set at the end only: an evaluation inside the
loop holds up every peer's next round while it runs."""


@dataclasses.dataclass(frozen=True)
class ElasticOptions:
    """Where the job runs and how long anything waits.

    Attributes:
        address: an existing Ray cluster (`ray.init(address=...)`), or None: a
            local instance for this job alone.
        grace_s: how long a round waits, after its first message, for an expected
            island (a dead or stopped island stalls the others this long, once).
        timeout_s: the longest any island waits on the syncer or a peer.
        heartbeat_s: an island silent this long is not chosen to serve a heal.
        start_s: how long the first round waits for every island's hello.
        max_restarts: how often Ray restarts each island's actor.
        object_store_bytes: the local instance's object store (None: sized from
            the model and M, `object_store_size`).
    """

    address: str | None = None
    grace_s: float = 5.0
    timeout_s: float = 120.0
    heartbeat_s: float = 10.0
    start_s: float = 300.0
    max_restarts: int = 3
    object_store_bytes: int | None = None

    def __post_init__(self):
        for name in ("grace_s", "timeout_s", "heartbeat_s", "start_s"):
            value = getattr(self, name)
            if not 0 < value < math.inf:
                raise ValueError(f"{name}={value}; allowed: 0 < seconds < inf.")
        if self.timeout_s <= self.grace_s:
            raise ValueError(
                f"timeout_s={self.timeout_s} <= grace_s={self.grace_s}; allowed: a "
                "timeout longer than the grace window."
            )
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts={self.max_restarts}; allowed: >= 0.")

    @property
    def keep_s(self) -> float:
        """How long a decided round's messages stay at most (for an island that
        reads it late): at least 60 s, 4 grace windows, and the heartbeat and a
        grace window more."""
        return max(60.0, 4 * self.grace_s, self.heartbeat_s + self.grace_s)


def fingerprint(config: RunConfig) -> dict[str, str]:
    """Every config field the islands must agree on (all but `AGREED_EXCEPT`),
    flattened to `{"method.sync_every": "6", ...}`."""
    flat: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            flat[prefix] = json.dumps(value, sort_keys=True)

    walk("", json.loads(config.to_json()))
    return {k: v for k, v in flat.items() if k.split(".")[0] not in AGREED_EXCEPT}


def object_store_size(config: RunConfig) -> int:
    """Bytes of object store a local job needs: every island's state (a heal in
    flight) and messages of a few rounds, 16 float32 copies of the model per
    island, and at least Ray's 78 MB minimum; Ray spills to disk beyond it."""
    params = config.model_config().num_params()
    islands = config.method.num_replicas
    return max(128 << 20, 16 * 4 * params * (islands + 1))


def check_min_step_s(min_step_s: float) -> None:
    """Raise `ValueError` unless `min_step_s` (an island's shortest step) is a finite
    number of seconds >= 0."""
    if not 0 <= min_step_s < math.inf:
        raise ValueError(f"min_step_s={min_step_s}; allowed: 0 <= S < inf seconds.")


# ----------------------------------------------------------------- the islands


class Island:
    """One replica island: the actor's class (`ray.remote(Island)`, threaded:
    `message` answers while `run` trains)."""

    def __init__(self):
        self.outbox: dict[str, np.ndarray] = {}

    def message(self, name: str) -> tuple[bool, np.ndarray]:
        """A token and this island's message of round `name`, for the syncer (two
        results, objects the syncer owns: `Syncer._own`)."""
        return True, self.outbox[name]

    def run(
        self,
        config: RunConfig,
        replica: int,
        options: ElasticOptions,
        out_dir: str | None,
        syncer: Any,
        *,
        resume: bool = True,
        progress: bool = False,
        min_step_s: float = 0.0,
    ) -> dict[str, Any]:
        """Train island `replica` of `config`; returns `{"summary": ...}`, or
        `{"error": one line, "again": bool}` when it could not finish: refused, or
        the syncer lost (`again` False), or out of step with the job (`again`
        True: the driver runs it again and it heals)."""
        from ..distributed.courier import CourierError
        from ..distributed.ray_transport import (
            ElasticError,
            RayTransport,
            Refused,
            SyncerLost,
        )
        from . import train

        _write(out_dir, f"island-{replica}.pid", str(os.getpid()))
        started = time.perf_counter()
        train.enable_compile_cache()  # a restarted island loads its programs
        transport = RayTransport(
            syncer,
            replica,
            config.method.num_replicas,
            fields=fingerprint(config),
            outbox=self.outbox,
            timeout_s=options.timeout_s,
            event=_Journal(out_dir, replica),
        )
        where = None if out_dir is None else os.path.join(out_dir, f"island-{replica}")
        try:
            history = train.run(
                config.replace(eval_every=config.steps) if EVAL_AT_END else config,
                where,
                transport=transport,
                resume=resume,
                callback=_StepFile(out_dir, replica, config, min_step_s),
                progress=progress,
            )
        except (ElasticError, CourierError) as e:
            lost = isinstance(e, SyncerLost) or not _alive(syncer)
            line = _ended(replica, e, lost, where, out_dir)
            # Neither refused nor cut off: it fell out of step (a round it read
            # too late); run again, it heals from a peer.
            again = not lost and not isinstance(e, Refused)
            return {"error": line, "again": again}
        summary = _summary(history, transport, replica, started)
        _finish(out_dir, replica, summary, history.state.global_params)
        transport.serve_until_end(history.state)  # a peer behind may still heal
        summary["served_bytes"] = transport.served
        _write(out_dir, f"island-{replica}.json", json.dumps(summary, indent=1))
        return {"summary": summary}


def _ended(replica, error, lost: bool, where, out_dir) -> str:
    """The island's one line when it could not finish."""
    step = _read_step(out_dir, replica)
    if not lost:
        return f"island {replica} stopped at step {step}: {error}"
    saved = _latest_checkpoint(where)
    kept = (
        f"its checkpoint of step {saved} is in {where}"
        if saved is not None
        else "it has no checkpoint (give --checkpoint-every)"
    )
    return (
        f"island {replica}: lost the syncer at step {step}; {kept}; start the "
        "same command again to resume the job"
    )


def _alive(syncer: Any) -> bool:
    import ray

    try:
        ray.get(syncer.ping.remote(), timeout=5)
        return True
    except Exception:  # noqa: BLE001 - any failure: gone
        return False


def _latest_checkpoint(where: str | None) -> int | None:
    directory = None if where is None else os.path.join(where, "checkpoints")
    if directory is None or not os.path.isdir(directory):
        return None
    steps = [int(n) for n in os.listdir(directory) if n.isdigit()]
    return max(steps, default=None)


def _summary(history: Any, transport: Any, replica: int, started: float) -> dict:
    """The island's summary: the final evaluation of θ_g, its heal, its rounds."""
    joined = transport.joined_at or time.time()
    last = history.evals[-1] if history.evals else {}  # none: healed at the end
    evaluation = {k: v for k, v in last.items() if k != "step"}
    return {
        "replica": replica,
        "evaluation": evaluation,
        "healed": transport.healed,
        "first_step": transport.first_step,
        "steps": history.config.steps,
        "seconds": time.perf_counter() - started,
        "ready_s": transport.ready_at - started,
        "joined_at": joined,
        "trained_s": time.time() - joined,
        "served_bytes": transport.served,
        "losses": [(r["step"], r["loss/train"]) for r in history.rows],
        "rounds": [dataclasses.asdict(x) for x in transport.rounds],
        "global_digest": digest(history.state.global_params),
    }


class _Journal:
    """`out/island-<m>.jsonl`: what the island's transport did (served a heal,
    healed), one JSON line each with `time.time()`."""

    def __init__(self, out_dir, replica: int):
        self.path = None
        if out_dir is not None:
            self.path = os.path.join(out_dir, f"island-{replica}.jsonl")

    def __call__(self, what: str, **details: Any) -> None:
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps({"t": time.time(), "what": what, **details}) + "\n")


class _StepFile:
    """`out/island-<m>.step`: how far the island is, at every `log_every` step; and
    each step made to last at least `min_step_s` (a `train.run` callback)."""

    def __init__(self, out_dir, replica: int, config: RunConfig, min_step_s=0.0):
        self.out_dir, self.replica, self.c = out_dir, replica, config
        self.min_step_s, self.due = min_step_s, time.monotonic() + min_step_s

    def __call__(self, step: int, state: Any, metrics: Any) -> None:
        del state, metrics
        if step % self.c.log_every == 0 or step == self.c.steps:
            _write(self.out_dir, f"island-{self.replica}.step", str(step))
        if self.min_step_s > 0:
            time.sleep(max(0.0, self.due - time.monotonic()))
            self.due = max(self.due, time.monotonic()) + self.min_step_s


def _finish(out_dir, replica, summary, theta_g) -> None:
    """Write the island's summary and θ_g."""
    if out_dir is not None:
        _write(out_dir, f"island-{replica}.json", json.dumps(summary, indent=1))
        eqx.tree_serialise_leaves(
            os.path.join(out_dir, f"island-{replica}.eqx"), theta_g
        )


def digest(tree: Any) -> str:
    """A short hash of a pytree's arrays (equal islands have equal θ_g)."""
    h = hashlib.blake2b(digest_size=8)
    for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array)):
        h.update(np.asarray(x).tobytes())
    return h.hexdigest()


def _read_step(out_dir, replica: int) -> int:
    try:
        with open(os.path.join(out_dir, f"island-{replica}.step")) as f:
            return int(f.read() or 0)
    except (OSError, TypeError, ValueError):
        return 0


def _write(out_dir: str | os.PathLike | None, name: str, text: str) -> None:
    """Write `out_dir/name` whole or not at all: the text goes to a file beside it,
    which then replaces it (`os.replace` is atomic on POSIX), so a reader polling
    the step file never sees it empty or half-written."""
    if out_dir is None:
        return
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
