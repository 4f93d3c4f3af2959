"""An emulated wide-area network: one Linux network namespace per worker.

Usage (as root, with iproute2):

    with Wan(2, rate_mbit=100, delay_ms=5) as wan:
        procs = [wan.popen(i, [sys.executable, "worker.py", ...]) for i in range(2)]

`Wan(n)` creates a bridge in a namespace of its own and n worker namespaces, each
joined to the bridge by a veth pair and given the address `10.<net>.0.<i+1>/24`. With a
`rate_mbit`, every worker's link is shaped in both directions (tc `tbf` on each end of
its veth pair, so a worker's upload and download are each limited); with a `delay_ms`,
netem adds that one-way latency on the worker's side (where the kernel has `sch_netem`;
otherwise asking for a delay is an error, never a silent zero). Inside worker i's
namespace the machine's host name resolves to the worker's own address (an
`/etc/netns/<namespace>/hosts` file, which `ip netns exec` mounts over `/etc/hosts`), so
libraries that find their address by host name, such as gloo, use the emulated link. Traffic never leaves the
namespaces this object creates, the host's interfaces and loopback are never touched,
and everything is deleted on exit, on an exception, on SIGTERM, and (atexit) if the
interpreter ends early. Every command it runs is bounded in time.

`available()` says whether this machine can run it (root, `ip` and `tc`, namespaces),
with the reason when not.
"""

import atexit
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence


_TIMEOUT_S = 10
_NETNS_ETC = pathlib.Path("/etc/netns")


def available() -> tuple[bool, str]:
    """`(True, "")`, or `(False, why)` when namespaces and tc cannot be used here."""
    if sys.platform != "linux":
        return False, f"needs Linux network namespaces (platform {sys.platform!r})"
    if os.geteuid() != 0:
        return False, "needs root to create network namespaces"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"needs iproute2's `{tool}` on PATH"
    name = f"sdwan-probe-{os.getpid()}"
    try:
        _run(["ip", "netns", "add", name])
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        return False, f"cannot create a network namespace: {e}"
    _run(["ip", "netns", "del", name], check=False)
    return True, ""


class Wan:
    """`num_workers` namespaces on one shaped bridge (see the module docstring).

    Attributes:
        num_workers: the workers.
        rate_mbit: each worker's link rate in Mbit/s in each direction (None: no limit).
        delay_ms: one-way latency added on each worker's link.
        burst_ms, min_burst: the token bucket's depth: `burst_ms` at the rate, at
            least `min_burst` bytes.
        queue_ms: the longest a packet may wait in the queue before it is dropped.
        queue_bytes: instead, the queue's size in bytes (a queue that holds a whole
            message never drops, so TCP is not slowed by losses at low rates).
    """

    def __init__(
        self,
        num_workers: int,
        *,
        rate_mbit: float | None = None,
        delay_ms: float = 0.0,
        net: int | None = None,
        burst_ms: float = 10.0,
        min_burst: int = 32768,
        queue_ms: float = 50.0,
        queue_bytes: int | None = None,
    ):
        if not isinstance(num_workers, int) or not 1 <= num_workers <= 200:
            raise ValueError(f"num_workers={num_workers!r}; must be in [1, 200].")
        if rate_mbit is not None and not rate_mbit > 0:
            raise ValueError(f"rate_mbit={rate_mbit!r}; must be > 0 or None.")
        if not delay_ms >= 0:
            raise ValueError(f"delay_ms={delay_ms!r}; must be >= 0.")
        if not burst_ms > 0 or not min_burst >= 1600:
            raise ValueError(
                f"burst_ms={burst_ms!r}, min_burst={min_burst!r}; allowed: "
                "burst_ms > 0 and min_burst >= 1600 bytes (one full frame)."
            )
        self.num_workers = num_workers
        self.rate_mbit = rate_mbit
        self.burst_ms, self.min_burst = burst_ms, min_burst
        self.queue_ms, self.queue_bytes = queue_ms, queue_bytes
        self.delay_ms = delay_ms
        self._tag = f"sdw{os.getpid() % 100000}"
        self._net = 77 if net is None else net
        self._namespaces: list[str] = []

    # ------------------------------------------------------------------ public

    def namespace(self, i: int) -> str:
        """The namespace of worker i."""
        return f"{self._tag}-w{i}"

    def ip(self, i: int) -> str:
        """Worker i's address."""
        return f"10.{self._net}.0.{i + 1}"

    def popen(self, i: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start `argv` inside worker i's namespace."""
        return subprocess.Popen(
            ["ip", "netns", "exec", self.namespace(i), *argv], **kwargs
        )

    def start(
        self, argv_of: Callable[[int], Sequence[str]], **kwargs
    ) -> list[subprocess.Popen]:
        """Start `argv_of(i)` in every worker's namespace, stdout and stderr
        captured together as text (`kwargs` go to `Popen`, e.g. `env`, `cwd`)."""
        return [
            self.popen(
                i,
                argv_of(i),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                **kwargs,
            )
            for i in range(self.num_workers)
        ]

    def set_rate(self, rate_mbit: float | None) -> None:
        """Change every link's rate (None: no limit) while the workers run."""
        if rate_mbit is not None and not rate_mbit > 0:
            raise ValueError(f"rate_mbit={rate_mbit!r}; must be > 0 or None.")
        if self.delay_ms:
            raise ValueError(
                "set_rate with delay_ms > 0 is not supported; build a new Wan."
            )
        bridge = f"{self._tag}-br"
        for i in range(self.num_workers):
            for ns, dev in ((self.namespace(i), "eth0"), (bridge, f"{self._tag}b{i}")):
                self._ns_quiet(ns, "tc", "qdisc", "del", "dev", dev, "root")
        self.rate_mbit = rate_mbit
        for i in range(self.num_workers):
            self._shape(self.namespace(i), "eth0", delay=True)
            self._shape(bridge, f"{self._tag}b{i}", delay=False)

    def set_link(self, i: int, *, up: bool) -> None:
        """Take worker i's link down (every packet to or from it is lost, its
        connections stay open) or bring it back up."""
        self._ns(self.namespace(i), "ip", "link", "set", "eth0", "up" if up else "down")

    def __enter__(self) -> "Wan":
        ok, why = available()
        if not ok:
            raise RuntimeError(f"cannot emulate a WAN here: {why}")
        atexit.register(self.close)
        # A SIGTERM (e.g. `timeout`, `kill`) ends the interpreter without running
        # atexit handlers; turn it into SystemExit so that `__exit__` tears down.
        if threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
                signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Delete every namespace (and so every veth) this object created."""
        for name in reversed(self._namespaces):
            _run(["ip", "netns", "del", name], check=False)
            shutil.rmtree(_NETNS_ETC / name, ignore_errors=True)
        self._namespaces.clear()

    # ------------------------------------------------------------------ helpers

    def _create(self) -> None:
        bridge = f"{self._tag}-br"
        self._add_namespace(bridge)
        self._ns(bridge, "ip", "link", "add", "br0", "type", "bridge")
        self._ns(bridge, "ip", "link", "set", "br0", "up")
        for i in range(self.num_workers):
            ns = self.namespace(i)
            self._add_namespace(ns)
            etc = _NETNS_ETC / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(
                f"127.0.0.1 localhost\n{self.ip(i)} {socket.gethostname()}\n"
            )
            inner, outer = f"{self._tag}a{i}", f"{self._tag}b{i}"
            _run(["ip", "link", "add", inner, "type", "veth", "peer", "name", outer])
            _run(["ip", "link", "set", inner, "netns", ns])
            _run(["ip", "link", "set", outer, "netns", bridge])
            self._ns(ns, "ip", "link", "set", inner, "name", "eth0")
            self._ns(ns, "ip", "addr", "add", f"{self.ip(i)}/24", "dev", "eth0")
            self._ns(ns, "ip", "link", "set", "eth0", "up")
            self._ns(ns, "ip", "link", "set", "lo", "up")
            self._ns(bridge, "ip", "link", "set", outer, "master", "br0")
            self._ns(bridge, "ip", "link", "set", outer, "up")
            self._shape(ns, "eth0", delay=True)  # worker -> bridge (upload)
            self._shape(bridge, outer, delay=False)  # bridge -> worker (download)

    def _shape(self, ns: str, dev: str, *, delay: bool) -> None:
        """tc on `dev`'s egress: netem for latency, then tbf for the rate."""
        parent = ["root"]
        if delay and self.delay_ms:
            netem = ["netem", "delay", f"{self.delay_ms}ms"]
            try:
                self._ns(
                    ns,
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    dev,
                    *parent,
                    "handle",
                    "1:",
                    *netem,
                )
            except subprocess.CalledProcessError as e:
                raise RuntimeError(
                    f"delay_ms={self.delay_ms}: tc netem failed ({e.stderr.strip()}); "
                    "this kernel lacks sch_netem, so latency cannot be emulated here "
                    "(use delay_ms=0)."
                ) from None
            parent = ["parent", "1:1"]
        if self.rate_mbit is not None:
            rate = f"{self.rate_mbit}mbit"
            # A burst of `burst_ms` at the rate (at least `min_burst` bytes) and a
            # queue of `queue_ms`. A message smaller than the burst leaves at line rate
            # when the bucket is full, so a link that must delay small messages
            # needs a small burst.
            per_ms = self.rate_mbit * 1e6 / 8 / 1e3
            burst = str(max(self.min_burst, int(per_ms * self.burst_ms)))
            queue = ["latency", f"{self.queue_ms}ms"]
            if self.queue_bytes is not None:
                queue = ["limit", str(self.queue_bytes)]
            tbf = ["tbf", "rate", rate, "burst", burst, *queue]
            self._ns(
                ns, "tc", "qdisc", "add", "dev", dev, *parent, "handle", "2:", *tbf
            )

    def _add_namespace(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._namespaces.append(name)

    def _ns(self, ns: str, *argv: str) -> None:
        _run(["ip", "netns", "exec", ns, *argv])

    def _ns_quiet(self, ns: str, *argv: str) -> None:
        _run(["ip", "netns", "exec", ns, *argv], check=False)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _run(argv: Sequence[str], check: bool = True) -> None:
    subprocess.run(
        argv, check=check, timeout=_TIMEOUT_S, capture_output=True, text=True
    )
