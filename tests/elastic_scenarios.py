"""Ray scenarios of the elastic job without training, run by `tests/test_elastic.py`
as `python tests/elastic_scenarios.py` inside a network namespace of its own (only
`lo`): one local Ray instance, and for each scenario a syncer and light island
actors that hold a `RayTransport` and a message each. Prints one JSON line: what
each scenario saw.

- `kill_healer`: island 1 asks for a heal; the peer it is routed to is SIGKILLed
  before it serves (the driver tells the syncer, as the job's does); the request is
  routed to the other peer, which serves it.
- `kill_after_decision`: three islands post round "6-0" (1 MB each); once it is
  decided, island 0's process is SIGKILLed before island 1 reads the round.
  `owned` (the job's mechanism: the syncer owns every message, `Syncer.arrive`)
  reads island 0's bytes; `sender` (the message a plain `ray.put` of its sender,
  owned by it) cannot.
"""

import io
import json
import os
import signal
import time
from typing import Any, NamedTuple

import equinox as eqx
import numpy as np
import ray

from sdiloco.distributed.ray_transport import ElasticError, RayTransport
from sdiloco.distributed.syncer import Syncer


SIZE = 1 << 20


class _State(NamedTuple):
    step: Any
    x: Any


class SenderOwned(Syncer):
    """The syncer with the consistency mechanism removed: each message is an
    object its sender put, and so owned by the sender."""

    async def _own(self, name, m):
        (ref,) = await self.islands[m].put_message.remote(name)
        return ref


class Peer:
    """A light island: its transport and outbox, no training."""

    def __init__(self, syncer, m):
        self.outbox = {}
        self.t = RayTransport(syncer, m, 3, fields={}, outbox=self.outbox)
        self.m, self.decided = m, None

    def message(self, name):
        return True, self.outbox[name]

    def put_message(self, name):
        return [ray.put(self.outbox[name])]

    def pid(self):
        return os.getpid()

    def hello(self):
        actor = ray.get_runtime_context().get_actor_id()
        return self.t.call("hello", self.m, actor, {}, 0, os.getpid())

    def arrive(self, name):
        own = np.full(SIZE, self.m + 1, np.uint8)
        self.decided = self.t.arrive(name, own), own
        return self.decided[0][0]

    def mail(self):
        return self.t.take_mail(wait_s=2.0)

    def serve(self):
        state = _State(np.int32(5), np.arange(1000, dtype=np.int32))
        for what, text in self.t.take_mail(wait_s=10.0):
            if what == "serve":
                return self.t.serve(text, state)
        return 0

    def heal(self):
        (ref,) = self.t.call("want_heal", self.m, "n")
        blob = self.t.get(ref, "a heal")
        template = _State(np.int32(0), np.zeros(1000, np.int32))
        state = eqx.tree_deserialise_leaves(io.BytesIO(blob.tobytes()), template)
        self.t.call("healed", self.m, "n")
        return int(state.step), int(state.x[-1])

    def read(self, name):
        (members, refs), own = self.decided
        try:
            out, _ = self.t.read(name, members, refs, own)
        except ElasticError as e:
            return {"error": str(e)}
        return {"rows": [int(out[j, 0]) for j in range(3)], "sizes": out.shape[1]}


def kill_healer(variant: str) -> dict:
    del variant
    syncer = (
        ray.remote(Syncer)
        .options(num_cpus=0, max_concurrency=1000)
        .remote(3, {}, grace_s=5.0, start_s=30.0, serve_s=60.0)
    )
    peers = _peers(syncer)
    asked = peers[1].heal.remote()
    letters = []
    while not letters:
        letters = ray.get(peers[0].mail.remote())  # routed to peer 0 (lowest id)
    os.kill(ray.get(peers[0].pid.remote()), signal.SIGKILL)  # before it serves
    syncer.lost.remote(0, True)  # what the job's driver does on the death
    served = ray.get(peers[2].serve.remote(), timeout=30)
    got = ray.get(asked, timeout=30)
    return {"first": letters, "served": served, "got": list(got)}


def _peers(syncer):
    peer = ray.remote(Peer).options(num_cpus=0, max_concurrency=4)
    peers = [peer.remote(syncer, m) for m in range(3)]
    ray.get([syncer.register.remote(m, p) for m, p in enumerate(peers)])
    ray.get([p.hello.remote() for p in peers])
    return peers


def kill_after_decision(variant: str) -> dict:
    kind = Syncer if variant == "owned" else SenderOwned
    syncer = (
        ray.remote(kind)
        .options(num_cpus=0, max_concurrency=1000)
        .remote(3, {}, grace_s=5.0, start_s=30.0)
    )
    peers = _peers(syncer)
    members = ray.get([p.arrive.remote("6-0") for p in peers], timeout=60)
    os.kill(ray.get(peers[0].pid.remote()), signal.SIGKILL)  # right after the decision
    time.sleep(1.0)
    read = ray.get(peers[1].read.remote("6-0"), timeout=60)
    return {"members": [list(x) for x in members], **read}


SCENARIOS = {
    "kill_healer": lambda: kill_healer("-"),
    "owned": lambda: kill_after_decision("owned"),
    "sender": lambda: kill_after_decision("sender"),
}


if __name__ == "__main__":
    ray.init(
        address="local",
        num_cpus=2,
        object_store_memory=128 << 20,
        include_dashboard=False,
    )
    print(json.dumps({name: run() for name, run in SCENARIOS.items()}), flush=True)
