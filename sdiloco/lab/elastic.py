"""The elastic multi-process job: one process per replica island, one coordinator.

`python -m sdiloco coordinate --board HOST:PORT --replicas M` starts the coordinator
(it holds no replica: the board, a key-value store over TCP, and the rounds'
membership decisions, `distributed.coordinator`); `python -m sdiloco train ...
--board HOST:PORT --replica m` starts island m (the same training flags on every
island). A SIGKILLed island stops nobody: the others are left waiting at most
`grace_s` at the round it missed, then train on without it. The same command
started again heals the island from a live peer and it rejoins at its next send.

Each island is `train.run(config, transport=BoardTransport(...))`: the same loop,
logging, evaluations, checkpoints and progress as any run, training the run's
replica m alone (`num_replicas=1` in its own algorithm, its share of the global
batch, `data.replica_batches` indexed by the step count) with the posted exchange
(`posted_exchange(island=(m, M))`) moved by a `Courier` whose transport is the
board: while the next τ steps compute, or, with τ = 0, between the halves of the
sending step. The transport's `join` heals a restarted island before its first
step, and its `between_steps` reads the coordinator's mail (a heal to serve; word
that it fell behind, then it heals). Its messages and its heals leave from its own
depot (`net.Depot`). Its compiled programs are kept in JAX's persistent cache
(`train.enable_compile_cache`), so a restarted island loads them. At the end it
writes `out/island-<m>.json` (its summary) and `out/island-<m>.eqx` (θ_g,
`eqx.tree_serialise_leaves`); `out/island-<m>.step` says how far it is and
`out/island-<m>/` holds its run's history (and checkpoints, if asked). An island
knows it was restarted by the key `joined/<m>` it left on the board the first time.
One that cannot reach the board for `heartbeat_s` ends with one line (`BoardLost`).
"""

import dataclasses
import hashlib
import json
import math
import os
import signal
import sys
import threading
import time
from typing import Any

import equinox as eqx
import jax
import numpy as np

from ..distributed import net
from ..distributed.board import Board, BoardError, BoardTransport, Keys
from ..distributed.coordinator import BoardServer, Coordinator
from ..distributed.courier import CourierError
from . import train
from .config import RunConfig


@dataclasses.dataclass(frozen=True)
class BoardOptions:
    """Where the board is and how long anything waits on it.

    Attributes:
        address: `host:port` of the coordinator's service.
        grace_s: how long a round waits, after its first message, for an expected
            island (the failure detection of the job: a dead island stalls the
            others this long, once).
        timeout_s: the longest any island waits for a key (a decision, a message,
            a heal) before it stops with `BoardError`.
        heartbeat_s: how long an island may be unable to reach the board before it
            ends with one line (`BoardLost`); a shorter pause is ridden out.
        connect_timeout_s: how long the first start waits for every process.
    """

    address: str
    grace_s: float = 5.0
    timeout_s: float = 120.0
    heartbeat_s: int = 10
    connect_timeout_s: int = 300

    def __post_init__(self):
        host, _, port = self.address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"board={self.address!r}; allowed: HOST:PORT.")
        if not self.heartbeat_s >= 1:
            raise ValueError(f"heartbeat_s={self.heartbeat_s}; allowed: >= 1 s.")
        for name in ("grace_s", "timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)}; allowed: > 0.")
        if self.timeout_s <= self.grace_s:
            raise ValueError(
                f"timeout_s={self.timeout_s} <= grace_s={self.grace_s}; allowed: a "
                "timeout longer than the grace window."
            )

    @property
    def keep_s(self) -> float:
        """How long a decided round's copies stay on the board at most (when some
        live island has not read them): as long as an island may be silent and still
        count as live (the heartbeat) and a grace window more, and at least 60 s and
        4 grace windows. So an island stopped for less than the heartbeat still finds
        the rounds it was reading when it goes on."""
        return max(60.0, 4 * self.grace_s, self.heartbeat_s + self.grace_s)


EVAL_AT_END = True
"""Islands score θ_g on the held-out set at the end only. An evaluation inside the
loop holds up every peer's next round while it runs (measured on 2 busy cores: the
kill-and-rejoin job no longer finished within 10 minutes with one every 100 steps,
against 100 s without)."""


def island(
    config: RunConfig,
    replica: int,
    options: BoardOptions,
    out_dir: str | os.PathLike | None = None,
    *,
    progress: bool = True,
    min_step_s: float = 0.0,
) -> dict[str, Any]:
    """Train island `replica` of `config` on the board; returns its summary.

    The island is `train.run` with the board as its transport (`BoardTransport`):
    the same loop, logging, evaluations, checkpoints (under `out/island-<m>/`, with
    its `history.json`) and progress bar (unless `progress` is False:
    `--no-progress`) as any run. Around it, this connects to
    the board, offers a depot for its messages and heals, writes the step file and
    the summary, says it is done, and serves the heals peers still ask for until
    every island is done (`BoardTransport.serve_until_end`).

    With `min_step_s` > 0 every inner step takes at least that long: the island
    sleeps what its step left (`--min-step-s`). It emulates a slower accelerator on
    one machine: a straggler island among faster ones, or a job whose islands run
    for minutes of wall time at a small share of the CPU (the elastic tests).

    The summary: the final held-out evaluation of θ_g, whether it healed (and the
    seconds and bytes that took, and why), the seconds from its start until its
    programs were compiled or loaded (`ready_s`), the steps it trained, each round
    it took part in (seconds waited, members) and the bytes it served to heal peers.

    Raises:
        BoardError: the board could not be used (`BoardLost`: out of reach for
            longer than the heartbeat, one line that says to start the same
            command again), or a wait on it outlasted `options.timeout_s`.
        train.Interrupted: SIGINT or SIGTERM stopped it after a step.
    """
    count = config.method.num_replicas
    train.check_island(config, (replica, count))
    check_min_step_s(min_step_s)
    started = time.perf_counter()
    train.enable_compile_cache()  # a restarted island loads its programs
    board = Board(
        options.address,
        replica + 1,
        heartbeat_s=float(options.heartbeat_s),
        connect_timeout_s=float(options.connect_timeout_s),
        mailbox=Keys.mail(replica),
        name=f"island {replica}",
        say=lambda line: print(line, file=sys.stderr, flush=True),
    )
    depot = net.Depot(board.local_host())
    transport = BoardTransport(
        board,
        replica,
        count,
        depot=depot,
        timeout_s=options.timeout_s,
        start_s=float(options.connect_timeout_s),
    )
    try:
        board.put(Keys.island("depot", replica), depot.address.encode())
        history = train.run(
            config.replace(eval_every=config.steps) if EVAL_AT_END else config,
            None if out_dir is None else os.path.join(out_dir, f"island-{replica}"),
            transport=transport,
            resume=False,  # a restarted island heals from a peer (newer)
            callback=_StepFile(out_dir, replica, config, min_step_s),
            progress=progress,
        )
        summary = _summary(history, transport, replica, started)
        _finish(board, replica, out_dir, summary, history.state.global_params)
        transport.serve_until_end(history.state)  # a peer behind may still heal
        if transport.served != summary["served_bytes"]:
            summary["served_bytes"] = transport.served
            _write(out_dir, f"island-{replica}.json", json.dumps(summary, indent=1))
        return summary
    except CourierError as e:  # a round that failed because the board did
        if isinstance(e.__cause__, BoardError):
            raise e.__cause__ from None
        raise
    finally:
        transport.close()
        depot.close()
        board.close()


def check_min_step_s(min_step_s: float) -> None:
    """Raise `ValueError` unless `min_step_s` (an island's shortest step) is a finite
    number of seconds >= 0."""
    if not 0 <= min_step_s < math.inf:
        raise ValueError(f"min_step_s={min_step_s}; allowed: 0 <= S < inf seconds.")


def _summary(history: train.History, transport: BoardTransport, replica, started):
    """The island's summary (see `island`)."""
    joined = transport.joined_at or time.time()
    evaluation = {k: v for k, v in history.evals[-1].items() if k != "step"}
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


def _finish(board, replica, out_dir, summary, theta_g) -> None:
    """Write the island's summary and θ_g, then say it is done (then the
    coordinator may stop the board)."""
    if out_dir is not None:
        _write(out_dir, f"island-{replica}.json", json.dumps(summary, indent=1))
        eqx.tree_serialise_leaves(
            os.path.join(out_dir, f"island-{replica}.eqx"), theta_g
        )
    board.put(Keys.island("done", replica), b"1")


def run_coordinator(
    num_replicas: int,
    options: BoardOptions,
    out_dir: str | os.PathLike | None = None,
    *,
    stop: threading.Event | None = None,
) -> list[dict[str, Any]]:
    """Serve the board and decide the rounds until every live island is done (or
    `stop` is set, or SIGTERM); writes `out/coordinator.json` with every decision."""
    stop = threading.Event() if stop is None else stop
    board = BoardServer(options.address, heartbeat_s=float(options.heartbeat_s))
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        coordinator = Coordinator(
            board,
            num_replicas,
            grace_s=options.grace_s,
            start_s=float(options.connect_timeout_s),
            keep_s=options.keep_s,
            live=board.live,
        )
        decisions = coordinator.run(stop.is_set)
    finally:
        board.close()
    records = [dataclasses.asdict(d) for d in decisions]
    if out_dir is not None:
        _write(out_dir, "coordinator.json", json.dumps(records, indent=1))
    return records


def digest(tree: Any) -> str:
    """A short hash of a pytree's arrays (equal islands have equal θ_g)."""
    h = hashlib.blake2b(digest_size=8)
    for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array)):
        h.update(np.asarray(x).tobytes())
    return h.hexdigest()


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
