"""The elastic multi-process job: one process per replica island, one coordinator.

`python -m sdiloco coordinate --board HOST:PORT --replicas M` starts the coordinator
(it holds no replica: the board's service and the rounds' membership decisions,
`distributed.board`); `python -m sdiloco train ... --board HOST:PORT --replica m`
starts island m (the same training flags on every island). A SIGKILLed island
stops nobody: the others are left waiting at most `grace_s` at the round it missed,
then train on without it. The same command started again heals the island from a
live peer and it rejoins at its next send.

Each island trains the run's replica m: `num_replicas=1` in its own algorithm, its
share of the global batch (`data.replica_batches`, indexed by the step count), and
an exchange over the board: posted and moved by a `Courier` while the next τ steps
compute (`BoardPosted`, `BoardTransport`) when τ >= 1, inside the sending step
(`board_exchange`) for DiLoCo. Its compiled programs are kept in JAX's persistent
cache (`train.enable_compile_cache`), so a restarted island loads them. At the end
it scores θ_g on the held-out set, like `train.run`, and writes `out/island-<m>.json` (its summary) and
`out/island-<m>.eqx` (θ_g, `eqx.tree_serialise_leaves`); `out/island-<m>.step` says
how far it is. An island knows it was restarted by the key `joined/<m>` it left on
the board the first time.
"""

import contextlib
import dataclasses
import hashlib
import json
import os
import signal
import sys
import threading
import time
from typing import Any, cast

import equinox as eqx
import jax
import numpy as np
from tqdm import tqdm

from ..distributed import net
from ..distributed.board import (
    Board,
    BoardError,
    BoardExchange,
    BoardLost,
    BoardPosted,
    BoardTransport,
    request_heal,
    serve_heal,
)
from ..distributed.coordinator import BoardServer, Coordinator
from ..distributed.courier import Courier, CourierError
from ..jit import jit_step
from ..streaming import adopt_global
from . import data as data_lib, train
from .cluster import Placement
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
        heartbeat_s: the service's heartbeat timeout.
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


def check_island(config: RunConfig, replica: int) -> None:
    """The run can be trained as elastic islands (before anything is built)."""
    method, m = config.method, config.method.num_replicas
    if method.kind == "data_parallel":
        raise ValueError(
            "method.kind='data_parallel' with --board; allowed: a DiLoCo-family "
            "method (Data-Parallel's every step is a collective)."
        )
    if m < 2 or not 0 <= replica < m:
        raise ValueError(
            f"replica={replica} of method.num_replicas={m}; allowed: 0 ... M - 1 "
            "with M >= 2."
        )
    if config.data.global_batch_size % m:
        raise ValueError(
            f"data.global_batch_size={config.data.global_batch_size}; allowed: a "
            f"multiple of method.num_replicas={m}."
        )
    if config.failures is not None:
        raise ValueError(
            f"RunConfig.failures={config.failures!r} with --board; allowed: None "
            "(the processes themselves fail)."
        )


def island(
    config: RunConfig,
    replica: int,
    options: BoardOptions,
    out_dir: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Train island `replica` of `config` on the board; returns its summary.

    The summary: the final held-out evaluation of θ_g, whether it healed (and the
    seconds and bytes that took, and why), the seconds from its start until its
    programs were compiled or loaded (`ready_s`), the steps it trained, each round
    it took part in (seconds waited, members) and the bytes it served to heal peers.

    Raises:
        BoardError: the board could not be used (`BoardLost`: out of reach for
            longer than the heartbeat, one line that says to start the same
            command again), or a wait on it outlasted `options.timeout_s`.
    """
    check_island(config, replica)
    started = time.perf_counter()
    train.enable_compile_cache()  # a restarted island loads its programs
    board = Board(
        options.address,
        replica + 1,
        heartbeat_s=float(options.heartbeat_s),
        connect_timeout_s=float(options.connect_timeout_s),
        mailbox=f"to/{replica}/",
        name=f"island {replica}",
    )
    depot = net.Depot(board.local_host())
    try:
        return _Island(config, replica, options, board, depot).run(started, out_dir)
    except CourierError as e:  # a round that failed because the board did
        if isinstance(e.__cause__, BoardError):
            raise e.__cause__ from None
        raise
    finally:
        depot.close()
        board.close()


class _Island:
    """One island's run: its program, its state, and what it does between steps."""

    def __init__(self, config, replica, options, board, depot):
        self.c, self.replica, self.options = config, replica, options
        self.board, self.depot = board, depot
        program = _program(config, replica, board, options)
        self.r, self.local, self.batches, self.step, self.log = program
        self.healed: dict[str, Any] = {}
        self.served = 0

    def run(self, started: float, out_dir) -> dict[str, Any]:
        """Compile, heal if restarted, train, evaluate θ_g, write the summary."""
        # Every state the step sees has been through the host, as a healed one has,
        # and is committed to the device: the same types (no weak types), one compile.
        state = _through_host(self.r.init_state())
        _compile(self.step, _through_host(state), _stack(self.batches[0]))
        compiled = time.perf_counter() - started  # or loaded from the cache
        _say(self.replica, f"compiled {compiled:.1f} s after start")
        if self.board.try_get(f"joined/{self.replica}") is not None:
            state = self.heal(state, "restarted")
        self.board.put(f"joined/{self.replica}", b"1")
        self.board.put(f"hello/{self.replica}", b"1")
        first, joined = int(state.step), time.time()
        with contextlib.ExitStack() as stack:
            if isinstance(self.step, Courier):
                stack.enter_context(self.step)  # at the end: waits for the last rounds
            state, losses = self.train(state, first, out_dir)
        jax.block_until_ready(state)
        trained = time.time() - joined
        evaluation = train.evaluator(self.r, self.local, Placement.of(1))(state)
        summary = {
            "replica": self.replica,
            "evaluation": evaluation,
            "healed": self.healed,
            "first_step": first,
            "steps": self.c.steps,
            "seconds": time.perf_counter() - started,
            "ready_s": compiled,
            "joined_at": joined,
            "trained_s": trained,
            "served_bytes": self.served,
            "losses": losses,
            "rounds": [dataclasses.asdict(x) for x in self.log],
            "global_digest": digest(state.global_params),
        }
        _finish(self.board, self.replica, out_dir, summary, state.global_params)
        return summary

    def train(self, state, first: int, out_dir):
        """The island's steps from `first` on: a progress bar (as `train`'s, on
        stderr), the coordinator's mail read between steps, one line when a round
        leaves a peer out or a peer is back, and the step file. Returns the state
        and the losses."""
        c, m = self.c, self.replica
        members = Membership(c.method.num_replicas)
        losses = []
        bar = tqdm(total=c.steps, initial=first, desc=f"island {m}", dynamic_ncols=True)
        t = first
        with bar:  # closed before an error's line, which then ends the output
            while t < c.steps:
                self.board.check()  # `BoardLost` once the heartbeat found it gone
                state, metrics = self.step(state, _stack(self.batches[t]))
                state, moved = self.between_steps(state, t + 1)
                bar.update(moved)
                t += moved
                for line in members.news(self.log):
                    bar.write(f"island {m}: step {t}: {line}", file=sys.stderr)
                if t % c.log_every == 0 or t == c.steps:
                    losses.append((t, float(metrics["loss/train"])))
                    bar.set_postfix(loss=f"{losses[-1][1]:.3f}", refresh=False)
                    _write(out_dir, f"island-{m}.step", str(t))
        return state, losses

    def between_steps(self, state, t: int):
        """The coordinator's mail after step t: a heal to serve (a failure says one
        line and ends nothing), or word that this island fell behind (it heals from
        a peer, as a restarted island does). Returns the state and how many steps
        it moved on (1, or more after such a heal)."""
        mail = self.board.take_mail()
        if "serve" in mail:
            try:
                self.served += serve_heal(self.board, self.depot, mail["serve"], state)
            except BoardLost:
                raise
            except Exception as e:  # noqa: BLE001 - serving never ends the island
                _say(self.replica, f"a heal it served failed: {e}")
        if "behind" not in mail:
            return state, 1
        _say(self.replica, f"behind by {mail['behind'].decode()} s at step {t}")
        state = self.heal(state, "behind")
        self.board.put(f"hello/{self.replica}", b"1")
        return state, int(state.step) - t + 1

    def heal(self, state, why: str):
        """A peer's state with θ_g as parameters; its in-flight rounds are read,
        not posted (they are the peer's)."""
        asked = time.perf_counter()
        state, size = request_heal(
            self.board, self.replica, state, self.options.timeout_s
        )
        state = _through_host(adopt_global(self.r.algorithm.spec, state))
        if isinstance(self.step, Courier):
            cast(BoardTransport, self.step.transport).quiet_until = int(state.step)
        seconds = time.perf_counter() - asked
        self.healed = {"seconds": seconds, "bytes": size, "why": why}
        _say(self.replica, f"healed at step {int(state.step)} ({size} bytes)")
        return state


class Membership:
    """Who took part in the rounds an island has seen, and what changed: one line
    when a round leaves a peer out, one when a peer is back."""

    def __init__(self, num_replicas: int):
        self.last, self.seen = set(range(num_replicas)), 0

    def news(self, rounds: list[Any]) -> list[str]:
        """Lines for the rounds (`RoundLog`s, in order) not read yet."""
        lines = []
        for r in rounds[self.seen :]:
            now = set(r.members)
            left, back = sorted(self.last - now), sorted(now - self.last)
            lines += [f"round {r.round} went on without island {k}" for k in left]
            lines += [f"island {k} is back (round {r.round})" for k in back]
            self.last = now
        self.seen = len(rounds)
        return lines


def _finish(board, replica, out_dir, summary, theta_g) -> None:
    """Write the island's summary and θ_g, then say it is done and leave."""
    if out_dir is not None:
        _write(out_dir, f"island-{replica}.json", json.dumps(summary, indent=1))
        eqx.tree_serialise_leaves(
            os.path.join(out_dir, f"island-{replica}.eqx"), theta_g
        )
    board.put(f"done/{replica}", b"1")  # then the coordinator may stop the service
    board.close()


def _program(config: RunConfig, replica: int, board: Board, options: BoardOptions):
    """The island's run (one replica, its share of the batch), its batches, its step
    and the list its rounds are logged in.

    With τ >= 1 the exchange is posted (`BoardPosted`) and the step a `Courier` whose
    transport is the board: each round moves while the next τ steps compute, and the
    step's two programs hold no host callback, so JAX's persistent compilation cache
    keeps them. With τ = 0 (DiLoCo) the round is inside the sending step
    (`BoardExchange`, a host callback).
    """
    m = config.method.num_replicas
    local = config.replace(
        method={"num_replicas": 1},
        data={"global_batch_size": config.data.global_batch_size // m},
    )
    timeout = options.timeout_s
    if min(np.atleast_1d(getattr(config.method, "overlap", 0))) >= 1:
        r = train.build(local, exchange=BoardPosted(replica, m))
        transport = BoardTransport(board, replica, m, timeout_s=timeout)
        step = Courier(r.algorithm, transport=transport, timeout=timeout)
        log = transport.rounds
    else:
        exchange = BoardExchange(board, replica, m, timeout_s=timeout)
        r = train.build(local, exchange=exchange)
        step, log = jit_step(r.algorithm), exchange.rounds
    batches = data_lib.replica_batches(
        r.train_tokens,
        num_replicas=m,
        global_batch_size=config.data.global_batch_size,
        seq_len=r.model_config.seq_len,
        seed=config.data.seed,
        replica=replica,
    )
    return r, local, batches, step, log


def _compile(step: Any, state: Any, batch: Any) -> None:
    """Compile the island's program(s) on a throwaway state (nothing is sent)."""
    if isinstance(step, Courier):
        step.warm_up(state, batch)
    else:
        jax.block_until_ready(step(state, batch))


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
            keep_s=max(60.0, 4 * options.grace_s),
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


def _through_host(tree: Any) -> Any:
    return jax.device_put(jax.device_get(tree), jax.local_devices()[0])


def _say(replica: int, text: str) -> None:
    print(f"island {replica}: {text}", file=sys.stderr, flush=True)


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


def _stack(batch: Any) -> dict[str, np.ndarray]:
    """One island's batch with the replica axis of size 1."""
    return {k: v[None] for k, v in batch.items()}
