"""Replica islands that fail and rejoin: the exchange through Ray's object store.

Each replica island of the elastic job is a program of its own (`num_replicas=1` in
its `streaming_diloco`), run by a Ray actor (`lab.elastic`); the islands meet
through the job's **syncer** (`syncer.Syncer`, an actor that carries control only).
One round (one fragment sent at one step) is named `<sent step>-<fragment>`
(`round_name`):

1. every island keeps its packed message in its outbox and tells the syncer it is
   ready (`Syncer.arrive`); the syncer asks the island's actor for it
   (`lab.elastic.Island.message`), which makes the message an object in the
   sender's object store that the syncer owns: it outlives its sender;
2. the syncer decides the round's members (every island it waits for arrived, or
   `grace_s` after the first) and answers each island with the members'
   references;
3. every island fetches the members' messages (peer to peer, from the senders'
   object stores), decodes and averages them as the simulation does (absent
   replicas as zeros, the mean rescaled to the members), so every island's θ_g
   stays bitwise equal.

Healing. An island that Ray restarted, or that fell behind, asks the syncer for a
live peer's state (`Syncer.want_heal`); the peer, told by mail, serialises its
whole state between two of its steps and puts it into its object store; the
island fetches it and replaces its parameters by θ_g (`heal="copy"` of the
simulation). A peer that dies meanwhile is passed over.

Every call to the syncer is bounded (`timeout_s`); a syncer that is gone ends the
island with one line (`SyncerLost`).
"""

import dataclasses
import io
import os
import sys
import time
import uuid
from typing import Any

import equinox as eqx
import jax
import numpy as np

from .. import streaming
from .transport import Transport


class ElasticError(RuntimeError):
    """The elastic job could not go on: one line says why."""


class SyncerLost(ElasticError):
    """The syncer (or the Ray cluster) is gone: the job ends, checkpoints stay."""


class Refused(ElasticError):
    """The syncer refused this island at join (another config, a taken id)."""


@dataclasses.dataclass
class RoundLog:
    """What one island saw of one round: when it posted (`time.time()`), how long
    it waited for the decision and the messages, the members, and the bytes it
    received."""

    round: str
    posted: float
    waited_s: float
    members: tuple[int, ...]
    received_bytes: int


def round_name(sent: int, fragment: int) -> str:
    """The name of the round of fragment `fragment` sent at step `sent`: the same
    on every island, whatever τ."""
    return f"{sent}-{fragment}"


class RayTransport(Transport):
    """The transport of island `replica` of an elastic job of `num_replicas` (a
    `transport.Transport`): each fragment sent is one round on the syncer, and the
    island joins the job (`join`), reads its mail (`between_steps`: a heal to
    serve, word that it fell behind) and says who left and came back (`news`).

    Args:
        syncer: the job's syncer (a Ray actor handle).
        fields: this island's config fingerprint (`lab.elastic.fingerprint`).
        outbox: where its messages wait for the syncer's call, by round (the
            island actor's `message` reads it).
        timeout_s: the longest any wait on the syncer or a peer lasts.
        say: where the island's lines go (default: stderr, "island m: ...").
        event: called as `event(what, **details)` when it serves a heal, heals
            or reads its mail (the job's journal), or None.
    """

    def __init__(
        self,
        syncer: Any,
        replica: int,
        num_replicas: int,
        *,
        fields: dict[str, str],
        outbox: dict[str, np.ndarray] | None = None,
        timeout_s: float = 120.0,
        say: Any = None,
        event: Any = None,
    ):
        super().__init__()
        self.syncer, self.fields, self.timeout_s = syncer, fields, timeout_s
        self.replica, self.num_replicas = replica, num_replicas
        self.island = (replica, num_replicas)
        self.outbox = {} if outbox is None else outbox
        self.quiet_until = -1
        self.rounds: list[RoundLog] = []
        self.healed: dict[str, Any] = {}
        self.served = 0
        self.joined_at: float | None = None
        self.first_step = 0
        self.ready_at = 0.0
        self._members = Membership(num_replicas)
        self._mail: Any = None
        self._event = event or (lambda what, **details: None)
        self._say = say or (
            lambda text: print(f"island {replica}: {text}", file=sys.stderr, flush=True)
        )

    def __repr__(self) -> str:
        return f"Ray islands (replica {self.replica} of {self.num_replicas})"

    # ------------------------------------------------------------------ rounds

    def move(self, messages: Any, fragment: int, sent: int) -> np.ndarray:
        name = round_name(sent, fragment)
        own = np.ascontiguousarray(np.asarray(messages)[0], np.uint8)
        post = sent > self.quiet_until
        start, posted = time.perf_counter(), time.time()
        members, refs = self.arrive(name, own if post else None)
        out, received = self.read(name, members, refs, own if post else None)
        waited = time.perf_counter() - start
        self.rounds.append(RoundLog(name, posted, waited, members, received))
        return out

    def arrive(self, name: str, own: np.ndarray | None) -> tuple[tuple, dict]:
        """Post `own` (None: read only) and wait for the round's decision."""
        if own is not None:
            self.outbox[name] = own
        try:
            members, where = self.call("arrive", name, self.replica, own is not None)
        finally:
            self.outbox.pop(name, None)
        return tuple(members), where

    def read(self, name: str, members: tuple, refs: dict, own: np.ndarray | None):
        """Every island's row of round `name` (zeros for those not members) and
        the bytes fetched from peers."""
        others = [j for j in members if not (j == self.replica and own is not None)]
        missing = [j for j in others if j not in refs]
        if missing:
            raise ElasticError(
                f"island {self.replica}: round {name}: the messages of islands "
                f"{missing} are gone (read more than keep_s after the decision)"
            )
        rows = self.get([refs[j][0] for j in others], f"round {name}'s messages")
        size = rows[0].size if rows else own.size  # pyright: ignore
        out = np.zeros((self.num_replicas, size), np.uint8)
        for j, row in zip(others, rows):
            out[j] = row
        if own is not None and self.replica in members:
            out[self.replica] = own
        self.syncer.got.remote(name, self.replica)
        return out, sum(r.size for r in rows)

    # ---------------------------------------------------------------- joining

    def join(self, state: Any, spec: Any) -> Any:
        self.ready_at = time.perf_counter()
        import ray

        actor = ray.get_runtime_context().get_actor_id()
        answer = self.call(
            "hello", self.replica, actor, self.fields, int(state.step), os.getpid()
        )
        if "refused" in answer:
            raise Refused(answer["refused"])
        if answer["heal"]:
            why = "restarted" if int(state.step) >= answer["start_step"] else "behind"
            state = self.heal(state, spec, why)
        self.joined_at, self.first_step = time.time(), int(state.step)
        return state

    def between_steps(self, state: Any, spec: Any) -> Any:
        for what, text in self.take_mail():
            if what == "serve":
                self.serve(text, state)
            elif what == "behind":
                self._say(f"behind by {text} s at step {int(state.step)}")
                state = self.heal(state, spec, "behind")
        return state

    def take_mail(self, wait_s: float = 0.0) -> list[tuple[str, str]]:
        """The letters that arrived since the last call (one long poll open)."""
        import ray

        if self._mail is None:
            self._mail = self.syncer.mail.remote(self.replica)
        ready, _ = ray.wait([self._mail], timeout=wait_s)
        if not ready:
            return []
        letters = self.get(self._mail, "the mail")
        self._mail = self.syncer.mail.remote(self.replica)
        return letters

    def news(self) -> list[str]:
        return self._members.news(self.rounds)

    # ---------------------------------------------------------------- healing

    def heal(self, state: Any, spec: Any, why: str) -> Any:
        """A live peer's state with θ_g as this island's parameters."""
        asked = time.perf_counter()
        while True:
            nonce = uuid.uuid4().hex
            (ref,) = self.call("want_heal", self.replica, nonce)
            if ref is None:
                raise Refused(
                    f"island {self.replica}: no island is left to heal from (every "
                    "other one finished or is gone)"
                )
            try:
                blob = self.get(ref, "a heal")
                break
            except ElasticError as e:
                if isinstance(e, SyncerLost):
                    raise
                self._say(f"a heal failed ({e}); asking again")
        new = eqx.tree_deserialise_leaves(io.BytesIO(blob.tobytes()), _host(state))
        self.call("healed", self.replica, nonce, int(new.step))
        new = streaming.adopt_global(spec, new)
        self.quiet_until = int(new.step)
        self.healed = {
            "seconds": time.perf_counter() - asked,
            "bytes": int(blob.size),
            "why": why,
        }
        self._event("healed", step=int(new.step), **self.healed)
        self._say(f"healed at step {int(new.step)} ({blob.size} bytes, {why})")
        return new

    def serve(self, request: str, state: Any) -> int:
        """Offer `state` for the heal `request` (`"<island>:<nonce>"`); a failure
        is one line and never ends this island."""
        import ray

        asker, _, nonce = request.partition(":")
        self._event("serve", asker=asker, step=int(state.step))
        try:
            buffer = io.BytesIO()
            eqx.tree_serialise_leaves(buffer, _host(state))
            blob = np.frombuffer(buffer.getbuffer(), np.uint8)
            self.syncer.offer.remote(nonce, [ray.put(blob)])
        except Exception as e:  # noqa: BLE001 - serving never ends the island
            self._say(f"a heal it served failed: {e}")
            return 0
        self.served += blob.size
        return blob.size

    def serve_until_end(self, state: Any) -> None:
        """After the last step: serve heals until every island that can finish is
        done, the syncer is gone, or `timeout_s` passed."""
        import ray

        deadline = time.monotonic() + self.timeout_s
        self.syncer.finished.remote(self.replica)
        end = self.syncer.wait_end.remote(self.timeout_s)
        while time.monotonic() < deadline:
            try:
                for what, text in self.take_mail(wait_s=0.2):
                    if what == "serve" and (n := self.serve(text, state)):
                        self._say(f"served a heal after its last step ({n} bytes)")
                if ray.wait([end], timeout=0)[0]:
                    return
            except SyncerLost:
                return
        self._say("left with the job not over")

    # ----------------------------------------------------------------- calls

    def call(self, method: str, *args: Any) -> Any:
        """`syncer.method(*args)`, bounded by `timeout_s`."""
        ref = getattr(self.syncer, method).remote(*args)
        return self.get(ref, f"the syncer's {method}")

    def get(self, ref: Any, what: str) -> Any:
        """`ray.get(ref)` within `timeout_s`, its failures one line."""
        import ray
        from ray import exceptions as rx

        try:
            return ray.get(ref, timeout=self.timeout_s)
        except rx.GetTimeoutError:
            raise ElasticError(
                f"island {self.replica}: {what} did not come within "
                f"{self.timeout_s:g} s"
            ) from None
        except rx.RayActorError as e:
            if _is_syncer(e, self.syncer):
                raise SyncerLost(
                    f"island {self.replica}: lost the syncer ({type(e).__name__})"
                ) from None
            raise ElasticError(f"island {self.replica}: {what}: {_cause(e)}") from None
        except (rx.ObjectLostError, rx.RaySystemError) as e:
            raise ElasticError(f"island {self.replica}: {what}: {_cause(e)}") from None


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


def _is_syncer(error: Exception, syncer: Any) -> bool:
    actor = getattr(error, "actor_id", None)
    mine = getattr(syncer, "_actor_id", None)
    return actor is None or mine is None or actor == mine.hex()


def _cause(e: Exception) -> str:
    """The runtime's error in one short line."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:200]}"


def _host(tree: Any) -> Any:
    """The state's arrays as NumPy, for serialisation."""
    return jax.device_get(tree)
