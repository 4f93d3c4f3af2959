"""The emulated WAN (`benchmarks/wan.py`): a limited link between two namespaces is
visible in the time of the library's sharded exchange, and everything is torn down."""

import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest

from benchmarks import wan
from benchmarks._common import communicate_all


ROOT = pathlib.Path(__file__).resolve().parents[1]
OK, WHY = wan.available()
pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(not OK, reason=f"no WAN emulation here: {WHY}"),
]


def _own() -> str:
    """The prefix of the namespaces this process's `Wan`s create (other pytest
    workers may hold their own at the same time)."""
    return f"sdw{os.getpid() % 100000}-"


def _namespaces() -> str:
    return subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, timeout=10
    ).stdout


def _exchange(rate_mbit, elements=1 << 20, rounds=3) -> dict:
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=1",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(ROOT),
    )
    with wan.Wan(2, rate_mbit=rate_mbit) as net:
        argv = [sys.executable, "-m", "benchmarks.wan_worker", f"{net.ip(0)}:23456"]
        options = ["--elements", str(elements), "--rounds", str(rounds)]
        procs = net.start(lambda i: [*argv, "2", str(i), *options], env=env, cwd=ROOT)
        try:
            outs = [out for out, _ in communicate_all(procs, 120)]
        finally:
            for p in procs:
                p.kill()
    assert all(p.returncode == 0 for p in procs), outs
    line = next(x for x in outs[0].splitlines() if x.startswith("{"))
    return json.loads(line)


def test_limited_link_shows_in_the_exchange_time():
    rate = 20.0  # Mbit/s each way
    fast = _exchange(None)
    slow = _exchange(rate)
    assert fast["message_bytes"] == slow["message_bytes"] == (1 << 20) // 2 + 4
    floor = slow["message_bytes"] * 8 / (rate * 1e6)  # one message each way
    t_slow = float(np.median(slow["seconds_per_exchange"]))
    t_fast = float(np.median(fast["seconds_per_exchange"]))
    assert t_slow >= 0.9 * floor, (t_slow, floor)
    assert t_slow >= 3 * t_fast, (t_slow, t_fast)
    assert _own() not in _namespaces()


def test_teardown_on_error_and_bad_input():
    with pytest.raises(RuntimeError, match="boom"):
        with wan.Wan(2, rate_mbit=50) as net:
            names = [net.namespace(i) for i in range(2)]
            assert all(n in _namespaces() for n in names)
            raise RuntimeError("boom")
    assert not any(n in _namespaces() for n in names)
    assert not any((pathlib.Path("/etc/netns") / n).exists() for n in names)
    for kwargs, field in (
        ({"num_workers": 0}, "num_workers"),
        ({"num_workers": 2, "rate_mbit": 0}, "rate_mbit"),
        ({"num_workers": 2, "delay_ms": -1}, "delay_ms"),
    ):
        with pytest.raises(ValueError, match=field):
            wan.Wan(**kwargs)


def test_courier_moves_messages_while_inner_steps_compute():
    """Two processes train with the courier (τ = 2) over a slow link: every message
    takes longer than a step to cross, and at least τ - 1 steps end while it is on
    the way (they could not with the exchange inside the step)."""
    import argparse

    from benchmarks import measured_utilization as mu

    args = argparse.Namespace(
        model="tiny-xxs",
        batch=4,
        sync_every=12,
        layers_per_fragment=3,
        periods=1,
        timeout=300,
        min_burst=2048,
        overlap=2,
    )
    rate = 0.1  # Mbit/s: a ~5 KB message takes ~0.4 s, a step ~20 ms
    record = mu.run_method("streaming_overlap_fp4", args, rates=[rate])
    (trace,) = record["traces"]
    ends = np.asarray(trace["step_ends"])
    events = trace["events"]
    assert events, "no message crossed the link in the traced window"
    step = float(np.median(np.diff(ends)))
    for e in events:
        size_s = e["bytes"] * 8 / (rate * 1e6)
        assert e["arrived"] - e["started"] >= 0.8 * size_s, e
        assert e["arrived"] - e["started"] > 3 * step, (e, step)
        during = np.sum((ends > e["started"]) & (ends < e["arrived"]))
        assert during >= 1, (e, ends)
    assert _own() not in _namespaces()


def test_set_link_cuts_a_worker_off_and_brings_it_back():
    """`Wan.set_link` (the elastic benchmark's link cut): with worker 1's link down
    it cannot reach worker 0, and once it is up again it can."""
    server = (
        "import socket, time; s = socket.socket(); s.bind(({!r}, 23457)); "
        "s.listen(8); time.sleep(60)"
    )
    connect = "import socket, sys; socket.create_connection(({!r}, 23457), timeout=2)"

    def reaches(net) -> bool:
        argv = [sys.executable, "-c", connect.format(net.ip(0))]
        p = net.popen(1, argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return p.wait(timeout=20) == 0

    with wan.Wan(2) as net:
        listening = net.popen(0, [sys.executable, "-c", server.format(net.ip(0))])
        try:
            assert any(reaches(net) or time.sleep(0.5) for _ in range(10))
            net.set_link(1, up=False)
            assert not reaches(net)
            net.set_link(1, up=True)
            assert any(reaches(net) or time.sleep(0.5) for _ in range(10))
        finally:
            listening.kill()
            listening.wait(timeout=10)
    assert _own() not in _namespaces()
