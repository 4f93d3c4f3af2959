"""The islands' posted exchange (`distributed.board.BoardPosted`) moved by a `Courier`
with a transport, in one process: an in-memory board stands in for the coordination
service, so the numbers are tested here and the processes in `test_elastic.py`.

- M islands of one replica each, all present, train the M-replica simulation (float32
  messages), and every island ends with the same θ_g, bitwise;
- an island left out of one round (its message missed the deadline) gives every island
  the simulation's step in which that replica does not send;
- a transport that fails ends the step with a `CourierError` naming it, the state
  passed in intact; a transport with a mesh is refused;
- the coordinator's heal routing (`HealRouter`) never sends a request to an island
  that asks for a heal itself, gives a peer one request at a time, and routes again
  when the peer it chose dies or comes back.
"""

import threading

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import (
    assert_trees_allclose,
    assert_trees_equal,
    toy_batches,
    toy_params,
    toy_streaming,
)
from hypothesis import given, settings, strategies as st

import sdiloco
from sdiloco import distributed
from sdiloco.distributed import board as board_lib
from sdiloco.distributed.board import Board, BoardError, BoardPosted, HealRouter


M = 3


class MemoryBoard:
    """Every island's transport in one process: a round is complete when every
    island has posted to it; `drop` leaves (round, island) pairs out of the members,
    as a coordinator does with a message that came after its deadline."""

    def __init__(self, drop=()):
        self.posted: dict[tuple[int, int], dict[int, np.ndarray]] = {}
        self.calls: list[tuple[int, int, int]] = []
        self.drop = set(drop)
        self.cond = threading.Condition()

    def transport(self, island):
        def move(messages, fragment, sent):
            key = (sent, fragment)
            with self.cond:
                self.calls.append((island, fragment, sent))
                self.posted.setdefault(key, {})[island] = messages[0]
                self.cond.notify_all()
                done = self.cond.wait_for(lambda: len(self.posted[key]) == M, 30)
                assert done, f"round {key} never completed"
                out = np.zeros((M,) + messages.shape[1:], np.uint8)
                for m, message in self.posted[key].items():
                    if (key, m) not in self.drop:
                        out[m] = message
                return out

        return move


def _islands(params, board, **kw):
    algs = [
        toy_streaming(params, num_replicas=1, exchange=BoardPosted(m, M), **kw)
        for m in range(M)
    ]
    couriers = [
        distributed.Courier(alg, transport=board.transport(m), timeout=60.0)
        for m, alg in enumerate(algs)
    ]
    return algs, couriers


def _train_islands(params, batches, board, **kw):
    """Step the islands round-robin (each waits at t + τ for the round of t, which
    the others post at their step t)."""
    algs, couriers = _islands(params, board, **kw)
    states = [alg.init(params) for alg in algs]
    for batch in batches:
        for m in range(M):
            one = jax.tree.map(lambda x: x[m : m + 1], batch)
            states[m], _ = couriers[m](states[m], one)
    for courier in couriers:
        courier.close()
    return states


def _simulate(params, batches, sends_at=None, **kw):
    alg = toy_streaming(params, num_replicas=M, **kw)
    step, state = sdiloco.jit_step(alg), alg.init(params)
    for t, batch in enumerate(batches, start=1):
        sends = np.ones(M, bool) if sends_at is None else sends_at(t)
        state, _ = step(
            state, batch, sdiloco.Participation.of(np.ones(M, bool), None, sends)
        )
    return state


def test_islands_train_the_simulated_run():
    params = toy_params(jr.key(5))
    batches = toy_batches(jr.key(6), steps=14, replicas=M)
    board = MemoryBoard()
    states = _train_islands(params, batches, board)
    for state in states[1:]:  # the same members' bytes, the same mean: bitwise
        assert_trees_equal(state.global_params, states[0].global_params)
    simulated = _simulate(params, batches)
    assert_trees_allclose(
        states[0].global_params, simulated.global_params, rtol=1e-5, atol=1e-6
    )
    assert not np.allclose(states[0].global_params["v"], params["v"])
    # One round per sent fragment and island, named by its send step and fragment.
    sent = {(f, s) for _, f, s in board.calls}
    assert {(m, f, s) for m in range(M) for f, s in sent} == set(board.calls)
    assert len(sent) >= 4


def test_an_island_left_out_of_a_round_is_the_simulation_without_its_send():
    params = toy_params(jr.key(5))
    batches = toy_batches(jr.key(6), steps=14, replicas=M)
    full = MemoryBoard()
    _train_islands(params, batches, full)
    rounds = sorted({(s, f) for _, f, s in full.calls})
    late = rounds[1][0]  # island 2 misses every round sent at the second send step
    board = MemoryBoard(drop={(r, 2) for r in rounds if r[0] == late})
    states = _train_islands(params, batches, board)
    for state in states[1:]:
        assert_trees_equal(state.global_params, states[0].global_params)

    def sends_at(t):
        return np.array([True, True, t != late])

    simulated = _simulate(params, batches, sends_at)
    assert_trees_allclose(
        states[0].global_params, simulated.global_params, rtol=1e-5, atol=1e-6
    )
    everyone = _simulate(params, batches)
    assert not np.allclose(states[0].global_params["v"], everyone.global_params["v"])


def test_a_failed_transport_names_itself_and_leaves_the_state_intact():
    params = toy_params(jr.key(5))
    alg = toy_streaming(params, num_replicas=1, exchange=BoardPosted(0, M))

    def broken(messages, fragment, sent):
        raise RuntimeError("board unreachable")

    courier = distributed.Courier(alg, transport=broken, timeout=10.0)
    state = alg.init(params)
    batches = toy_batches(jr.key(6), steps=10, replicas=1)
    with pytest.raises(distributed.CourierError) as error:
        with courier:
            for batch in batches:
                state, _ = courier(state, batch)
    message = str(error.value)
    assert "fragment " in message and "board unreachable" in message, message
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))
    assert jnp.all(jnp.isfinite(state.global_params["v"]))


def test_bad_input():
    params = toy_params(jr.key(5))
    alg = toy_streaming(params, num_replicas=1, exchange=BoardPosted(0, M))
    mesh = distributed.replica_mesh(1, jax.devices()[:1])
    with pytest.raises(ValueError, match="transport= with a mesh"):
        distributed.Courier(alg, mesh, mesh, transport=lambda *a: a[0])
    with pytest.raises(ValueError, match="replica=3"):
        BoardPosted(3, M)
    with pytest.raises(ValueError, match="one replica per island"):
        two = toy_streaming(params, num_replicas=2, exchange=BoardPosted(0, M))
        two.step(two.init(params), toy_batches(jr.key(6), steps=1, replicas=2)[0])


class DictBoard(Board):
    """The coordinator's view of the board's keys, in a dict (no service)."""

    def __init__(self):  # pyright: ignore[reportMissingSuperCall]
        self.kv: dict[str, bytes] = {}

    def put(self, key, value):
        self.kv[key] = value

    def try_get(self, key):
        return self.kv.get(key)

    def delete(self, key):
        self.kv.pop(key, None)

    def keys(self, prefix):
        return [k for k in self.kv if k.startswith(prefix)]

    def served(self):
        """peer -> asker of every request routed and not yet taken."""
        return {
            int(k.rsplit("/", 1)[1]): int(v.decode().split(":")[0])
            for k, v in self.kv.items()
            if k.startswith("heal/serve/")
        }


def _ask(board, asker, nonce="7"):
    board.put(f"heal/want/{asker}", nonce.encode())


@settings(deadline=None, max_examples=60)
@given(
    st.sets(st.integers(0, 5)),
    st.sets(st.integers(0, 5)),
    st.lists(st.integers(0, 5), max_size=3),
)
def test_heal_routing_never_pairs_askers_and_gives_a_peer_one_request(
    askers, live, recent
):
    board, route = DictBoard(), HealRouter()
    for a in askers:
        _ask(board, a)
    route(board, set(live), tuple(recent))
    served = board.served()
    assert set(served) <= set(live) - set(askers)  # only live, non-asking peers
    assert set(served.values()) <= set(askers)  # one entry per peer: one request
    assert len(served) == min(len(askers), len(set(live) - set(askers)))
    waiting = {int(k.rsplit("/", 1)[1]) for k in board.keys("heal/want/")}
    assert waiting == set(askers) - set(served.values())  # the rest wait
    free = [p for p in live - askers if p in recent] or sorted(live - askers)
    if served:  # a member of the latest round serves first
        assert min(served) in free or min(free) in served


def test_two_islands_restarted_at_once_both_heal_from_the_survivor():
    # Islands 1 and 2 come back while their old incarnations still count as live.
    board, route = DictBoard(), HealRouter()
    live, recent = {0, 1, 2}, (0, 1, 2)
    _ask(board, 1, "a")
    _ask(board, 2, "b")
    route(board, live, recent)
    assert board.served() == {0: 1}  # never to each other; island 0 one at a time
    route(board, live, recent)
    assert board.served() == {0: 1}  # 2 waits while 0 serves 1
    board.delete("heal/serve/0")  # island 0 takes the request between two steps
    route(board, live, recent)
    assert board.served() == {0: 2}
    assert board.try_get("heal/serve/0") == b"2:b"


def test_a_request_routed_to_a_peer_that_dies_or_returns_is_routed_again():
    board, route = DictBoard(), HealRouter()
    _ask(board, 2, "n")
    route(board, {0, 1}, (1,))  # island 0 was left out of the latest round
    assert board.served() == {1: 2}  # the latest round's member first
    route(board, {0}, (0,))  # island 1 missed a deadline before it served
    assert board.served() == {0: 2} and board.try_get("heal/serve/0") == b"2:n"
    board2, route2 = DictBoard(), HealRouter()
    _ask(board2, 2, "n")
    route2(board2, {0, 1}, (1,))
    _ask(board2, 1, "m")  # island 1 died and asks for a heal itself
    route2(board2, {0, 1}, (1,))
    assert board2.served() == {0: 1} and board2.keys("heal/want/") == ["heal/want/2"]


# ------------------------------------------------------------ errors and the runtime


def test_the_private_runtime_is_one_function_and_takes_the_boards_arguments():
    # Every use of JAX's private API goes through `board.runtime`.
    import ast
    import pathlib

    root = pathlib.Path(sdiloco.__file__).parent
    private = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(n.startswith("jax._src") for n in names):
                private.append(path.relative_to(root).as_posix())
    assert private == ["distributed/board.py"], private
    runtime = board_lib.runtime()
    client = runtime.get_distributed_runtime_client.__doc__
    service = runtime.get_distributed_runtime_service.__doc__
    for arg in ("init_timeout", "heartbeat_timeout", "shutdown_on_destruction"):
        assert f"{arg}:" in client, arg
    for arg in ("heartbeat_timeout", "recoverable"):
        assert f"{arg}:" in service, arg
    names = {"blocking_key_value_get_bytes", "key_value_set_bytes", "key_value_delete"}
    assert names <= set(dir(runtime.DistributedRuntimeClient))


class _Failing(Board):
    """A board whose runtime raises `error` on every call."""

    def __init__(self, error):  # pyright: ignore[reportMissingSuperCall]
        self.node, self.error = 2, error

    def _fail(self, *args):
        raise self.error


@pytest.mark.parametrize(
    "error, kind, words",
    [
        ("UNAVAILABLE: failed to connect", BoardError, "the board is unreachable"),
        ("DEADLINE_EXCEEDED: deadline", BoardError, "the board is unreachable"),
        (
            "INVALID_ARGUMENT: Protobuf is too large to be serialized",
            board_lib.BoardProtocolError,
            "the board refused put 'msg/1-0/2'",
        ),
        ("no status at all", board_lib.BoardProtocolError, "the board refused put"),
    ],
)
def test_errors_are_named_for_what_they_are(error, kind, words):
    board = _Failing(RuntimeError(error))
    with pytest.raises(BoardError) as caught:
        board._call("put", "msg/1-0/2", board._fail)
    assert type(caught.value) is kind
    assert words in str(caught.value) and "node 2" in str(caught.value)
    if kind is board_lib.BoardProtocolError:
        assert "unreachable" not in str(caught.value)


def test_malformed_values_are_protocol_errors_naming_the_key():
    with pytest.raises(board_lib.BoardProtocolError, match="'members/4-1' holds"):
        board_lib._ints(b"0,x", "members/4-1")
    board = DictBoard()
    board.put("heal/serve/0", b"garbage")
    with pytest.raises(board_lib.BoardProtocolError, match="heal/serve/0 holds"):
        board_lib.serve_heals(board, 0, {"x": np.zeros(2)})
