"""The islands' posted exchange (`posted_exchange(island=...)`) moved by a `Courier`
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

import ast
import gc
import pathlib
import socket
import sys
import threading
import time
import warnings

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
    wait_until,
)
from hypothesis import given, settings, strategies as st

import sdiloco
from sdiloco import distributed
from sdiloco.distributed import board as board_lib, net
from sdiloco.distributed.board import Board, BoardError
from sdiloco.distributed.coordinator import BoardServer, Coordinator, HealRouter


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
        toy_streaming(params, num_replicas=1, exchange=_island(m), **kw)
        for m in range(M)
    ]
    couriers = [
        distributed.Courier(alg, transport=board.transport(m), timeout=60.0)
        for m, alg in enumerate(algs)
    ]
    return algs, couriers


def _island(m):
    return distributed.posted_exchange(island=(m, M))


def _train_islands(params, batches, board, **kw):
    """Each island steps in a thread of its own, as in its own process (with τ = 0
    it waits for the others between the halves of the step that sends)."""
    algs, couriers = _islands(params, board, **kw)
    states = [alg.init(params) for alg in algs]

    def run(m):
        for batch in batches:
            one = jax.tree.map(lambda x: x[m : m + 1], batch)
            states[m], _ = couriers[m](states[m], one)
        couriers[m].close()

    threads = [threading.Thread(target=run, args=(m,)) for m in range(M)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
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


@pytest.mark.parametrize("tau", [1, 0])
def test_islands_train_the_simulated_run(tau):
    # With τ = 0 (DiLoCo) too: the round between the halves of the sending step.
    params = toy_params(jr.key(5))
    batches = toy_batches(jr.key(6), steps=14, replicas=M)
    board = MemoryBoard()
    states = _train_islands(params, batches, board, overlap=tau)
    for state in states[1:]:  # the same members' bytes, the same mean: bitwise
        assert_trees_equal(state.global_params, states[0].global_params)
    simulated = _simulate(params, batches, overlap=tau)
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
    alg = toy_streaming(params, num_replicas=1, exchange=_island(0))

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
    alg = toy_streaming(params, num_replicas=1, exchange=_island(0))
    mesh = distributed.replica_mesh(1, jax.devices()[:1])
    with pytest.raises(ValueError, match="transport= with a mesh"):
        distributed.Courier(alg, mesh, mesh, transport=lambda *a: a[0])
    with pytest.raises(ValueError, match="replica=3"):
        _island(3)
    with pytest.raises(ValueError, match="carries one replica"):
        two = toy_streaming(params, num_replicas=2, exchange=_island(0))
        two.step(two.init(params), toy_batches(jr.key(6), steps=1, replicas=2)[0])


class DictBoard:
    """The coordinator's view of the board's keys, in a dict (no server)."""

    def __init__(self):
        self.kv: dict[str, bytes] = {}

    def put(self, key, value):
        self.kv[key] = value

    def try_get(self, key):
        return self.kv.get(key)

    def delete(self, key):
        for k in [k for k in self.kv if k == key or k.startswith(key + "/")]:
            del self.kv[k]

    def delete_if(self, key, value):
        if self.kv.get(key) != value:
            return False
        del self.kv[key]
        return True

    def items(self, prefix):
        return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]

    def keys(self, prefix):
        return [k for k, _ in self.items(prefix)]

    def served(self):
        """peer -> asker of every request routed to a peer (its mail `serve`) and
        not yet read by it."""
        return {
            int(k.split("/")[1]): int(v.decode().split(":")[0])
            for k, v in self.kv.items()
            if k.startswith("to/") and k.endswith("/serve")
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
    board.delete("to/0/serve")  # island 0 reads its mail between two steps ...
    route(board, live, recent)
    assert board.served() == {}  # ... and serves island 1, which has not got it yet
    board.put("heal/got/1/a", b"1")  # island 1 got the state: island 0 is free
    route(board, live, recent)
    assert board.served() == {0: 2}
    assert board.try_get("to/0/serve") == b"2:b"


def test_a_request_routed_to_a_peer_that_dies_or_returns_is_routed_again():
    board, route = DictBoard(), HealRouter()
    _ask(board, 2, "n")
    route(board, {0, 1}, (1,))  # island 0 was left out of the latest round
    assert board.served() == {1: 2}  # the latest round's member first
    route(board, {0}, (0,))  # island 1 died before it served (or missed a deadline)
    assert board.served() == {0: 2} and board.try_get("to/0/serve") == b"2:n"
    board2, route2 = DictBoard(), HealRouter()
    _ask(board2, 2, "n")
    route2(board2, {0, 1}, (1,))
    _ask(board2, 1, "m")  # island 1 died and asks for a heal itself
    route2(board2, {0, 1}, (1,))
    assert board2.served() == {0: 1} and board2.keys("heal/want/") == ["heal/want/2"]
    board3, route3 = DictBoard(), HealRouter()
    _ask(board3, 2, "n")
    route3(board3, {0, 1}, (1,))
    board3.delete("to/1/serve")  # island 1 serves; island 2's fetch then fails,
    _ask(board3, 2, "n2")  # so it asks again with a new nonce
    route3(board3, {0, 1}, (1,))
    assert board3.served() == {1: 2} and board3.try_get("to/1/serve") == b"2:n2"


def test_a_request_put_again_while_the_router_reads_is_routed_next_time():
    # Island 2 asks again (a new nonce) between the router's reading of the requests
    # and its clearing of the one it routes: the new request must stay, and the next
    # call route it, not leave island 2 waiting for a heal with its old nonce.
    board, route = DictBoard(), HealRouter()
    listed = board.items

    def items_then_a_new_request(prefix):
        found = listed(prefix)
        if prefix == "heal/want/" and found and not again:
            again.append(_ask(board, 2, "n2"))
        return found

    again: list = []
    board.items = items_then_a_new_request
    _ask(board, 2, "n")
    route(board, {0, 1}, (1,))
    assert again and board.try_get("to/1/serve") == b"2:n"  # the request it read
    assert board.try_get("heal/want/2") == b"n2"  # the new one stays
    route(board, {0, 1}, (1,))
    assert board.served() == {1: 2} and board.try_get("to/1/serve") == b"2:n2"
    assert board.keys("heal/want/") == []


# ---------------------------------------------------------- the board over TCP


def test_no_module_imports_private_jax():
    # The board is the standard library's TCP: nothing of JAX's private API.
    root = pathlib.Path(sdiloco.__file__).parent
    private = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            private += [path.name for n in names if n.startswith("jax._src")]
    assert private == []


@pytest.fixture
def server():
    board = BoardServer("127.0.0.1:0", heartbeat_s=2.0)
    board.linger_s = 0.0
    yield board
    board.close()


def _client(server, node, **kw):
    address = "127.0.0.1:" + server.address.rsplit(":", 1)[1]
    return Board(address, node, **{"heartbeat_s": 2.0, **kw})


def test_values_larger_than_a_chunk_cross_whole(server):
    sender, reader = _client(server, 1, chunk_bytes=1024), _client(server, 2)
    message = np.random.default_rng(0).integers(0, 256, 100_003, np.uint8)
    try:
        sender.put("msg/3-1/0", message)  # ~98 chunks of 1 KiB
        got = reader.get("msg/3-1/0", timeout_s=5.0)
        assert np.array_equal(np.frombuffer(got, np.uint8), message)
        assert reader.keys("msg/") == ["msg/3-1/0"]
        reader.delete("msg/3-1")
        assert reader.try_get("msg/3-1/0") is None
        assert server.live() == {0, 1}  # replica m is node m + 1
    finally:
        sender.close()
        reader.close()


def test_errors_are_named_for_what_they_are(server):
    board = _client(server, 1, heartbeat_s=1.0)
    with pytest.raises(BoardError, match="'members/1-0' not on the board within 0.3"):
        board.get("members/1-0", timeout_s=0.3)
    depot = net.Depot("127.0.0.1")
    refused = Board(depot.address, 2, heartbeat_s=1.0)  # read-only: a protocol error
    with pytest.raises(board_lib.BoardProtocolError) as error:
        refused.put("msg/1-0/1", b"x")
    assert "refused put 'msg/1-0/1'" in str(error.value)
    assert "read-only" in str(error.value) and "lost" not in str(error.value)
    refused.close()
    depot.close()
    server._server.close()  # the coordinator is gone
    start = time.monotonic()
    with pytest.raises(board_lib.BoardLost) as lost:
        board.put("arrived/1-0/0", b"1")
    assert 0.9 < time.monotonic() - start < 5
    line = str(lost.value)
    assert "lost the board" in line and "start the same command again" in line
    assert len(line.splitlines()) == 1
    board.close()


def test_malformed_values_are_protocol_errors_naming_the_key():
    with pytest.raises(board_lib.BoardProtocolError, match="'members/4-1' holds"):
        board_lib._ints(b"0,x", "members/4-1")
    with pytest.raises(board_lib.BoardProtocolError, match="a heal request b'garb"):
        board_lib.serve_heal(DictBoard(), net.Depot("127.0.0.1"), b"garbage", {})


def _serve_when_asked(board, depot, state, stop):
    """An island's loop, reduced to its mail: serve every heal it is asked for."""
    while not stop.is_set():
        mail = board.take_mail()
        if "serve" in mail:
            board_lib.serve_heal(board, depot, mail["serve"], state)
        time.sleep(0.02)


def _heal_job(server, states, chunk):
    """Islands 0 ... n-1 serving `states`, and a router thread: `(boards, depots,
    stop)`."""
    boards = [_client(server, m + 1, mailbox=f"to/{m}/") for m in range(len(states))]
    depots = [net.Depot("127.0.0.1", chunk_bytes=chunk) for _ in states]
    stop = threading.Event()
    route = HealRouter()

    def router():
        while not stop.is_set():
            route(server, server.live() - {len(states)}, (0,))
            time.sleep(0.01)

    threads = [threading.Thread(target=router, daemon=True)] + [
        threading.Thread(target=_serve_when_asked, args=(b, d, s, stop), daemon=True)
        for b, d, s in zip(boards, depots, states)
    ]
    for t in threads:
        t.start()
    return boards, depots, stop


def test_a_heal_larger_than_a_chunk_crosses_from_the_peer(server):
    state = {"w": np.arange(30_000, dtype=np.float32), "step": np.array(7)}
    (peer,), depots, stop = _heal_job(server, [state], chunk=1024)
    asker = _client(server, 2, chunk_bytes=1024)
    try:
        template = jax.tree.map(np.zeros_like, state)
        healed, size = board_lib.request_heal(asker, 1, template, timeout_s=20.0)
        assert size > 100 * 1024  # more than a hundred chunks
        assert_trees_equal(healed, state)
        # the request and its answer are gone: the router deletes `heal/got` at its
        # next poll (every 10 ms), which can come just after the asker returns
        wait_until(lambda: not server.keys("heal/"), timeout=5)
        assert server.keys("heal/") == []
    finally:
        stop.set()
        for b in (peer, asker):
            b.close()
        depots[0].close()


def test_a_connection_whose_hello_goes_unanswered_closes_its_socket(monkeypatch):
    # A board's server too busy to answer a HELLO within `reply_s` (a loaded
    # machine): the connection is refused with `OSError`, and its socket closed,
    # not left for the garbage collector (a `ResourceWarning` later, elsewhere).
    dropped = []
    monkeypatch.setattr(sys, "unraisablehook", dropped.append)
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        with warnings.catch_warnings():
            warnings.simplefilter("error", ResourceWarning)
            with pytest.raises(OSError):
                net.Connection(address, node=1, progress_s=0.2)
            gc.collect()
    assert not [u.exc_value for u in dropped], [u.exc_value for u in dropped]


def test_a_heal_is_routed_again_as_soon_as_its_peer_is_gone(server):
    states = [{"w": np.full(8, float(m), np.float32)} for m in range(2)]
    boards, depots, stop = _heal_job(server, states, chunk=1024)
    boards[0].mailbox = "nobody/"  # island 0 never reads its mail: it is dying
    asker = _client(server, 3)
    try:
        result = {}
        thread = threading.Thread(
            target=lambda: result.update(
                zip("sb", board_lib.request_heal(asker, 2, states[0], timeout_s=30.0))
            )
        )
        start = time.monotonic()
        thread.start()
        # routed to island 0, the latest round's member
        wait_until(lambda: server.try_get("to/0/serve") is not None, timeout=10)
        boards[0].close()  # its process ends: its connections close
        thread.join(timeout=30)
        assert np.array_equal(result["s"]["w"], states[1]["w"])  # served by island 1
        assert time.monotonic() - start < 5  # not a grace window or a heartbeat later
    finally:
        stop.set()
        for b in [*boards, asker]:
            b.close()
        for d in depots:
            d.close()


def test_an_island_that_finished_serves_heals_until_the_end(server):
    # Island 0 has taken its last step; island 1, told it is behind, asks for a heal:
    # the finished island serves its final state, then leaves when the coordinator
    # says every island is done (`end`), not before.
    final = {"w": np.arange(64, dtype=np.float32), "step": np.array(40)}
    board = _client(server, 1, mailbox="to/0/")
    depot = net.Depot("127.0.0.1", chunk_bytes=1024)
    transport = board_lib.BoardTransport(board, 0, 2, depot=depot, timeout_s=30.0)
    transport._say = lambda text: None
    asker = _client(server, 2)
    stop, route = threading.Event(), HealRouter()

    def router():
        while not stop.is_set():
            route(server, server.live(), (0,))
            time.sleep(0.01)

    lingering = threading.Thread(target=transport.serve_until_end, args=(final,))
    routing = threading.Thread(target=router, daemon=True)
    try:
        lingering.start()
        routing.start()
        template = jax.tree.map(np.zeros_like, final)
        healed, size = board_lib.request_heal(asker, 1, template, timeout_s=20.0)
        assert_trees_equal(healed, final)
        # counted once `serve_heal` has returned
        wait_until(lambda: transport.served != 0, timeout=5)
        assert transport.served == size > 0
        time.sleep(0.3)
        assert lingering.is_alive()  # the job is not over: it stays
        server.put(board_lib.Keys.END, b"1")
        lingering.join(timeout=5)
        assert not lingering.is_alive()
    finally:
        stop.set()
        server.put(board_lib.Keys.END, b"1")
        lingering.join(timeout=5)
        for b in (board, asker):
            b.close()
        transport.close()
        depot.close()


def test_a_heal_that_cannot_be_served_is_one_line_and_the_island_goes_on(server):
    # A serve request that does not parse: between steps and after the last step,
    # the island says so in one line, serves nothing and keeps going.
    state = {"w": np.arange(8, dtype=np.float32), "step": np.array(3)}
    board = _client(server, 1, mailbox="to/0/")
    depot = net.Depot("127.0.0.1")
    transport = board_lib.BoardTransport(board, 0, 2, depot=depot, timeout_s=30.0)
    lines = []
    transport._say = lines.append

    def failed(request):
        return (
            f"a heal it served failed: a heal request {request!r}; "
            "allowed: '<replica>:<nonce>'."
        )

    lingering = threading.Thread(target=transport.serve_until_end, args=(state,))
    try:
        server.put(board_lib.Keys.mail(0, "serve"), b"nonsense")
        wait_until(lambda: "serve" in board.mail, timeout=5)
        assert transport.between_steps(state, None) is state
        assert lines == [failed(b"nonsense")] and transport.served == 0
        lingering.start()
        # another request: the same bytes again would be the same letter (the mailbox
        # clears what it read, `net.DELETE_IF`), which may be read once
        server.put(board_lib.Keys.mail(0, "serve"), b"gibberish")
        wait_until(lambda: len(lines) == 2, timeout=5)
        assert lingering.is_alive()  # still serving until the end
        server.put(board_lib.Keys.END, b"1")
        lingering.join(timeout=5)
        assert not lingering.is_alive()
        assert lines == [failed(b"nonsense"), failed(b"gibberish")]
        assert transport.served == 0
    finally:
        server.put(board_lib.Keys.END, b"1")
        if lingering.ident is not None:  # started
            lingering.join(timeout=5)
        board.close()
        transport.close()
        depot.close()


def test_a_letter_put_while_the_mailbox_is_read_is_not_lost(server):
    # The heartbeat lists the mailbox, then clears what it read. A second request put
    # between the two (here: at once after the listing) must stay for the next beat,
    # not be cleared with the first (a lost heal request left a test waiting).
    store, mailbox = server.store, "to/0/"
    listed = store.items

    def items_then_a_new_letter(prefix):
        found = listed(prefix)
        if prefix == mailbox and found and not late:
            late.append(store.put(mailbox + "serve", b"1:second"))
        return found

    late: list = []
    store.items = items_then_a_new_letter
    board = _client(server, 1, mailbox=mailbox)
    try:
        store.put(mailbox + "serve", b"1:first")
        got = []
        wait_until(
            lambda: got.append(board.take_mail().get("serve")) or b"1:second" in got,
            timeout=5,
        )
        assert late and got[-1] == b"1:second", got
        wait_until(lambda: not store.items(mailbox), timeout=5)
        assert store.items(mailbox) == []  # and each was cleared once read
    finally:
        board.close()


def test_delete_if_clears_only_the_value_read():
    store = net.Store()
    store.put("to/0/serve", b"a")
    assert not store.delete_if("to/0/serve", b"b")  # put since: stays
    assert store.get("to/0/serve") == b"a"
    assert store.delete_if("to/0/serve", bytearray(b"a"))
    assert store.get("to/0/serve") is None
    assert not store.delete_if("to/0/serve", b"a")  # nothing left to clear


def test_a_board_clears_a_key_only_while_it_holds_what_was_read(server):
    board = _client(server, 1)
    try:
        board.put("to/0/serve", b"a")
        assert not board.delete_if("to/0/serve", b"b")
        assert board.try_get("to/0/serve") == b"a"
        assert board.delete_if("to/0/serve", b"a")
        assert board.try_get("to/0/serve") is None
    finally:
        board.close()


def test_the_coordinator_says_end_only_when_every_island_is_done():
    board, c = _coordinator()
    for m in range(2):
        board.put(board_lib.Keys.island("done", m), b"1")
    assert not c.finished() and board.try_get(board_lib.Keys.END) is None
    polls = iter(range(20))
    c.run(lambda: next(polls, None) is None, poll_s=0.0)  # stopped with 2 of 3 done
    assert board.try_get(board_lib.Keys.END) == b"1"  # a stopped job ends too
    board, c = _coordinator()
    for m in range(3):
        board.put(board_lib.Keys.island("done", m), b"1")
    c.run(lambda: False, poll_s=0.0)  # returns: every island is done
    assert board.try_get(board_lib.Keys.END) == b"1"


def test_a_failed_heal_transfer_leaves_the_depot_serving():
    depot = net.Depot("127.0.0.1", chunk_bytes=1024)
    blob = np.arange(1 << 20, dtype=np.uint8)
    depot.offer("heal/2/1", blob)
    host, port = net.split_address(depot.address)
    for _ in range(3):  # a peer that asks, reads a little, and dies
        sock = socket.create_connection((host, port))
        key = b"heal/2/1"
        sock.sendall(net._REQUEST.pack(net.GET, 0.0, len(key), 0) + key)
        sock.recv(100)
        sock.close()
    got = net.fetch(depot.address, "heal/2/1", chunk_bytes=4096)
    assert got is not None and np.array_equal(np.frombuffer(got, np.uint8), blob)
    depot.close()


# ---------------------------------------------------------------- the coordinator


def _coordinator(grace=4.0):
    board = DictBoard()
    c = Coordinator(board, 3, grace_s=grace, start_s=0.0)
    for m in range(3):
        board.put(f"hello/{m}", b"1")
    c.greet()
    return board, c


def _arrive(board, name, *ms):
    for m in ms:
        board.put(f"arrived/{name}/{m}", b"1")


def test_a_late_island_is_waited_for_again_only_when_about_one_round_behind():
    board, c = _coordinator(grace=4.0)
    _arrive(board, "6-0", 0, 2)
    c.decide(now=0.0)
    assert "members/6-0" not in board.kv  # waits for island 1
    c.decide(now=4.1)  # the grace deadline: on without it
    assert board.kv["members/6-0"] == b"0,2" and c.expected == {0, 2}
    _arrive(board, "6-0", 1)  # late by 0.9 s: it is about one round behind
    c.decide(now=5.0)
    assert c.expected == {0, 1, 2} and "to/1/behind" not in board.kv
    _arrive(board, "8-0", 0, 2)
    c.decide(now=5.1)
    c.decide(now=9.2)  # it did not make it after all: one more deadline
    assert c.decisions[-1].timed_out and c.expected == {0, 2}
    _arrive(board, "8-0", 1)  # late by 4.1 s >= grace: behind, told to heal
    c.decide(now=13.3)
    assert c.expected == {0, 2} and board.kv["to/1/behind"] == b"4.1"
    _arrive(board, "10-0", 0, 2)
    c.decide(now=13.4)  # no second grace window: decided at once
    assert board.kv["members/10-0"] == b"0,2" and not c.decisions[-1].timed_out
    board.put("hello/1", b"1")  # it healed from a peer and said hello
    c.greet()
    assert c.expected == {0, 1, 2}


def test_the_coordinator_frees_a_rounds_messages_once_every_member_read_them():
    board, c = _coordinator()
    _arrive(board, "6-0", 0, 1, 2)
    for m in range(3):
        board.put(f"msg/6-0/{m}", b"x")
    c.decide(now=0.0)
    for m in (0, 1):
        board.put(f"got/6-0/{m}", b"1")
    c.collect(now=0.1)
    assert len(board.keys("msg/6-0/")) == 3
    board.put("got/6-0/2", b"1")
    c.collect(now=0.2)
    assert board.keys("msg/") == [] and board.keys("got/") == []


def test_a_round_a_live_island_missed_stays_until_it_read_it():
    # Island 1 is alive but was left out of round 6-0 (late). The members may
    # finish and leave, depots and all, before it reads the round: the board's
    # copy stays until it has (or keep_s after the decision).
    board, c = _coordinator()
    c.live = lambda: {0, 1, 2}
    _arrive(board, "6-0", 0, 2)
    for m in (0, 2):
        board.put(f"msg/6-0/{m}", b"x")
    c.decide(now=0.0)
    c.decide(now=4.1)  # at the grace deadline, without island 1
    assert board.kv["members/6-0"] == b"0,2"
    for m in (0, 2):
        board.put(f"got/6-0/{m}", b"1")
    c.collect(now=5.0)
    assert len(board.keys("msg/6-0/")) == 2  # island 1 lives and has not read it
    board.put("got/6-0/1", b"1")
    c.collect(now=5.1)
    assert board.keys("msg/") == [] and board.keys("got/") == []
    # A live island that never reads a round (it healed past it): keep_s bounds it.
    _arrive(board, "12-0", 0, 2)
    board.put("msg/12-0/0", b"x")
    c.decide(now=10.0)
    c.decide(now=14.1)
    board.put("got/12-0/0", b"1")
    board.put("got/12-0/2", b"1")
    c.collect(now=15.0)
    assert board.keys("msg/12-0/") == ["msg/12-0/0"]
    c.collect(now=14.1 + c.keep_s + 0.1)
    assert board.keys("msg/") == []


# ------------------------------------------------------------------- the data plane


def _rounds_job(server, count, chunk):
    """`count` islands' boards, depots and `Rounds`, and the coordinator's loop in a
    thread (stopped by the event returned)."""
    boards = [_client(server, m + 1, chunk_bytes=chunk) for m in range(count)]
    depots = [net.Depot("127.0.0.1", chunk_bytes=chunk) for _ in range(count)]
    for m, d in enumerate(depots):
        boards[m].put(f"depot/{m}", d.address.encode())
    rounds = [
        board_lib.Rounds(b, d, m, count, timeout_s=20.0)
        for m, (b, d) in enumerate(zip(boards, depots))
    ]
    stop = threading.Event()
    c = Coordinator(server, count, grace_s=2.0, start_s=0.0, live=server.live)
    threading.Thread(target=c.run, args=(stop.is_set,), daemon=True).start()
    return boards, depots, rounds, stop, c


def _in_threads(fns):
    results: list = [None] * len(fns)

    def call(i):
        results[i] = fns[i]()

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


def test_a_round_moves_messages_peer_to_peer_with_one_copy_on_the_board(server):
    served = []
    get = server.store.get
    server.store.get = lambda key, wait_s=0.0: served.append(key) or get(key, wait_s)
    boards, depots, rounds, stop, c = _rounds_job(server, 3, chunk=1024)
    rng = np.random.default_rng(1)
    messages = [rng.integers(0, 256, 50_001, np.uint8) for _ in range(3)]
    try:
        outs = _in_threads(
            [lambda m=m: rounds[m]("6-0", messages[m]) for m in range(3)]
        )
        for out, members in outs:
            assert members == (0, 1, 2)
            assert np.array_equal(out, np.stack(messages))
        # The board received each message once and sent none: the peers did.
        assert not [k for k in served if k.startswith("msg/")]
        wait_until(lambda: not server.keys("msg/"), timeout=5)
        assert server.keys("msg/") == []  # every member read them: freed
        # A late reader (read only, as a healed island) reads the round from a
        # member's depot when the owner is gone.
        depots[2].close()
        late = board_lib.Rounds(boards[0], net.Depot("127.0.0.1"), 0, 3, timeout_s=5.0)
        out, _ = late("6-0", messages[0], post=False)
        assert np.array_equal(out, np.stack(messages))
    finally:
        stop.set()
        for x in [*rounds, *boards, *depots]:
            x.close()


def test_a_round_reads_a_dead_owners_message_from_the_boards_copy(server):
    boards, depots, rounds, stop, c = _rounds_job(server, 3, chunk=1024)
    messages = [np.full(20_000, m, np.uint8) for m in range(3)]
    try:
        boards[2].put("msg/6-0/2", messages[2])  # island 2 posts its message ...
        boards[2].put("arrived/6-0/2", b"1")
        depots[2].close()  # ... and dies before anyone fetched it from there
        outs = _in_threads(
            [lambda m=m: rounds[m]("6-0", messages[m]) for m in range(2)]
        )
        for out, members in outs:
            assert members == (0, 1, 2)
            assert np.array_equal(out, np.stack(messages))
    finally:
        stop.set()
        for x in [*rounds, *boards, *depots]:
            x.close()


def test_a_stopped_owner_is_passed_over_for_the_boards_copy(server):
    boards, depots, rounds, stop, c = _rounds_job(server, 3, chunk=1024)
    stopped = socket.socket()  # accepts connections, never answers: SIGSTOPped
    stopped.bind(("127.0.0.1", 0))
    stopped.listen(8)
    messages = [np.full(20_000, m, np.uint8) for m in range(3)]
    try:
        boards[2].put("depot/2", f"127.0.0.1:{stopped.getsockname()[1]}".encode())
        boards[2].put("msg/6-0/2", messages[2])
        boards[2].put("arrived/6-0/2", b"1")
        start = time.monotonic()
        outs = _in_threads(
            [lambda m=m: rounds[m]("6-0", messages[m]) for m in range(2)]
        )
        assert time.monotonic() - start < 4.0  # not a progress timeout or two
        for out, _ in outs:
            assert np.array_equal(out, np.stack(messages))
    finally:
        stop.set()
        stopped.close()
        for x in [*rounds, *boards, *depots]:
            x.close()
