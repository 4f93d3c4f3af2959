"""The host training loop: `run(config) -> History`. I/O only; the maths is in the library.

`run` builds the model, the per-replica data iterators and the algorithm from a
`RunConfig`, then loops: stack one batch per replica, take one jitted step, and every
`log_every` steps pull the metrics to the host. It evaluates the held-out loss of the
global parameters (and, on request, of the replica average and of the first replica),
counts the bits put on the wire exactly (Python integers), shows a tqdm bar with loss,
tokens/s and bits sent, checkpoints with orbax and writes the history as JSON and CSV.

The same loop runs the one-device simulation, a job over many devices and
processes, and one island of an elastic job: only the `cluster.Placement` differs
(`mesh=`, `transport=`; see `sdiloco.lab.cluster`). In a job, every process runs
`run` with the same config and output directory; each reads its own replicas'
batches, all write their shards of each checkpoint, and process 0 alone shows
progress and writes the history. An island (`transport=` an elastic job's
`distributed.RayTransport`) trains its one replica with its own output directory;
the transport's `join` (before the first step) and `between_steps` (after each)
are where it heals and serves heals (`sdiloco.lab.elastic`).
"""

import csv
import dataclasses
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jax.sharding import Mesh
from tqdm import tqdm  # the text bar: no widget lookup (and no warning) in a kernel

from ..analysis import replica_average, replica_params
from ..base import Algorithm, Exchange, PostedExchange
from ..participation import Participation
from ..schedule import default_first_send
from ..sim import chaos
from . import data as data_lib, model as model_lib
from .checkpoint import Checkpointer, CheckpointError, CorruptCheckpoint
from .cluster import Placement
from .config import RunConfig, StreamingConfig


class Interrupted(Exception):
    """A run stopped by SIGINT (Ctrl-C) or SIGTERM after a checkpoint of its last
    finished step; `run` with the same config and `out_dir` resumes it."""

    def __init__(self, step: int, signum: int, out_dir: str | os.PathLike):
        self.step, self.signum, self.out_dir = step, signum, out_dir
        name = signal.Signals(signum).name
        super().__init__(f"{name} at step {step}: checkpoint saved in {out_dir}")


class NonFiniteLoss(RuntimeError):
    """A training or held-out loss that is NaN or infinite (`nonfinite_loss="stop"`)."""


@dataclasses.dataclass
class History:
    """What a run produced."""

    config: RunConfig
    rows: list[dict] = dataclasses.field(default_factory=list)
    """Training metrics every `log_every` steps (and the last step)."""
    evals: list[dict] = dataclasses.field(default_factory=list)
    """Held-out losses (nats/token) and bits per byte, per evaluated parameter set."""
    summary: dict = dataclasses.field(default_factory=dict)
    """Totals: steps, tokens, bits sent (total and peak per step), the wall time
    of the training loop over every segment of a resumed run (`wall_s`), and the
    step this call started from (`start_step`: 0 fresh, the checkpoint's step when
    resumed; equal to `steps` when the run was already done)."""
    state: Any = None
    """The final state (not serialised)."""

    def final_eval(self, which: str = "global") -> float:
        """The last held-out loss of `which` parameters."""
        return self.evals[-1][f"eval/{which}"]

    def to_dict(self) -> dict:
        return {
            "config": json.loads(self.config.to_json()),
            "rows": self.rows,
            "evals": self.evals,
            "summary": self.summary,
        }

    def save(self, out_dir: str | os.PathLike) -> None:
        """Write `history.json`, `history.csv` and `evals.csv` into `out_dir`."""
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "history.json"), "w") as f:
            json.dump(self.to_dict(), f, indent=1)
        for name, rows in (("history.csv", self.rows), ("evals.csv", self.evals)):
            if rows:
                keys = sorted(
                    {k for r in rows for k in r}, key=lambda k: (k != "step", k)
                )
                with open(os.path.join(out_dir, name), "w", newline="") as f:
                    w = csv.DictWriter(f, fieldnames=keys)
                    w.writeheader()
                    w.writerows(rows)


@dataclasses.dataclass
class Run:
    """The pieces of a run, built from a config (see `build`)."""

    config: RunConfig
    model_config: model_lib.ModelConfig
    algorithm: Algorithm
    model: Any
    train_tokens: np.ndarray
    heldout_tokens: np.ndarray
    island: tuple[int, int] | None = None
    """`(m, M)` when this program trains replica m alone (`config` is then its
    share: one replica, 1/M of the global batch)."""

    def init_state(self):
        return self.algorithm.init(self.model, jr.PRNGKey(self.config.seed + 1))

    def iterators(self) -> list:
        """One batch iterator per replica; an island's list holds only its own
        (`data.StepBatches`: replica m's batches of the whole job, by step)."""
        c = self.config
        if self.island is not None:
            m, count = self.island
            batches = data_lib.replica_batches(
                self.train_tokens,
                num_replicas=count,
                global_batch_size=c.data.global_batch_size * count,
                seq_len=self.model_config.seq_len,
                seed=c.data.seed,
                replica=m,
            )
            out: list = [None] * count
            out[m] = data_lib.StepBatches(batches)
            return out
        return data_lib.make_replica_iterators(
            self.train_tokens,
            num_replicas=c.method.num_replicas,
            global_batch_size=c.data.global_batch_size,
            seq_len=self.model_config.seq_len,
            seed=c.data.seed,
        )


def enable_compile_cache(path: str | os.PathLike | None = None) -> None:
    """Keep XLA's compilations on disk, across runs and processes (JAX's persistent
    compilation cache): seeds of one config compile once, and a restarted process
    (an island that rejoins an elastic job) loads its step instead of compiling it.

    Uses `path`, else `$SDILOCO_JAX_CACHE`, else JAX's own setting
    (`$JAX_COMPILATION_CACHE_DIR` or `jax_compilation_cache_dir`) when one is
    given, else `/tmp/sdiloco-jax-cache`. Every program is kept, however quickly it
    compiled (JAX keeps only those over 1 s by default): besides its step, a run
    compiles dozens of small programs (initialisation, evaluation, the array
    operations around the step) of 20-100 ms each, which every new process (a
    notebook, an island, a resumed run) would otherwise compile again.
    """
    own = jax.config.jax_compilation_cache_dir  # pyright: ignore[reportAttributeAccessIssue]
    default = own or "/tmp/sdiloco-jax-cache"
    path = path or os.environ.get("SDILOCO_JAX_CACHE", default)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def build(
    config: RunConfig,
    placement: Placement | None = None,
    *,
    exchange: Exchange | PostedExchange | None = None,
) -> Run:
    """Model, data and algorithm of a config (nothing is trained).

    With a `placement` on a mesh, a DiLoCo-family algorithm gets the sharded exchange,
    with a transport the posted one; an `exchange` given here is used instead. With
    an island placement (`Placement.island`: replica m of M) the run is that
    replica's: one replica and 1/M of the global batch (`Run.island`).
    """
    island = None if placement is None else placement.island
    if island is not None:
        config = config.replace(
            method={"num_replicas": 1},
            data={"global_batch_size": config.data.global_batch_size // island[1]},
        )
    mc = config.model_config()
    train, heldout = _tokens(config, mc)  # checked before the model is built
    model = model_lib.Transformer(mc, key=jr.PRNGKey(config.seed))
    available = len(data_lib.TokenWindows(heldout, mc.seq_len))
    if config.eval_windows is not None and config.eval_windows > available:
        raise ValueError(
            f"RunConfig.eval_windows={config.eval_windows}; the evaluation split has "
            f"{available} windows of seq_len={mc.seq_len} (allowed: 1..{available}, "
            "or None for all)."
        )
    inner = config.inner.build(config.steps)
    extra: dict[str, Any] = {}
    if placement is not None and config.method.kind != "data_parallel":
        extra = placement.exchange(getattr(config.method, "overlap", 0))
    if exchange is not None:
        extra = {"exchange": exchange}
    alg = config.method.build(model_lib.loss_with_aux, inner, model, **extra)
    return Run(config, mc, alg, model, train, heldout, island)


def run(
    config: RunConfig,
    out_dir: str | os.PathLike | None = None,
    *,
    mesh: Mesh | None = None,
    devices_per_replica: int | None = None,
    fsdp: bool = False,
    courier: bool = False,
    transport: Any = None,
    resume: bool = True,
    stop_after: int | None = None,
    progress: bool = True,
    callback: Callable[[int, Any, dict], Any] | None = None,
    nonfinite_loss: str = "continue",
) -> History:
    """Train `config` and return its history.

    Args:
        config: the run.
        out_dir: where to write `history.json`/`.csv`, `config.json` and checkpoints
            (`out_dir/checkpoints`); None writes nothing. In a multi-process job, a
            directory every process sees.
        mesh: where the replicas live: a `sdiloco.distributed.replica_mesh`, or None
            for the one-device simulation (in a multi-process job, None means a mesh
            over every device of the job).
        devices_per_replica: build the mesh over every device with this many devices
            per replica (its `"data"` axis); instead of `mesh`.
        fsdp: split each replica's parameters and inner state over its devices.
        courier: move the exchange of an overlapped method (τ >= 1) between steps,
            while the next inner steps compute (`distributed.Courier`; the last
            device of each process communicates). The numbers are those without.
        transport: a `distributed.Transport` (or a function `move(messages,
            fragment, sent) -> messages`) that moves the DiLoCo family's exchange
            between steps, in one process. One with `island=(m, M)` (an elastic
            job's `distributed.RayTransport`) makes this run replica m of the
            config alone: its share of the batch, its transport's `join` before the
            first step (a restarted island heals there, from a live peer: newer than
            any checkpoint) and `between_steps` after each.
        resume: continue from the latest checkpoint in `out_dir` if there is one
            (written on any layout that holds the same run).
        stop_after: stop (with a checkpoint) after this step, e.g. to split a run in
            parts; a later call with `resume=True` continues it exactly.
        progress: show a tqdm progress bar (process 0 only).
        callback: `callback(step, state, metrics)` after every step, on device
            values (e.g. `analysis.outer_gradient_cosine`). The state is donated to
            the next step: copy what you keep, do not hold the state itself.
        nonfinite_loss: "stop" raises `NonFiniteLoss` when a training loss (read
            every `log_every` steps) or a held-out loss is NaN or infinite;
            "continue" records it and trains on (a diverging trial of a sweep).

    With `out_dir`, in a single process, SIGINT (Ctrl-C) and SIGTERM stop the run
    after the step in progress: it checkpoints that step, writes the history and
    raises `Interrupted`; a second signal stops at once.

    Returns:
        The `History` (with the final state in `history.state`).

    Raises:
        ValueError: a layout that cannot hold the run, a token file that does not
            fit the model (before any compute).
        CheckpointError: a checkpoint in `out_dir` of another run, or none intact.
        Interrupted: a signal stopped the run (after a checkpoint).
        NonFiniteLoss: with `nonfinite_loss="stop"`.
    """
    c = config
    if out_dir is not None:
        check_out_dir(out_dir)
    place = _placement(
        c, mesh, devices_per_replica, fsdp, courier, transport, nonfinite_loss
    )
    r = build(config, place)
    history = History(config)
    log = _Log(r, history, progress and place.primary, place)
    log.stop_nonfinite = nonfinite_loss == "stop"
    signals = _Signals(out_dir is not None and jax.process_count() == 1)
    ckpt = None
    try:  # the placement's couriers and the checkpointer are released in any case
        state = place.state(r.init_state())
        iterators = r.iterators()
        if out_dir is not None:
            ckpt, state = _open_checkpoints(
                r, out_dir, resume, state, iterators, log, place
            )
        last = c.steps if stop_after is None else min(stop_after, c.steps)
        loop = _Loop(r, place, log, iterators, ckpt, signals)
        with signals:
            state = loop.train(state, int(place.host(state.step)), last, callback)
            jax.block_until_ready(state)
            place.close()
            log.stop()
            last = loop.reached  # earlier than asked after a signal
            if ckpt is not None and ckpt.latest_step() != last:
                loop.save(last, state)
    finally:
        place.close(wait=False)
        log.close()  # an error's line then ends the output, after the bar
        if ckpt is not None:
            ckpt.close()
    history.summary = log.summary(last)
    trace = _trace(c)
    if trace is not None:
        history.summary["participation"] = chaos.summary(trace)
    history.state = state
    if out_dir is not None and place.primary:
        history.save(out_dir)
    if signals.received is not None and out_dir is not None:
        raise Interrupted(last, signals.received, out_dir)
    return history


class _Signals:
    """SIGINT and SIGTERM while a run with an output directory trains: the first
    asks the loop to stop after its step (which it then checkpoints), a second stops
    at once (KeyboardInterrupt). Only in the main thread of a single process: in a
    job, one process leaving alone would leave the others in a collective."""

    def __init__(self, active: bool):
        self.active = active and threading.current_thread() is threading.main_thread()
        self.received: int | None = None
        self.previous: dict = {}

    def __enter__(self) -> "_Signals":
        if self.active:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        del frame
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signum

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous.clear()


@dataclasses.dataclass
class _Loop:
    """The training loop of `run`: steps, logs, evaluations and checkpoints."""

    r: Run
    place: Placement
    log: "_Log"
    iterators: list
    ckpt: Checkpointer | None
    signals: "_Signals | None" = None
    reached: int = 0
    """The last step taken (`last`, or earlier when a signal stopped the loop)."""

    def train(self, state: Any, start: int, last: int, callback: Any) -> Any:
        """Steps `start + 1 ... last` from `state`; returns the last state.

        With a transport, its `join` comes first and its `between_steps` after every
        step; a state they hand back at another step count (an island healed from a
        peer) moves the loop and the data there."""
        c, place = self.r.config, self.place
        step_fn, evaluate = place.step(self.r.algorithm), evaluator(self.r, c, place)
        spec = self.r.algorithm.spec
        trace = _trace(c)
        if place.transport is not None:
            state = place.join(step_fn, state, self._peek(), spec)
            start = self._seek(state)
        self.log.start(start)
        self.reached = step = start
        while step < last:
            if self.signals is not None and self.signals.received is not None:
                break
            batch = place.batch(self.iterators)
            if trace is None:
                state, metrics = step_fn(state, batch)
            else:
                state, metrics = step_fn(state, batch, _participation(trace, step + 1))
            step += 1
            self.log.record(
                step, metrics, flush=step % c.log_every == 0 or step == last
            )
            if callback is not None:
                callback(step, state, metrics)
            if step % c.eval_every == 0 or step == c.steps:
                self.log.evaluation(step, evaluate(state))
            if c.checkpoint_every and step % c.checkpoint_every == 0:
                self.save(step, state)
            self.reached = step
            if place.transport is not None:
                for line in place.transport.news():
                    self.log.say(f"{place.describe(short=True)}: step {step}: {line}")
                moved = place.between_steps(state, spec)
                if moved is not state:  # healed: the peer's step count
                    state, step = moved, self._seek(moved)
                    self.log.jump(step)
                    self.reached = step
        if self.reached != last and self.log.pending:  # a row for the last step
            self.log.flush(self.reached)
        return state

    def _peek(self) -> Any:
        """The next batch, without moving the iterators on (to compile with)."""
        place, iterators = self.place, self.iterators
        kept = {m: iterators[m].get_state() for m in place.local_replicas}
        batch = place.batch(iterators)
        for m, position in kept.items():
            iterators[m].set_state(position)
        return batch

    def _seek(self, state: Any) -> int:
        """The state's step count; the data iterators moved to it (an island's)."""
        step = int(self.place.host(state.step))
        for m in self.place.local_replicas:
            if hasattr(self.iterators[m], "seek"):
                self.iterators[m].seek(step)
        return step

    def save(self, step: int, state: Any) -> None:
        """A checkpoint of `state` at `step`, with every replica's data position."""
        if self.ckpt is None:
            return
        place = self.place
        positions = place.gather_json(
            {m: self.iterators[m].get_state() for m in place.local_replicas}
        )
        meta = self.log.meta()
        meta["data"] = [positions.get(m) for m in range(place.num_replicas)]
        with place.exclusive():  # orbax's barriers are collectives too
            self.ckpt.save(step, state, meta)


def sync_warning(config: RunConfig) -> str | None:
    """One line when a DiLoCo-family run ends before some fragment's first outer
    step (e.g. `--steps 20` with H = 100), else None.

    Such a run is allowed (a short run still checks a setup), but the global
    parameters of those fragments, the ones evaluated, never leave their
    initialisation. Fragment p first arrives at `f_p + τ` with
    `f_p = H + round(p·H/P)` (`schedule.default_first_send`).
    """
    m = config.method
    h = getattr(m, "sync_every", None)
    if h is None:  # Data-Parallel synchronises every step
        return None
    p = 1
    if isinstance(m, StreamingConfig):
        p += config.model_config().num_layers // m.layers_per_fragment
    overlap = getattr(m, "overlap", 0)
    tau = max(overlap) if isinstance(overlap, tuple) else overlap
    arrive = [f + tau for f in default_first_send(h, p)]
    never = sum(a > config.steps for a in arrive)
    if not never:
        return None
    what = (
        "no fragment is ever synchronised: the global parameters (the ones "
        "evaluated) stay at their initialisation and no bits are sent"
        if never == p
        else f"{never} of {p} fragments are never synchronised: their global "
        "parameters (evaluated) stay at their initialisation"
    )
    return (
        f"warning: steps={config.steps} ends before step {max(arrive)}, where the "
        f"last fragment's first outer step lands (H={h}, {p} fragment(s), tau={tau}): "
        f"{what}; give --steps >= {max(arrive)} or a smaller --sync-every."
    )


def check_out_dir(out_dir: str | os.PathLike) -> None:
    """`out_dir` can hold a run: an existing directory, or a path whose nearest
    existing parent is a directory, where this process can write (tried with a
    temporary file, removed at once); nothing is created.

    Raises:
        ValueError: naming the path and why not (a file, a path through a file, a
            read-only file system, no permission).
    """
    path = os.path.abspath(os.fspath(out_dir))
    where = path
    while not os.path.exists(where):  # the nearest existing ancestor
        where = os.path.dirname(where)
    why = None
    if not os.path.isdir(where):
        why = "is a file" if where == path else f"lies under the file {where!r}"
    else:
        try:
            with tempfile.TemporaryFile(dir=where):
                pass
        except OSError as e:
            why = f"cannot be written ({where}: {e.strerror})"
    if why is not None:
        raise ValueError(
            f"out_dir={os.fspath(out_dir)!r} (--out) {why}; allowed: a directory, "
            "new or existing, that this process can write."
        )


def _trace(c: RunConfig) -> chaos.Trace | None:
    """The run's seeded failure trace (`RunConfig.failures`), or None."""
    if c.failures is None:
        return None
    trace = chaos.failure_trace(c.failures, c.method.num_replicas, c.steps)
    chaos.check_trace(trace, c.method.num_replicas, c.steps)
    return trace


def _participation(trace: chaos.Trace, step: int) -> Participation:
    """Row `step` (1-based) of a trace, as the step's input."""
    return Participation(*(jnp.asarray(x[step - 1]) for x in trace))


def _placement(
    c: RunConfig,
    mesh: Mesh | None,
    devices_per_replica: int | None,
    fsdp: bool,
    courier: bool,
    transport: Any,
    nonfinite_loss: str,
) -> Placement:
    """Where `run`'s replicas live, once its options are checked (before any
    compute)."""
    if nonfinite_loss not in ("stop", "continue"):
        raise ValueError(
            f"nonfinite_loss={nonfinite_loss!r}; allowed: 'stop', 'continue'."
        )
    place = Placement.of(
        c.method.num_replicas,
        mesh,
        devices_per_replica=devices_per_replica,
        fsdp=fsdp,
        courier=courier,
        transport=transport,
    )
    _check_batch(c, place)
    if place.island is not None:
        check_island(c, place.island)
    if c.failures is not None and (courier or place.mesh is not None or transport):
        raise ValueError(
            f"RunConfig.failures={c.failures!r} on a mesh or with a courier; allowed: "
            "failures only in the one-device simulation (real processes fail in an "
            "elastic job: python -m sdiloco coordinate / train --board)."
        )
    return place


def check_island(c: RunConfig, island: tuple[int, int]) -> None:
    """The run can be trained as island m of M (before anything is built)."""
    m, count = island
    if c.method.kind == "data_parallel":
        raise ValueError(
            "method.kind='data_parallel' on an island; allowed: a DiLoCo-family "
            "method (Data-Parallel's every step is a collective)."
        )
    if count < 2 or not 0 <= m < count:
        raise ValueError(
            f"replica={m} of method.num_replicas={count}; allowed: 0 ... M - 1 "
            "with M >= 2."
        )
    if c.data.global_batch_size % count:
        raise ValueError(
            f"data.global_batch_size={c.data.global_batch_size}; allowed: a "
            f"multiple of method.num_replicas={count}."
        )
    if c.failures is not None:
        raise ValueError(
            f"RunConfig.failures={c.failures!r} on an island; allowed: None (the "
            "processes themselves fail)."
        )


def _check_batch(c: RunConfig, place: Placement) -> None:
    """The global batch fits the layout (before anything is built)."""
    if place.mesh is None:
        return
    data = dict(place.mesh.shape)["data"]
    per = c.data.global_batch_size // c.method.num_replicas
    if per % data:
        raise ValueError(
            f"data.global_batch_size={c.data.global_batch_size} gives {per} sequences "
            f"per replica, not a multiple of the {data} devices per replica; allowed: "
            f"a multiple of {c.method.num_replicas * data}."
        )


def _open_checkpoints(
    r: "Run", out_dir, resume: bool, state, iterators, log: "_Log", place: Placement
):
    """The run's `Checkpointer`, and the state restored from its latest checkpoint."""
    c = r.config
    if place.primary:
        os.makedirs(out_dir, exist_ok=True)
    directory = os.path.join(out_dir, "checkpoints")
    if not resume and os.path.isdir(directory) and jax.process_count() == 1:
        # Starting afresh: the old checkpoints go aside (one generation is kept),
        # so the new run does not meet its own step numbers already taken.
        old = directory + ".old"
        if os.path.isdir(old):
            shutil.rmtree(old)
        os.rename(directory, old)
    ckpt = Checkpointer(directory, c.to_json(), c.keep_checkpoints)
    if resume and ckpt.latest_step() is not None:
        state, meta = _restore_intact(ckpt, state, place)
        for m in place.local_replicas:
            iterators[m].set_state(meta["data"][m])
        log.history.rows, log.history.evals = meta["rows"], meta["evals"]
        log.totals = meta["totals"]
    # Only now: a refused checkpoint leaves the directory's config.json as it was.
    if place.primary:
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            f.write(c.to_json())
    return ckpt, state


def _restore_intact(ckpt: Checkpointer, state: Any, place: Placement):
    """The newest checkpoint that reads back, saying so in one line when newer ones
    do not (a process killed while the disk filled, a damaged file).

    Raises:
        CheckpointError: another config or state (not a damage: no fallback), or no
            checkpoint intact (suggesting `--no-resume`).
    """
    damaged = []
    for step in reversed(ckpt.all_steps()):
        try:
            restored = ckpt.restore(state, step=step, abstract=place.abstract(state))
        except CorruptCheckpoint as e:
            damaged.append((step, e))
            continue
        if damaged and place.primary:
            if jax.process_count() == 1:  # the run will write these steps again
                for s, _ in damaged:
                    ckpt.set_aside(s)
            print(
                f"warning: checkpoint step {damaged[0][0]} in {ckpt.directory} is "
                f"damaged ({damaged[0][1]}); resuming from step {step}, the newest "
                "intact one (the damaged one is kept as "
                f"{damaged[0][0]}.damaged).",
                file=sys.stderr,
                flush=True,
            )
        elif place.primary:
            print(
                f"resuming from step {step} ({ckpt.directory})",
                file=sys.stderr,
                flush=True,
            )
        return restored
    raise CheckpointError(
        f"no intact checkpoint in {ckpt.directory} (steps "
        f"{[s for s, _ in damaged]}; newest: {damaged[0][1]}); start afresh with "
        "--no-resume (run(..., resume=False))."
    )


class _Log:
    """The host side of a run: metric rows, exact bit totals, evaluations, the bar."""

    def __init__(self, r: "Run", history: History, progress: bool, place: Placement):
        self.r, self.history, self.progress, self.place = r, history, progress, place
        self.totals = {"bits": 0, "peak_bits": 0, "wall_s": 0.0}
        self.bits_table = [int(b) for b in r.algorithm.bits_per_fragment(r.model)]
        self.tokens_per_step = r.config.data.global_batch_size * r.model_config.seq_len
        self.pending: list[tuple[int, dict]] = []
        self.stop_nonfinite = False
        self.t0: float | None = None  # while the loop runs: when it started
        self.first = 0  # the step this call started from (a resumed run's > 0)

    def start(self, step: int) -> None:
        c = self.r.config
        self.bar = tqdm(
            total=c.steps,
            initial=step,
            disable=not self.progress,
            desc=c.title(),
            dynamic_ncols=True,
        )
        self.t0 = self.tick = time.perf_counter()
        self.tick_step = self.first = step

    def record(self, step: int, metrics: dict, flush: bool) -> None:
        """Keep the step's metrics on device; pull them to the host when `flush`."""
        self.pending.append((step, metrics))
        if flush:
            self.flush(step)
        self.bar.update(1)

    def flush(self, step: int) -> None:
        """Pull the pending steps' metrics to the host: one history row."""
        host = self.place.metrics(self.pending)
        self.pending.clear()
        for s, m in host:
            if self.stop_nonfinite and not math.isfinite(float(m["loss/train"])):
                self._nonfinite(f"the training loss is {float(m['loss/train'])}", s)
            sent = np.asarray(m.get("sync/sent", [True]), bool).reshape(-1)
            bits = sum(b for b, on in zip(self.bits_table, sent) if on)
            self.totals["bits"] += bits
            self.totals["peak_bits"] = max(self.totals["peak_bits"], bits)
        now = time.perf_counter()
        tok_s = (
            (step - self.tick_step) * self.tokens_per_step / max(now - self.tick, 1e-9)
        )
        self.tick, self.tick_step = now, step
        s, m = host[-1]
        row = {
            "step": s,
            "loss/train": float(m["loss/train"]),
            "ce/train": float(m["aux/ce"]),
            "tokens_per_s": tok_s,
            "comm/bits_total": self.totals["bits"],
            "nonfinite": bool(m["nonfinite"]),
        }
        self.history.rows.append(row)
        self.bar.set_postfix(
            loss=f"{row['loss/train']:.3f}",
            tok_s=f"{tok_s:,.0f}",
            bits=f"{self.totals['bits']:.3g}",
        )

    def say(self, text: str) -> None:
        """A line on stderr (stdout stays for results), beside the bar if there is
        one: an island's news of its peers is shown with or without the bar."""
        if self.progress:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def jump(self, step: int) -> None:
        """The run moved on to `step` without training the steps between (an
        island healed from a peer): the bar and the rate follow."""
        self.bar.update(step - self.bar.n)
        self.tick, self.tick_step = time.perf_counter(), step

    def evaluation(self, step: int, result: dict) -> None:
        self.history.evals.append({"step": step, **result})
        for k, v in result.items():
            if k.startswith("eval/") and self.stop_nonfinite and not math.isfinite(v):
                self._nonfinite(f"the held-out loss ({k}) is {v}", step)
        if self.progress:  # beside the bar, on stderr: stdout stays for results
            text = ", ".join(f"{k}={v:.4f}" for k, v in result.items())
            self.bar.write(f"step {step}: {text}", file=sys.stderr)

    def _nonfinite(self, what: str, step: int) -> None:
        self.bar.close()
        raise NonFiniteLoss(
            f"{what} at step {step}; the run stopped (no checkpoint of this state). "
            "Try a smaller --lr, or --nonfinite-loss continue to train on."
        )

    def meta(self) -> dict:
        """What a checkpoint keeps of the host side: the totals so far, the wall
        time of every segment of the run up to this checkpoint included."""
        h = self.history
        totals = {**self.totals, "wall_s": self.wall_s()}
        return {"rows": h.rows, "evals": h.evals, "totals": totals}

    def wall_s(self) -> float:
        """Seconds the run has trained, over every segment (a resumed run's
        checkpoint carries the earlier ones)."""
        running = 0.0 if self.t0 is None else time.perf_counter() - self.t0
        return self.totals["wall_s"] + running

    def stop(self) -> None:
        self.bar.close()
        self.totals["wall_s"] = self.wall_s()
        self.t0 = None

    def close(self) -> None:
        """Close the bar, if it was started (idempotent)."""
        if hasattr(self, "bar"):
            self.bar.close()

    def summary(self, last: int) -> dict:
        r = self.r
        return {
            "steps": last,
            "tokens": last * self.tokens_per_step,
            "bits_total": self.totals["bits"],
            "peak_bits_per_step": self.totals["peak_bits"],
            "wall_s": self.wall_s(),
            "start_step": self.first,
            "num_params": r.model_config.num_params(),
            "unigram_entropy_heldout": data_lib.unigram_entropy(r.heldout_tokens),
        }


def _tokens(
    config: RunConfig, mc: model_lib.ModelConfig
) -> tuple[np.ndarray, np.ndarray]:
    """`(train, evaluation)` tokens: held-out, or validation when tuning."""
    d = config.data
    if d.token_file is None:
        if mc.vocab_size < 256:
            raise ValueError(
                f"model {config.model!r} has vocab_size={mc.vocab_size}; the embedded "
                "corpus is byte-level and needs 256."
            )
        if d.validation:
            return data_lib.load_corpus("train-tune"), data_lib.load_corpus(
                "validation"
            )
        return data_lib.load_corpus("train"), data_lib.load_corpus("heldout")
    path = os.fspath(d.token_file)
    npy = path.lower().endswith(".npy")  # its header gives the dtype
    tokens = data_lib.load_tokens(path, None if npy else d.token_dtype)
    raw = f" (raw, read as {d.token_dtype}: --token-dtype)"
    source = f"token file {path!r}" + ("" if npy else raw)
    data_lib.check_token_ids(tokens, mc.vocab_size, source)
    total = len(tokens)
    for _ in range(1 + d.validation):  # tuning: split the training part again
        split = int(len(tokens) * (1 - d.heldout_fraction))
        tokens, evaluation = tokens[:split], tokens[split:]
    _check_windows(source, total, tokens, evaluation, mc.seq_len, d.global_batch_size)
    return tokens, evaluation


def _check_windows(
    source: str,
    total: int,
    train: np.ndarray,
    evaluation: np.ndarray,
    seq_len: int,
    batch: int,
) -> None:
    """A token file long enough for one global batch of training windows and one
    evaluation window (before any compute), or one line saying what to change."""
    windows = max(0, (len(train) - 1) // seq_len)
    if len(evaluation) < seq_len + 1 or windows < batch:
        held = len(evaluation)
        raise ValueError(
            f"{source} has {total} tokens: {len(train)} to train on "
            f"({windows} windows of seq_len={seq_len}) and {held} held out (the "
            f"last part); a run needs {batch} training windows (the global batch) "
            f"and {seq_len + 1} held-out tokens; allowed: a file of at least "
            f"{_tokens_needed(total, len(train), held, seq_len, batch):,} tokens, or "
            "a smaller --batch-size."
        )


def _tokens_needed(total: int, train: int, held: int, seq_len: int, batch: int):
    """The smallest file length with `batch` training windows and one held-out
    window, at the split fractions this file gave (an estimate from its sizes)."""
    need_train = batch * seq_len + 1
    need_held = seq_len + 1
    train_share = train / total if total and train else 0.9
    held_share = held / total if total and held else 0.1
    return max(math.ceil(need_train / train_share), math.ceil(need_held / held_share))


def check_data(config: RunConfig) -> None:
    """Read the run's tokens and check them against its model (what `run` does
    first), without building anything.

    Raises:
        ValueError: a missing or unreadable token file, ids the model's vocabulary
            does not hold (naming the file, the largest id and the vocabulary).
    """
    _tokens(config, config.model_config())


EVAL_CHUNK = 256
"""Windows scored per call of the evaluation (a memory bound; not a sampling choice)."""


def evaluator(r: Run, c: RunConfig, place: Placement):
    """`evaluate(state) -> {name: value}`, on this process's default device.

    Every evaluation scores the same windows (`data.evaluation_windows` with
    `c.eval_windows`), whatever the method and batch: the loss is the mean over
    windows of each window's mean cross-entropy, and `eval_se/<which>` its standard
    error (the windows' standard deviation ÷ √windows, treating windows as
    independent draws of held-out text).
    """
    windows = data_lib.evaluation_windows(
        r.heldout_tokens, seq_len=r.model_config.seq_len, num_windows=c.eval_windows
    )
    count = len(windows["inputs"])
    pad = -count % EVAL_CHUNK  # repeat window 0 so every chunk has one shape
    padded = {k: np.concatenate([v, v[:1].repeat(pad, 0)]) for k, v in windows.items()}
    chunks = [
        {k: v[i : i + EVAL_CHUNK] for k, v in padded.items()}
        for i in range(0, count + pad, EVAL_CHUNK)
    ]

    @eqx.filter_jit
    def losses(params, batch):
        return model_lib.sequence_losses(params, batch)

    def params_of(which):
        def get(state):
            if which == "global" or not hasattr(state, "replica_params"):
                return eqx.filter(state.global_params, eqx.is_array)
            if which == "average":
                return eqx.filter(replica_average(state), eqx.is_array)
            return eqx.filter(replica_params(state, 0), eqx.is_array)

        return place.replicated(get)

    readers = {which: params_of(which) for which in c.eval_params}
    static = eqx.filter(r.model, eqx.is_array, inverse=True)

    def evaluate(state) -> dict:
        out = {}
        for which in c.eval_params:
            params = eqx.combine(place.local(readers[which](state)), static)
            per_window = np.concatenate([np.asarray(losses(params, b)) for b in chunks])
            per_window = per_window[:count].astype(np.float64)
            loss = float(per_window.mean())
            out[f"eval/{which}"] = loss
            # One window has no spread to estimate: NaN, without NumPy's warning.
            spread = per_window.std(ddof=1) if count > 1 else math.nan
            out[f"eval_se/{which}"] = float(spread / math.sqrt(count))
            out[f"bpb/{which}"] = loss / math.log(2)
        return out

    return evaluate
