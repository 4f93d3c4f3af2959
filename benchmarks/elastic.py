"""What the elastic job on Ray costs: rounds, heals, a SIGKILL, memory, a chaos soak.

    python -m benchmarks.elastic --rounds    # round time, 1 MB .. 1 GiB, 3 and 4 islands
    python -m benchmarks.elastic --heal      # heal time, 1 MB .. 1 GiB
    python -m benchmarks.elastic --kill      # SIGKILL: stall, heal, rejoin; Ray's memory
    python -m benchmarks.elastic --chaos [--minutes 10]   # the chaos soak
    python -m benchmarks.elastic --chaos --nodes 6        # ... one island per node, cuts too
    python -m benchmarks.elastic --cut       # one island's node cut off for 10 s

Every mode runs inside a network namespace of its own whose only interface is `lo`
(it re-runs itself under `unshare --net` as root), so Ray binds loopback only.

- `--rounds`: light island actors (a `RayTransport` each, no training) post one
  message of S bytes per round and read the others' through the job's syncer (the
  syncer owns every message, the bytes go peer to peer); the median of the rounds
  after the first, on the slowest island. Record `measured/elastic_ray_rounds.json`.
- `--heal`: one island asks the syncer for a heal, a peer serves a state of S bytes
  (`RayTransport.serve`), the asker holds it deserialised; median of 3.
- `--kill`: a job of 3 islands of tiny-xxs (`train --elastic`, 480 steps paced at
  50 ms, grace 4 s): island 1 SIGKILLed at step 60; Ray restarts it. The survivors'
  stall, its heal, the seconds from the kill to its first round as a member, and
  the resident memory of Ray's processes (per job) and of an island's process next
  to the same program without Ray (per island). Record `measured/elastic_ray.json`.
- `--chaos`: 6 islands of tiny-xxxs for `--minutes`, a fault every 20-30 s (SIGKILL;
  SIGSTOP for 5-15 s; SIGKILL of the island serving a heal), each in
  `measured/elastic_chaos_faults.jsonl`; then the same job without faults. Throughput
  retained, rounds with full membership, final loss against the fault-free run,
  θ_g equality, and the posts of islands not healed yet (refused, counted).
  Record `measured/elastic_chaos.json`. With `--nodes N` the job runs on N Ray
  nodes, each in a network namespace made here and joined by a bridge (one island
  per node), and the faults also draw a cut: an island's node off the bridge for
  10 s (never the head's). Record `measured/elastic_chaos_nodes.json`.
- `--cut`: three such nodes, 3 islands of tiny-xxs; island 2's node is cut off for
  10 s at step 120. Record `measured/elastic_cut.json`.
"""

import argparse
import contextlib
import io
import json
import os
import pathlib
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ._common import machine


ROOT = pathlib.Path(__file__).resolve().parent.parent
MEASURED = ROOT / "benchmarks" / "measured"
SIZES_MB = (1, 16, 64, 256, 1024)


# ------------------------------------------------------------------ light islands


class _State(NamedTuple):
    step: Any
    x: Any


class Peer:
    """A light island actor: a `RayTransport`, its outbox, no training."""

    def __init__(self, syncer: Any, m: int, count: int):
        from sdiloco.distributed.ray_transport import RayTransport

        self.outbox: dict = {}
        self.t = RayTransport(syncer, m, count, fields={}, outbox=self.outbox)
        self.m = m

    def message(self, name: str) -> Any:
        return True, self.outbox[name]

    def hello(self) -> Any:
        import ray

        actor = ray.get_runtime_context().get_actor_id()
        return self.t.call("hello", self.m, actor, {}, 0, os.getpid())

    def pid(self) -> int:
        return os.getpid()

    def rounds(self, size: int, repeats: int) -> list[float]:
        own = np.full(size, self.m + 1, np.uint8)
        times = []
        for r in range(repeats + 1):
            start = time.perf_counter()
            members, refs = self.t.arrive(f"{size}-{r}", own)
            out, _ = self.t.read(f"{size}-{r}", members, refs, own)
            times.append(time.perf_counter() - start)
            assert (
                out[(self.m + 1) % len(members), 0] == (self.m + 1) % len(members) + 1
            )
            del out
        return times

    def serve_once(self, size: int) -> int:
        state = _State(np.int32(5), np.ones(size, np.uint8))
        while True:
            for what, text in self.t.take_mail(wait_s=1.0):
                if what == "serve":
                    return self.t.serve(text, state)

    def heal_once(self, size: int) -> float:
        import equinox as eqx

        template = _State(np.int32(0), np.zeros(size, np.uint8))
        start = time.perf_counter()
        (ref,) = self.t.call("want_heal", self.m, f"n{size}")
        blob = self.t.get(ref, "a heal")
        state = eqx.tree_deserialise_leaves(io.BytesIO(memoryview(blob)), template)
        self.t.call("healed", self.m, f"n{size}")
        assert int(state.step) == 5 and state.x.size == size
        return time.perf_counter() - start


def _light_job(count: int, store_bytes: int):
    import ray

    from sdiloco.distributed.syncer import Syncer

    ray.init(
        address="local",
        num_cpus=2,
        object_store_memory=store_bytes,
        include_dashboard=False,
        configure_logging=False,
    )
    syncer = (
        ray.remote(Syncer)
        .options(num_cpus=0, max_concurrency=1000)
        .remote(count, {}, grace_s=600.0, start_s=60.0, keep_s=1.0)
    )
    peers = [
        ray.remote(Peer).options(num_cpus=0, max_concurrency=4).remote(syncer, m, count)
        for m in range(count)
    ]
    ray.get([syncer.register.remote(m, p) for m, p in enumerate(peers)])
    ray.get([p.hello.remote() for p in peers])
    return ray, syncer, peers


def bench_rounds(sizes_mb: Sequence[int], islands: Sequence[int], repeats: int) -> dict:
    out: dict = {}
    for count in islands:
        largest = max(sizes_mb) << 20
        ray, _, peers = _light_job(count, max(128 << 20, (count * 2 + 2) * largest))
        for mb in sizes_mb:
            times = ray.get([p.rounds.remote(mb << 20, repeats) for p in peers])
            per_round = [max(t[r] for t in times) for r in range(1, repeats + 1)]
            out[f"{count}x{mb}MB"] = {
                "islands": count,
                "mb": mb,
                "median_s": statistics.median(per_round),
                "rounds_s": per_round,
            }
            print(json.dumps(out[f"{count}x{mb}MB"]), flush=True)
        ray.shutdown()
    return out


def bench_heal(sizes_mb: Sequence[int], repeats: int) -> dict:
    out: dict = {}
    for mb in sizes_mb:
        ray, _, peers = _light_job(2, 3 * (mb << 20) + (128 << 20))
        times = []
        for _ in range(repeats):
            served = peers[0].serve_once.remote(mb << 20)
            times.append(ray.get(peers[1].heal_once.remote(mb << 20)))
            ray.get(served)
        out[f"{mb}MB"] = {
            "mb": mb,
            "median_s": statistics.median(times),
            "all_s": times,
        }
        print(json.dumps(out[f"{mb}MB"]), flush=True)
        ray.shutdown()
    return out


# ------------------------------------------------------------------- real jobs


def _job(
    out: pathlib.Path, flags: Sequence[str], cluster: "Cluster | None" = None
) -> subprocess.Popen:
    """`train --elastic` with `flags`, on a local Ray instance, or joining `cluster`
    (run in its head's namespace)."""
    argv = [sys.executable, "-m", "sdiloco", "train", "--elastic", "--no-progress"]
    argv = [*argv, *flags, f"--out={out}"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    if cluster is not None:
        argv = ["ip", "netns", "exec", cluster.names[0], *argv, cluster.address_flag]
        env = cluster.env
    return subprocess.Popen(
        argv,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _step(out: pathlib.Path, m: int) -> int:
    try:
        return int((out / f"island-{m}.step").read_text() or 0)
    except (OSError, ValueError):
        return 0


def _pid(out: pathlib.Path, name: str) -> int:
    return int((out / f"{name}.pid").read_text())


def _rss_mb(pid: int) -> float:
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _ray_processes() -> dict[str, float]:
    """RSS (MB) of Ray's own processes in this namespace, by name."""
    me = os.readlink("/proc/self/ns/net")
    out: dict[str, float] = {}
    for pid in [int(x) for x in os.listdir("/proc") if x.isdigit()]:
        try:
            if os.readlink(f"/proc/{pid}/ns/net") != me:
                continue
            cmd = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        text = b" ".join(cmd).decode(errors="replace")
        name = next(
            (
                k
                for k in ("gcs_server", "raylet", "dashboard", "log_monitor", "agent")
                if k in text
            ),
            None,
        )
        if name is None and "ray::" not in text and "default_worker" in text:
            name = "idle worker"
        if name is not None:
            out[name] = out.get(name, 0.0) + _rss_mb(pid)
    return out


TINY = [
    "--preset=streaming_overlap_fp4",
    "--model=tiny-xxs",
    "--replicas=3",
    "--sync-every=6",
    "--batch-size=6",
    "--eval-windows=256",
]


def bench_kill(workdir: pathlib.Path) -> dict:
    out = workdir / "kill"
    flags = [*TINY, "--steps=480", "--min-step-s=0.05", "--grace=4"]
    job = _job(out, flags)
    while _step(out, 1) < 60:
        assert job.poll() is None, job.communicate()[0][-3000:]
        time.sleep(0.05)
    island_mb = _rss_mb(_pid(out, "island-1"))
    ray_mb = _ray_processes()
    killed_at = time.time()
    os.kill(_pid(out, "island-1"), signal.SIGKILL)
    text, _ = job.communicate(timeout=900)
    assert job.returncode == 0, text[-3000:]
    decisions = json.loads((out / "syncer.json").read_text())["decisions"]
    first_without = next(d for d in decisions if 1 not in d["members"])
    back = next(d for d in decisions if d["at"] > killed_at and 1 in d["members"])
    healed = json.loads((out / "island-1.json").read_text())
    alone = _standalone_rss()
    worker = _worker_overhead()
    return {
        "stall_s": first_without["waited_s"],
        "heal_s": healed["healed"]["seconds"],
        "heal_bytes": healed["healed"]["bytes"],
        "restart_to_ready_s": healed["ready_s"],
        "kill_to_rejoin_s": back["at"] - killed_at,
        "ray_processes_mb": ray_mb,
        "ray_per_job_mb": sum(ray_mb.values()),
        "island_rss_mb": island_mb,
        "same_program_without_ray_mb": alone,
        "island_minus_standalone_mb": island_mb - alone,
        **worker,
    }


def _worker_overhead() -> dict:
    """RSS (MB) of a Ray actor's process that imported numpy only, and of a plain
    Python process that did the same: the difference is what Ray's worker (its
    core worker, gRPC threads, the `ray` module) adds to every island."""
    import ray

    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=128 << 20,
        configure_logging=False,
    )
    actor = ray.remote(_Bare).options(num_cpus=0).remote()
    pid = int(ray.get(actor.pid.remote()))
    time.sleep(1.0)
    with_ray = _rss_mb(pid)
    ray.shutdown()
    plain = subprocess.run(
        [
            sys.executable,
            "-c",
            "import numpy, os; print(open(f'/proc/{os.getpid()}"
            "/status').read().split('VmRSS:')[1].split()[0])",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    without = int(plain.stdout.strip()) / 1024
    return {
        "ray_worker_mb": with_ray,
        "python_numpy_mb": without,
        "ray_per_island_mb": with_ray - without,
    }


class _Bare:
    def pid(self) -> int:
        import numpy  # noqa: F401

        return os.getpid()


STANDALONE = """
import os
import numpy as np
from sdiloco.distributed import Transport
from sdiloco.lab import config as c, train

class Alone(Transport):  # island 0 of 3, its peers absent
    island = (0, 3)
    def move(self, messages, fragment, sent):
        m = np.asarray(messages)
        return np.concatenate([m, np.zeros((2,) + m.shape[1:], m.dtype)])

cfg = c.preset("streaming_overlap_fp4", model="tiny-xxs", steps=80, eval_windows=256,
    sync_every=6, method={"num_replicas": 3}, data={"global_batch_size": 6})
rss = []

def at_60(step, state, metrics):  # where the job's island is measured
    if step == 60:
        rss.append(open(f"/proc/{os.getpid()}/status").read().split("VmRSS:")[1].split()[0])

train.run(cfg.replace(eval_every=80), transport=Alone(), progress=False, callback=at_60)
print(rss[0])
"""


def _standalone_rss() -> float:
    """RSS (MB) at step 60 of one island's program without Ray: `train.run` of
    the same config as island 0, its peers' rows zeros (`Alone`)."""
    done = subprocess.run(
        [sys.executable, "-c", STANDALONE],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    try:
        return int(done.stdout.strip().splitlines()[-1]) / 1024
    except (ValueError, IndexError):
        return float("nan")


CHAOS = [
    "--preset=streaming_overlap_fp4",
    "--model=tiny-xxxs",
    "--replicas=6",
    "--sync-every=6",
    "--batch-size=12",
    "--eval-windows=256",
    "--grace=5",
    "--min-step-s=0.1",
    "--max-restarts=1000",
]


def bench_chaos(
    workdir: pathlib.Path, minutes: float, seed: int, cluster: "Cluster | None" = None
) -> dict:
    """The soak (see the module): `steps` sized so the fault-free job lasts about
    `minutes` (0.1 s a step, paced), the chaos job the same steps. On `cluster`
    (one island per node) the faults also draw cuts: an island's node off the
    others for 10 s."""
    steps = int(minutes * 60 / 0.1)
    rng = random.Random(seed)
    name = "elastic_chaos" if cluster is None else "elastic_chaos_nodes"
    faults_path = MEASURED / f"{name}_faults.jsonl"
    chaos = workdir / "chaos"
    start = time.time()
    job = _job(chaos, [*CHAOS, f"--steps={steps}"], cluster)
    while min(_step(chaos, m) for m in range(6)) < 10:
        assert job.poll() is None, job.communicate()[0][-3000:]
        time.sleep(0.1)
    trained_from = time.time()
    with open(faults_path, "w") as log:
        while job.poll() is None:
            time.sleep(rng.uniform(20, 30))
            if (
                job.poll() is not None
                or min(_step(chaos, m) for m in range(6)) > steps - 100
            ):
                break
            fault = _fault(chaos, rng, cluster)
            log.write(json.dumps(fault) + "\n")
            log.flush()
            print(json.dumps(fault), flush=True)
    text, _ = job.communicate(timeout=1800)
    chaos_s = time.time() - trained_from
    chaos_errors = [x for x in text.splitlines() if x.startswith("error: ")]
    job_rc = job.returncode
    (workdir / "chaos.log").write_text(text)
    if job_rc != 0:  # kept for the reader; the fault-free run would not be compared
        record = {"chaos_exit": job_rc, "chaos_errors": chaos_errors}
        record["chaos_log_tail"] = text.splitlines()[-80:]
        record["faults"] = [json.loads(x) for x in faults_path.read_text().splitlines()]
        _save(f"{name}_failed.json", {"chaos": record})
        raise SystemExit(f"the chaos job ended with exit {job_rc}: {chaos_errors}")
    free = workdir / "free"
    job = _job(free, [*CHAOS, f"--steps={steps}"], cluster)
    while min(_step(free, m) for m in range(6)) < 10:
        assert job.poll() is None, job.communicate()[0][-3000:]
        time.sleep(0.1)
    free_from = time.time()
    text, _ = job.communicate(timeout=1800)
    free_s = time.time() - free_from
    assert job.returncode == 0, text[-3000:]
    record = _chaos_record(chaos, free, steps, chaos_s, free_s, start, faults_path)
    record["chaos_exit"], record["chaos_errors"] = job_rc, chaos_errors
    return record


CUT = [*TINY, "--steps=600", "--min-step-s=0.05", "--grace=4", "--quantizer=none"]
"""The cut's job: 3 islands of tiny-xxs, float32 messages (θ_g compared bitwise)."""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _in(ns: str, argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", ns, *argv], **kw)


class Cluster(NamedTuple):
    """Ray nodes in network namespaces of their own (`_cluster`)."""

    names: list[str]
    env: dict[str, str]
    address_flag: str


@contextlib.contextmanager
def _cluster(count: int):
    """`count` Ray nodes, each in a network namespace made here: the first holds
    the head and a bridge, each other one a node joined to the bridge by a veth pair
    and to nothing else (`_bridged`). Everything is removed after."""
    tag = f"sdl{os.getpid() % 100000}"
    names = [f"{tag}{chr(ord('a') + k)}" for k in range(count)]
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=os.urandom(16).hex())
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    ray = [sys.executable, "-m", "ray.scripts.scripts"]
    common = ["--object-store-memory=200000000", "--disable-usage-stats"]
    try:
        _bridged(names)
        head = [*ray, "start", "--head", "--node-ip-address=10.77.0.1", "--port=6390"]
        head += ["--include-dashboard=false", "--num-cpus=2", *common]
        _in(names[0], [*head, f"--temp-dir=/tmp/{tag}-a"], env=env, check=True)
        for k, ns in enumerate(names[1:], start=2):
            node = [*ray, "start", "--address=10.77.0.1:6390", "--num-cpus=1"]
            node += [f"--node-ip-address=10.77.0.{k}", *common]
            node += [f"--temp-dir=/tmp/{tag}-{ns[-1]}"]  # its sockets apart
            _in(ns, node, env=env, check=True, capture_output=True)
        yield Cluster(names, env, "--address=10.77.0.1:6390")
    finally:
        for ns in reversed(names):
            _in(ns, [*ray, "stop", "--force"], env=env, capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(f"/tmp/{tag}-{ns[-1]}", ignore_errors=True)


def bench_cut(workdir: pathlib.Path, seconds: float = 10.0) -> dict:
    """One island cut off from the others for `seconds`: three Ray nodes
    (`_cluster`), the job's 3 islands one per node; at step 120 the link of the
    node that holds island 2 goes down, and up again `seconds` later."""
    out = workdir / "cut"
    with _cluster(3) as cluster:
        names = cluster.names
        job = _job(out, CUT, cluster)
        while min(_step(out, m) for m in range(3)) < 120:
            assert job.poll() is None, job.communicate()[0][-3000:]
            time.sleep(0.05)
        where = {m: _netns_of(_pid(out, f"island-{m}")) for m in range(3)}
        assert sorted(where.values()) == sorted(names), f"not one per node: {where}"
        cut = [2]
        step = {m: _step(out, m) for m in range(3)}
        cut_at = time.time()
        _cut_off(where[2], seconds)
        text, _ = job.communicate(timeout=900)
        (workdir / "cut.log").write_text(text)
        return _cut_record(out, job.returncode, text, cut, step, cut_at, seconds)


def _bridged(names: Sequence[str]) -> None:
    """Network namespaces `names`, each with `lo` up: the first holds a bridge
    (10.77.0.1), each other one a veth pair's end (`ve<letter>`, 10.77.0.k) whose
    peer is on the bridge."""
    for ns in names:
        _ip("netns", "add", ns)
        _ip("-n", ns, "link", "set", "lo", "up")
    hub = names[0]
    _ip("-n", hub, "link", "add", "name", "br0", "type", "bridge")
    _ip("-n", hub, "addr", "add", "10.77.0.1/24", "dev", "br0")
    _ip("-n", hub, "link", "set", "br0", "up")
    for k, ns in enumerate(names[1:], start=2):
        end, peer = f"ve{ns[-1]}", f"pe{ns[-1]}"
        _ip(
            "-n",
            hub,
            "link",
            "add",
            peer,
            "type",
            "veth",
            "peer",
            "name",
            end,
            "netns",
            ns,
        )
        _ip("-n", hub, "link", "set", peer, "master", "br0")
        _ip("-n", hub, "link", "set", peer, "up")
        _ip("-n", ns, "addr", "add", f"10.77.0.{k}/24", "dev", end)
        _ip("-n", ns, "link", "set", end, "up")


def _cut_off(ns: str, seconds: float) -> None:
    """Namespace `ns`'s node off the bridge for `seconds`: its end of its veth pair
    (`_bridged`) down, then up."""
    _ip("-n", ns, "link", "set", f"ve{ns[-1]}", "down")
    time.sleep(seconds)
    _ip("-n", ns, "link", "set", f"ve{ns[-1]}", "up")


def _netns_of(pid: int) -> str:
    """The name of the named network namespace `pid` is in ('' if none)."""
    done = subprocess.run(
        ["ip", "netns", "identify", str(pid)], capture_output=True, text=True
    )
    return done.stdout.strip()


def _cut_record(out, rc, text, cut, step, cut_at, seconds) -> dict:
    decisions = json.loads((out / "syncer.json").read_text())["decisions"]
    summaries = {}
    for m in range(3):
        path = out / f"island-{m}.json"
        summaries[m] = json.loads(path.read_text()) if path.exists() else None
    during = [d for d in decisions if cut_at <= d["at"] <= cut_at + seconds + 30]
    back = next(
        (d for d in decisions if d["at"] > cut_at and set(cut) <= set(d["members"])),
        None,
    )
    finished = [s for s in summaries.values() if s is not None]
    return {
        "islands_cut_off": cut,
        "steps_at_cut": step,
        "cut_s": seconds,
        "exit": rc,
        "errors": [x for x in text.splitlines() if x.startswith("error: ")],
        "rounds_without_the_cut_island": sum(
            not set(cut) <= set(d["members"]) for d in decisions
        ),
        "longest_wait_s_in_and_after_the_cut": max(
            (d["waited_s"] for d in during), default=None
        ),
        "cut_to_rejoin_s": None if back is None else back["at"] - cut_at,
        "heals": {m: s["healed"] for m, s in summaries.items() if s is not None},
        "theta_g_equal_on_every_island": len(finished) == 3
        and len({s["global_digest"] for s in finished}) == 1,
        "loss": next(
            (s["evaluation"]["eval/global"] for s in finished if s["evaluation"]), None
        ),
    }


def _fault(
    out: pathlib.Path, rng: random.Random, cluster: "Cluster | None" = None
) -> dict:
    kinds = ["sigkill", "sigstop", "kill_healer"] + (["cut"] if cluster else [])
    kind = rng.choice(kinds)
    m = rng.randrange(6)
    if kind == "cut":  # an island on a node of its own, not the head's
        assert cluster is not None
        away = [
            k
            for k in range(6)
            if _netns_of(_pid(out, f"island-{k}")) != cluster.names[0]
        ]
        m = rng.choice(away)
    at, pid = time.time(), _pid(out, f"island-{m}")
    fault: dict = {"t": at, "kind": kind, "island": m, "step": _step(out, m)}
    if kind == "cut":
        _cut_off(_netns_of(pid), 10.0)
        fault["cut_s"] = 10.0
        return fault
    if kind == "sigstop":
        pause = rng.uniform(5, 15)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(pause)
        os.kill(pid, signal.SIGCONT)
        fault["pause_s"] = pause
        return fault
    os.kill(pid, signal.SIGKILL)
    if kind == "kill_healer":  # the island that serves its heal, once it does
        deadline = time.time() + 60
        while time.time() < deadline:
            for k in range(6):
                journal = out / f"island-{k}.jsonl"
                if k == m or not journal.exists():
                    continue
                for line in journal.read_text().splitlines():
                    event = json.loads(line)
                    if event["what"] == "serve" and event["t"] > at:
                        os.kill(_pid(out, f"island-{k}"), signal.SIGKILL)
                        fault.update(healer=k, healer_killed_after_s=time.time() - at)
                        return fault
            time.sleep(0.05)
        fault["healer"] = None
    return fault


def _chaos_record(chaos, free, steps, chaos_s, free_s, start, faults_path) -> dict:
    runs = {}
    for name, out in (("chaos", chaos), ("free", free)):
        paths = [out / f"island-{m}.json" for m in range(6)]
        summaries = [json.loads(p.read_text()) for p in paths if p.exists()]
        report = json.loads((out / "syncer.json").read_text())
        decisions = report["decisions"]
        runs[name] = {
            "digests": sorted({s["global_digest"] for s in summaries}),
            "eval": next(
                (s["evaluation"]["eval/global"] for s in summaries if s["evaluation"]),
                None,
            ),
            "rounds": len(decisions),
            "full_rounds": sum(len(d["members"]) == 6 for d in decisions),
            "timed_out": sum(d["timed_out"] for d in decisions),
            "unhealed_posts": report.get("unhealed_posts"),
            "heals": sum(bool(s["healed"]) for s in summaries),
            "finished": len(summaries),
        }
    faults = [json.loads(x) for x in faults_path.read_text().splitlines()]
    return {
        "steps": steps,
        "chaos_s": chaos_s,
        "free_s": free_s,
        "throughput_retained": free_s / chaos_s,
        "faults": len(faults),
        "fault_kinds": {
            k: sum(f["kind"] == k for f in faults) for k in {f["kind"] for f in faults}
        },
        "theta_g_equal_on_every_island": len(runs["chaos"]["digests"]) == 1
        and runs["chaos"]["finished"] == 6,
        "loss_chaos": runs["chaos"]["eval"],
        "loss_free": runs["free"]["eval"],
        "runs": runs,
        "started": start,
    }


# ----------------------------------------------------------------------- tables


def tables() -> str:
    """The tables of docs/elastic.md, written from the records."""
    lines = []
    rounds = _load("elastic_ray_rounds.json").get("rounds", {})
    old = _load("elastic_rounds.json").get("islands", {})
    lines += [
        "| message | Ray, 3 islands | board, 3 | gloo, 3 | Ray, 4 islands | board, 4 | gloo, 4 |",
        "|---|---|---|---|---|---|---|",
    ]
    for mb in SIZES_MB:
        row = [f"{mb:,} MB"]
        for count in (3, 4):
            ray = rounds.get(f"{count}x{mb}MB", {}).get("median_s")
            cell = old.get(str(count), {}).get(str(mb), {})
            board = cell.get("board", {}).get("median_s")
            gloo = cell.get("gloo", {}).get("median_s")
            row += [_s(ray), _s(board), _s(gloo)]
        lines.append("| " + " | ".join(row) + " |")
    heal = _load("elastic_ray_heal.json").get("heal", {})
    lines += ["", "| state | heal (ask, serve, fetch, deserialise) |", "|---|---|"]
    lines += [f"| {v['mb']:,} MB | {_s(v['median_s'])} |" for v in heal.values()]
    kill = _load("elastic_ray.json").get("kill", {})
    if kill:
        lines += [
            "",
            "| after a SIGKILL (3 islands, tiny-xxs) | seconds |",
            "|---|---|",
            f"| survivors' stall (the round without it) | {_s(kill['stall_s'])} |",
            f"| restart to ready (Ray restart, imports, compile cache) | {_s(kill['restart_to_ready_s'])} |",
            f"| heal ({kill['heal_bytes']:,} bytes) | {_s(kill['heal_s'])} |",
            f"| kill to its first round as a member | {_s(kill['kill_to_rejoin_s'])} |",
            "",
            "| memory (RSS) | MB |",
            "|---|---|",
            f"| Ray per job (gcs_server, raylet, agents, idle workers) | {kill['ray_per_job_mb']:.0f} |",
            f"| an island's process at step 60 | {kill['island_rss_mb']:.0f} |",
            f"| the same program without Ray, at step 60 | {kill['same_program_without_ray_mb']:.0f} |",
            f"| a Ray actor's process (numpy imported) | {kill['ray_worker_mb']:.0f} |",
            f"| a plain Python process (numpy imported) | {kill['python_numpy_mb']:.0f} |",
            f"| Ray per island (the difference) | {kill['ray_per_island_mb']:.0f} |",
        ]
    for record, where in (
        ("elastic_chaos.json", "6 islands of tiny-xxxs on one node"),
        ("elastic_chaos_nodes.json", "6 islands of tiny-xxxs, one per Ray node"),
    ):
        chaos = _load(record).get("chaos", {})
        if chaos:
            lines += ["", *_chaos_table(chaos, where)]
    cut = _load("elastic_cut.json").get("cut", {})
    if cut:
        lines += ["", *_cut_table(cut)]
    return "\n".join(lines)


def _cut_table(cut: dict) -> list[str]:
    (m,) = cut["islands_cut_off"]
    heal = cut["heals"][str(m)]
    return [
        "| network cut (3 islands of tiny-xxs, one per Ray node) | |",
        "|---|---|",
        f"| island cut off from the others | {m}, for {cut['cut_s']:.0f} s from step {cut['steps_at_cut'][str(m)]} |",
        f"| the others' longest wait for a round | {cut['longest_wait_s_in_and_after_the_cut']:.2f} s |",
        f"| rounds decided without it | {cut['rounds_without_the_cut_island']} |",
        f"| from the cut to its first round as a member | {cut['cut_to_rejoin_s']:.1f} s |",
        f"| its heal ({heal['why']}) | {heal['seconds']:.3f} s, {heal['bytes']:,} bytes |",
        f"| θ_g byte-identical on every island | {_yes(cut['theta_g_equal_on_every_island'])} |",
        f"| the job's exit status | {cut['exit']} |",
    ]


def _chaos_table(chaos: dict, where: str) -> list[str]:
    runs = chaos["runs"]
    return [
        f"| chaos soak ({where}) | with faults | fault-free |",
        "|---|---|---|",
        f"| steps | {chaos['steps']:,} | {chaos['steps']:,} |",
        f"| wall time from step 10 to the end | {chaos['chaos_s']:.0f} s | {chaos['free_s']:.0f} s |",
        f"| faults (a fault every 20-30 s) | {chaos['faults']}: {_kinds(chaos)} | 0 |",
        f"| throughput retained | {chaos['throughput_retained']:.1%} | 100 % |",
        f"| rounds with all 6 islands | {_frac(runs['chaos'])} | {_frac(runs['free'])} |",
        f"| rounds decided at the grace deadline | {runs['chaos']['timed_out']} | {runs['free']['timed_out']} |",
        f"| final held-out loss of θ_g | {runs['chaos']['eval']:.4f} | {runs['free']['eval']:.4f} |",
        f"| θ_g byte-identical on every island | {_yes(len(runs['chaos']['digests']) == 1)} | {_yes(len(runs['free']['digests']) == 1)} |",
        f"| messages of islands not healed yet, refused | {runs['chaos']['unhealed_posts']} | {runs['free']['unhealed_posts']} |",
    ]


def _kinds(chaos: dict) -> str:
    return ", ".join(f"{n} {k}" for k, n in sorted(chaos["fault_kinds"].items()))


def _frac(run: dict) -> str:
    return f"{run['full_rounds']:,} of {run['rounds']:,} ({run['full_rounds'] / max(1, run['rounds']):.0%})"


def _yes(x: bool) -> str:
    return "yes" if x else "**no**"


def _s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3f} s" if x < 1 else f"{x:.2f} s"


def _load(name: str) -> dict:
    path = MEASURED / name
    return json.loads(path.read_text()) if path.exists() else {}


# ------------------------------------------------------------------------ main


def _isolated() -> bool:
    """Whether this process is in a network namespace whose only interface is lo
    (`/proc/self/net/dev` is this namespace's; `/sys/class/net` is the mount's)."""
    lines = pathlib.Path("/proc/self/net/dev").read_text().splitlines()[2:]
    return [line.split(":")[0].strip() for line in lines] == ["lo"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    for mode in ("rounds", "heal", "kill", "chaos", "cut", "table"):
        parser.add_argument(f"--{mode}", action="store_true")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES_MB)), help="MB")
    parser.add_argument("--islands", default="3,4")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--nodes",
        type=int,
        default=0,
        help="--chaos on this many Ray nodes in namespaces (one island each): "
        "the faults draw network cuts too",
    )
    args = parser.parse_args(argv)
    if args.table:
        print(tables())
        return 0
    if not _isolated():
        if os.geteuid() != 0 or shutil.which("unshare") is None:
            print(
                "needs root and unshare: Ray must bind loopback only", file=sys.stderr
            )
            return 2
        script = 'ip link set lo up && exec "$@"'
        again = [sys.executable, "-m", "benchmarks.elastic", *(argv or sys.argv[1:])]
        return subprocess.call(["unshare", "--net", "sh", "-c", script, "sh", *again])
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    sizes = [int(x) for x in args.sizes.split(",")]
    record: dict = {"machine": machine(), "date": time.strftime("%Y-%m-%d")}
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        if args.rounds:
            islands = [int(x) for x in args.islands.split(",")]
            record["rounds"] = bench_rounds(sizes, islands, args.repeats)
            _save("elastic_ray_rounds.json", record)
        if args.heal:
            record["heal"] = bench_heal(sizes, 3)
            _save("elastic_ray_heal.json", record)
        if args.kill:
            record["kill"] = bench_kill(work)
            _save("elastic_ray.json", record)
        if args.chaos and args.nodes:
            with _cluster(args.nodes) as cluster:
                record["chaos"] = bench_chaos(work, args.minutes, args.seed, cluster)
            _save("elastic_chaos_nodes.json", record)
        elif args.chaos:
            record["chaos"] = bench_chaos(work, args.minutes, args.seed)
            _save("elastic_chaos.json", record)
        if args.cut:
            record["cut"] = bench_cut(work)
            _save("elastic_cut.json", record)
    return 0


def _save(name: str, record: dict) -> None:
    """Write the record, keeping the entries of an earlier one that this run did
    not measure (e.g. `--islands 4` after `--islands 3`)."""
    path = MEASURED / name
    if path.exists():
        old = json.loads(path.read_text())
        for key in ("rounds", "heal"):
            if key in record and key in old:
                record[key] = {**old[key], **record[key]}
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
