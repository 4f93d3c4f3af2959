"""Bytes between the programs of an elastic job: a key-value store served over TCP.

The elastic job's programs (a coordinator and one process per replica island) share
nothing but a network, so everything they tell each other is a value under a key in
a `Store`, served by a `Server` to `Connection`s: the coordinator's store is the
job's board (control: who arrived, who is a member, who heals whom, and one copy of
every message), and each island keeps a store of its own, read-only to the others,
from which its peers fetch its messages and its heals (`fetch`).

Written on the standard library alone, for three reasons. A value of any size
crosses: it travels as a stream of chunks of `chunk_bytes`, written in place into
one buffer on the other side, where JAX's coordination service refuses a value
above 2 GiB (one protobuf). Its failures are ours to name: a dead peer is a closed
connection, a cut link a reply that makes no progress, a server that refuses a
request an `ERROR` reply with its reason; JAX's client instead aborts its process
with a C++ stack trace when it loses its service. And liveness follows the
connections: a process that dies closes its sockets at once, so the store knows
(`Store.live`) without waiting out a heartbeat.

The protocol, one request then one reply at a time on a connection:

    request: op (1 byte), wait_s (float64), key bytes (uint32), value bytes (uint64),
             the key (UTF-8), the value
    reply:   status (1 byte: OK, MISSING or ERROR), value bytes (uint64), the value

`GET` waits up to `wait_s` for the key to be put; `ITEMS` answers every key under a
prefix with its value; `DELETE_IF` deletes a key only while it holds the value sent
(a reader clears what it read, never a value put after it read); `HELLO` names the
node on the other end of the connection.
"""

import socket
import socketserver
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any


PUT, GET, ITEMS, DELETE, HELLO, DELETE_IF = 1, 2, 3, 4, 5, 6
OK, MISSING, ERROR = 0, 1, 2
CHUNK = 4 << 20
"""Default bytes per chunk of a value on the wire (4 MiB)."""

_REQUEST = struct.Struct("!BdIQ")
_REPLY = struct.Struct("!BQ")
_ITEM = struct.Struct("!IQ")
_MAX_KEY = 4096


class RequestRefused(ValueError):
    """The other end answered `ERROR`: the request breaks the protocol (a key too
    long, a write to a read-only store, an unknown operation)."""


class Store:
    """Values under keys, with waiting readers, and the nodes connected to it.

    Keys are paths (`msg/12-0/2`); deleting a key deletes every key under it, as
    JAX's store does. Every change wakes the readers waiting for a key and those
    waiting for any change (`wait_change`: the coordinator's loop).
    """

    def __init__(self):
        self._dirs: dict[str, dict[str, tuple[Any, float]]] = {}  # by first segment
        self._cond = threading.Condition()
        self._version = 0
        self._open: dict[int, int] = {}  # node -> open connections
        self._seen: dict[int, float] = {}  # node -> time of its last request

    def put(self, key: str, value: Any) -> None:
        with self._cond:
            self._dir(key)[key] = (value, time.monotonic())
            self._changed()

    def get(self, key: str, wait_s: float = 0.0) -> Any | None:
        """The value of `key`, waiting up to `wait_s` for it; None if it is not."""
        with self._cond:
            if wait_s > 0:
                self._cond.wait_for(lambda: key in self._dir(key), timeout=wait_s)
            found = self._dir(key).get(key)
            return None if found is None else found[0]

    def items(self, prefix: str) -> list[tuple[str, Any]]:
        with self._cond:
            return [
                (k, v)
                for k, (v, _) in self._dir(prefix).items()
                if k.startswith(prefix)
            ]

    def delete(self, key: str) -> None:
        """Delete `key` and every key under it (`key/...`)."""
        below = key if key.endswith("/") else key + "/"
        with self._cond:
            values = self._dir(key)
            for k in [k for k in values if k == key or k.startswith(below)]:
                del values[k]
            self._changed()

    def delete_if(self, key: str, value: Any) -> bool:
        """Delete `key` only if it holds `value` (bytes-equal); whether it did. One
        who read a key clears it so without erasing a value put since."""
        with self._cond:
            values = self._dir(key)
            found = values.get(key)
            if found is None or bytes(found[0]) != bytes(value):
                return False
            del values[key]
            self._changed()
            return True

    def prune(self, prefix: str, older_s: float) -> None:
        """Delete the keys under `prefix` put more than `older_s` seconds ago."""
        cut = time.monotonic() - older_s
        with self._cond:
            values = self._dir(prefix)
            for k in [k for k, (_, at) in values.items() if k.startswith(prefix)]:
                if values[k][1] < cut:
                    del values[k]

    def wait_change(self, since: int, timeout_s: float) -> int:
        """Wait until the store changed after version `since` (or `timeout_s`);
        returns the version now."""
        with self._cond:
            self._cond.wait_for(lambda: self._version != since, timeout=timeout_s)
            return self._version

    def live(self, within_s: float) -> set[int]:
        """The nodes with a connection open that made a request within `within_s`
        seconds: a dead process closed its connections, a stopped or cut-off one
        has been silent."""
        now = time.monotonic()
        with self._cond:
            return {
                n
                for n, count in self._open.items()
                if count > 0 and now - self._seen.get(n, -1e9) <= within_s
            }

    def _dir(self, key: str) -> dict[str, tuple[Any, float]]:
        """The keys that share `key`'s first path segment (a listing scans only
        those: the coordinator lists a few small directories many times a second
        beside the many keys of the rounds)."""
        return self._dirs.setdefault(key.split("/", 1)[0], {})

    def _changed(self) -> None:
        self._version += 1
        self._cond.notify_all()

    def _connected(self, node: int, change: int) -> None:
        with self._cond:
            self._open[node] = self._open.get(node, 0) + change
            self._seen[node] = time.monotonic()

    def _heard(self, node: int | None) -> None:
        if node is not None:
            self._seen[node] = time.monotonic()


class Server:
    """Serve `store` on `address` (`host:port`; port 0 picks a free one), from one
    thread per connection. With `read_only`, only `GET` and `ITEMS` are answered.

    `address` afterwards holds the address bound; `close` stops serving and closes
    every connection."""

    def __init__(
        self,
        store: Store,
        address: str,
        *,
        read_only: bool = False,
        chunk_bytes: int = CHUNK,
    ):
        host, port = split_address(address)
        handler = type(
            "Handler",
            (_Handler,),
            {"store": store, "read_only": read_only, "chunk": chunk_bytes},
        )
        self._server = _ThreadingServer((host, port), handler)
        self.address = f"{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="sdiloco-net-server",
            daemon=True,
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._server.close_connections()


class Connection:
    """One client connection to a `Server`: `request` sends one request and reads
    its reply. `node` (an int) is announced with `HELLO`, so the server counts this
    process live while the connection is open.

    `progress_s` bounds how long any part of a transfer may make no progress (a
    cut link, a stopped server): past it, `socket.timeout` (an `OSError`).
    `reply_s` (default `progress_s`) bounds connecting and the wait for the first
    byte of a reply (after the server's own wait)."""

    def __init__(
        self,
        address: str,
        *,
        node: int | None = None,
        progress_s: float = 5.0,
        chunk_bytes: int = CHUNK,
        reply_s: float | None = None,
    ):
        self.chunk, self.progress_s = chunk_bytes, progress_s
        self.reply_s = progress_s if reply_s is None else reply_s
        self.sock = socket.create_connection(split_address(address), self.reply_s)
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if node is not None:
                self.request(HELLO, str(node))
        except BaseException:  # a HELLO unanswered in time: no socket left open
            self.sock.close()
            raise

    def request(
        self,
        op: int,
        key: str,
        value: Any = b"",
        wait_s: float = 0.0,
        into: Any = None,
    ) -> tuple[int, Any]:
        """Send one request; returns `(status, value)`. An `ERROR` reply raises
        `RequestRefused` with the server's reason. A reply of exactly the size of
        the writable buffer `into` is read in place into it (and `into` returned)."""
        data = memoryview(value).cast("B")
        head = _REQUEST.pack(op, wait_s, len(key.encode()), data.nbytes)
        self.sock.settimeout(self.progress_s)
        self.sock.sendall(head + key.encode())
        send_chunks(self.sock, data, self.chunk)
        self.sock.settimeout(wait_s + self.reply_s)  # the server may wait first
        status, size = _REPLY.unpack(recv_exact(self.sock, _REPLY.size, self.chunk))
        self.sock.settimeout(self.progress_s)
        if status == OK and into is not None and memoryview(into).nbytes == size:
            recv_into_exact(self.sock, memoryview(into).cast("B"), self.chunk)
            return status, into
        reply = recv_exact(self.sock, size, self.chunk)
        if status == ERROR:
            raise RequestRefused(reply.decode(errors="replace"))
        return status, reply

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class Depot:
    """An island's offers to its peers: a `Store` they can only read, served on an
    ephemeral port of every interface. `address` is where peers reach it
    (`advertise`, the host this island's board connection leaves from)."""

    def __init__(self, advertise: str, *, chunk_bytes: int = CHUNK):
        self.store = Store()
        self._server = Server(
            self.store, "0.0.0.0:0", read_only=True, chunk_bytes=chunk_bytes
        )
        self.address = f"{advertise}:{self._server.address.rsplit(':', 1)[1]}"

    def offer(self, key: str, value: Any) -> None:
        self.store.put(key, value)

    def prune(self, prefix: str, older_s: float) -> None:
        self.store.prune(prefix, older_s)

    def close(self) -> None:
        self._server.close()


def fetch(
    address: str,
    key: str,
    *,
    wait_s: float = 0.0,
    progress_s: float = 5.0,
    chunk_bytes: int = CHUNK,
    into: Any = None,
    reply_s: float | None = None,
) -> Any:
    """The value of `key` at the server `address` (waiting up to `wait_s` for it to
    be put there), or None if it is not there; read into `into` when it has the
    value's size (see `Connection.request`). Connection failures raise `OSError`."""
    conn = Connection(
        address, progress_s=progress_s, chunk_bytes=chunk_bytes, reply_s=reply_s
    )
    try:
        status, value = conn.request(GET, key, wait_s=wait_s, into=into)
    finally:
        conn.close()
    return value if status == OK else None


def encode_items(items: list[tuple[str, Any]]) -> bytes:
    """`ITEMS`' reply: each key and value, length-prefixed."""
    parts = []
    for k, v in items:
        key, value = k.encode(), bytes(v)
        parts += [_ITEM.pack(len(key), len(value)), key, value]
    return b"".join(parts)


def decode_items(blob: bytes | bytearray) -> list[tuple[str, bytes]]:
    out, at, view = [], 0, memoryview(blob)
    while at < len(view):
        k, v = _ITEM.unpack_from(view, at)
        at += _ITEM.size
        key = bytes(view[at : at + k]).decode()
        out.append((key, bytes(view[at + k : at + k + v])))
        at += k + v
    return out


def split_address(address: str) -> tuple[str, int]:
    """`("host", port)` of `host:port`, or a `ValueError` naming it."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"address={address!r}; allowed: HOST:PORT, port 0 ... 65535.")
    return host, int(port)


def send_chunks(sock: socket.socket, data: memoryview, chunk: int) -> None:
    for start in range(0, data.nbytes, chunk):
        sock.sendall(data[start : start + chunk])


def recv_exact(sock: socket.socket, size: int, chunk: int) -> bytearray:
    """Exactly `size` bytes, read in place in chunks; `ConnectionError` at an early
    end of the stream."""
    buf = bytearray(size)
    recv_into_exact(sock, memoryview(buf), chunk)
    return buf


def recv_into_exact(sock: socket.socket, view: memoryview, chunk: int) -> None:
    """Fill `view` from the stream, in chunks."""
    at, size = 0, view.nbytes
    while at < size:
        got = sock.recv_into(view[at : at + chunk])
        if not got:
            raise ConnectionError(f"the peer closed the connection ({at}/{size} B)")
        at += got


# ----------------------------------------------------------------------------- helpers


class _ThreadingServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, *args: Any):
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        super().__init__(*args)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        with self._lock:
            self._sockets.add(request)
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._sockets.discard(request)

    def close_connections(self) -> None:
        with self._lock:
            for s in list(self._sockets):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class _Handler(socketserver.BaseRequestHandler):
    """One connection: requests answered in turn until the peer closes it."""

    store: Store
    read_only: bool
    chunk: int

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        node = None
        try:
            for op, key, value, wait_s in self._requests(sock):
                self.store._heard(node)
                if op == HELLO and key.lstrip("-").isdigit() and node is None:
                    node = int(key)
                    self.store._connected(node, +1)
                    self._reply(sock, OK, b"")
                    continue
                self._reply(sock, *self._answer(op, key, value, wait_s))
        except OSError:
            pass  # the peer is gone; its requests end with it
        finally:
            if node is not None:
                self.store._connected(node, -1)

    def _requests(self, sock: socket.socket) -> Iterator[tuple[int, str, Any, float]]:
        while True:
            try:
                head = recv_exact(sock, _REQUEST.size, self.chunk)
            except ConnectionError:
                return
            op, wait_s, key_size, size = _REQUEST.unpack(head)
            if key_size > _MAX_KEY:
                self._reply(sock, ERROR, f"a key of {key_size} bytes; allowed: <= 4096")
                return
            key = recv_exact(sock, key_size, self.chunk).decode(errors="replace")
            yield op, key, recv_exact(sock, size, self.chunk), wait_s

    def _answer(self, op: int, key: str, value: Any, wait_s: float) -> tuple:
        store = self.store
        if self.read_only and op not in (GET, ITEMS):
            return ERROR, f"op {op} on a read-only store; allowed: GET, ITEMS"
        if op == PUT:
            store.put(key, value)
            return OK, b""
        if op == GET:
            found = store.get(key, wait_s)
            return (MISSING, b"") if found is None else (OK, found)
        if op == ITEMS:
            return OK, encode_items(store.items(key))
        if op == DELETE:
            store.delete(key)
            return OK, b""
        if op == DELETE_IF:
            return (OK if store.delete_if(key, value) else MISSING), b""
        return ERROR, f"op {op}; allowed: PUT, GET, ITEMS, DELETE, DELETE_IF, HELLO"

    def _reply(self, sock: socket.socket, status: int, value: Any) -> None:
        data = value.encode() if isinstance(value, str) else value
        view = memoryview(data).cast("B")
        sock.sendall(_REPLY.pack(status, view.nbytes))
        send_chunks(sock, view, self.chunk)
