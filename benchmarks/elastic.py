"""What a failure costs an elastic job: a SIGKILLed island, and a cut link.

    python -m benchmarks.elastic [--seeds 3] [--steps 2400] [--link-cut]

Jobs of `python -m sdiloco coordinate` and three `python -m sdiloco train ... --board
--replica m` islands (Streaming DiLoCo with overlapped FP4, tiny-xxs, H = 6, M = 3,
a grace window of 4 s), per seed:

- **uninterrupted**: the three islands train to the end;
- **killed**: island 1 is SIGKILLed when it reaches step 60 and the same command is
  started again at once; it heals from a live peer and rejoins;
- **link cut** (`--link-cut`, root: the islands run in the namespaces of
  `benchmarks.wan`): island 1's link is taken down for 6 s at step 60 and brought
  back: longer than the grace window (it is left out of the rounds it misses),
  shorter than the board's heartbeat timeout (10 s). If JAX's runtime still ends
  the island (a heartbeat whose TCP retransmission came too late), it is started
  again and heals, and the record says so.

Measured: the survivors' longest wait for a round (the stall per failure), the
rounds decided at the grace deadline, the returning island's time from its restart
to its first round as a member (against a whole job's time from start to its first
step, a lower bound of a restart from a checkpoint; the islands share a compilation
cache, `CACHE`, which the first job fills, and the record says whether it was warm),
the heal's seconds and bytes,
the final held-out loss of θ_g, and the seed-paired difference killed −
uninterrupted with its 95 % t-interval. Writes `benchmarks/measured/elastic.json`.
Every process is bounded in time; the namespaces are always removed.
"""

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

from ._common import communicate_all, machine


ROOT = pathlib.Path(__file__).resolve().parent.parent
M, GRACE, KILL_AT, CUT_S = 3, 4.0, 60, 6.0
EXCHANGE = "posted, tcp board"
"""The islands' exchange (τ = 1: `posted_exchange(island=...)` moved by a `Courier`
over the board); a record made with another is started again."""
FLAGS = [
    "--preset=streaming_overlap_fp4",
    "--model=tiny-xxs",
    f"--replicas={M}",
    "--sync-every=6",
    "--batch-size=6",
    "--eval-windows=1024",
    "--no-progress",
]


class Job:
    """A coordinator and M islands started as a user would (see the module)."""

    def __init__(
        self,
        out: pathlib.Path,
        steps: int,
        seed: int,
        host: str,
        port: int,
        popen: Callable[[int, Sequence[str]], subprocess.Popen] | None = None,
    ):
        self.out, self.steps, self.seed = out, steps, seed
        self.board = [
            f"--board={host}:{port}",
            f"--grace={GRACE}",
            "--init-timeout=300",
        ]
        self._popen = popen or (lambda node, argv: _local(argv))
        self.cache_warm = CACHE.exists() and any(CACHE.iterdir())
        self.started = time.time()
        self.coordinator = self._popen(
            0, ["coordinate", f"--replicas={M}", *self.board, f"--out={out}"]
        )
        self.islands = [self.island(m) for m in range(M)]
        self.extra: list[subprocess.Popen] = []

    def island(self, m: int) -> subprocess.Popen:
        argv = ["train", *FLAGS, f"--steps={self.steps}", f"--seed={self.seed}"]
        return self._popen(
            m + 1, [*argv, f"--replica={m}", *self.board, f"--out={self.out}"]
        )

    def step(self, m: int) -> int:
        try:
            return int((self.out / f"island-{m}.step").read_text() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def wait_for_step(self, m: int, step: int, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while self.step(m) < step:
            if time.monotonic() > deadline or self.islands[m].poll() is not None:
                raise RuntimeError(f"island {m} did not reach step {step}")
            time.sleep(0.02)

    def finish(self, timeout: float = 900) -> None:
        procs = [*self.islands, *self.extra, self.coordinator]
        procs = [p for p in procs if p.returncode != -signal.SIGKILL]  # reaped
        for p, (out, _) in zip(procs, communicate_all(procs, timeout)):
            if p.returncode != 0:
                raise RuntimeError(f"a process failed:\n{out[-3000:]}")


def measure(job: Job, restart_at: float | None) -> dict:
    """The job's figures from what its processes wrote."""
    decisions = json.loads((job.out / "coordinator.json").read_text())
    islands = [json.loads((job.out / f"island-{m}.json").read_text()) for m in range(M)]
    out = {
        "loss": islands[0]["evaluation"]["eval/global"],
        "loss_se": islands[0]["evaluation"]["eval_se/global"],
        "equal_theta": len({s["global_digest"] for s in islands}) == 1,
        "rounds": len(decisions),
        "rounds_at_deadline": sum(d["timed_out"] for d in decisions),
        "rounds_without_1": sum(1 not in d["members"] for d in decisions),
        "start_to_first_step_s": min(s["joined_at"] for s in islands) - job.started,
        "cache_warm_at_start": job.cache_warm,
        "ready_s": [s["ready_s"] for s in islands],
        "survivor_longest_wait_s": max(
            r["waited_s"] for m in (0, 2) for r in islands[m]["rounds"]
        ),
        "survivor_median_wait_s": float(
            np.median([r["waited_s"] for m in (0, 2) for r in islands[m]["rounds"]])
        ),
        "served_bytes": sum(s["served_bytes"] for s in islands),
    }
    if restart_at is not None:
        back = [r["posted"] for r in islands[1]["rounds"] if 1 in r["members"]]
        out |= {
            "restart_to_joined_s": islands[1]["joined_at"] - restart_at,
            "restart_to_first_round_s": back[0] - restart_at,
            "heal_s": islands[1]["healed"]["seconds"],
            "heal_bytes": islands[1]["healed"]["bytes"],
            "healed_at_step": islands[1]["first_step"],
        }
    return out


def run_case(case: str, out: pathlib.Path, steps: int, seed: int, port: int) -> dict:
    if case == "link_cut":
        return _link_cut(out, steps, seed, port)
    job = Job(out, steps, seed, "127.0.0.1", port)
    restart_at = None
    if case == "killed":
        job.wait_for_step(1, KILL_AT)
        job.islands[1].send_signal(signal.SIGKILL)
        job.islands[1].communicate()
        restart_at = time.time()
        job.extra.append(job.island(1))
    job.finish()
    return measure(job, restart_at)


def _link_cut(out: pathlib.Path, steps: int, seed: int, port: int) -> dict:
    from .wan import Wan

    with Wan(M + 1) as wan:
        env = _env()

        def popen(node: int, argv: Sequence[str]) -> subprocess.Popen:
            command = [sys.executable, "-m", "sdiloco", *argv]
            return wan.popen(node, command, env=env, cwd=ROOT, **_captured())

        job = Job(out, steps, seed, wan.ip(0), port, popen)
        job.wait_for_step(1, KILL_AT)
        wan.set_link(2, up=False)  # island 1 is node 2
        time.sleep(CUT_S)
        wan.set_link(2, up=True)
        restart_at = None
        try:  # JAX's runtime ends a process whose heartbeat missed its deadline
            job.islands[1].wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass  # it survived the cut
        else:
            job.islands[1].communicate()
            job.islands[1].returncode = -signal.SIGKILL  # counted as killed
            restart_at = time.time()
            job.extra.append(job.island(1))
        job.finish()
    return measure(job, restart_at) | {"cut_ended_the_island": restart_at is not None}


def _local(argv: Sequence[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "sdiloco", *argv]
    return subprocess.Popen(command, env=_env(), cwd=ROOT, **_captured())


CACHE = pathlib.Path("/tmp/sdiloco-elastic-xla")
"""The islands' compilation cache: filled by the first job, read by every later
process (a restarted island, and the later jobs: a whole-job restart would read it
too)."""


def _env() -> dict:
    return dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(ROOT),
        SDILOCO_JAX_CACHE=str(CACHE),
    )


def _captured() -> dict:
    return dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def summarize(results: dict) -> dict:
    """Seed-paired killed − uninterrupted final losses, with a 95 % t-interval."""
    from sdiloco.paper.experiments import paired_gap

    out = {}
    for case in ("killed", "link_cut"):
        pairs = [
            (r["uninterrupted"]["loss"], r[case]["loss"])
            for r in results.values()
            if case in r and "uninterrupted" in r
        ]
        if len(pairs) >= 2:
            base, other = zip(*pairs)
            out[f"{case}_minus_uninterrupted"] = paired_gap(base, other)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2400)
    parser.add_argument("--link-cut", action="store_true")
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks" / "measured" / "elastic.json")
    )
    parser.add_argument(
        "--rounds", action="store_true", help="round time against message size"
    )
    parser.add_argument("--sizes", default=",".join(map(str, SIZES_MB)), help="MB")
    parser.add_argument("--islands", default="3,4")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--worker", choices=["board", "gloo"], help=argparse.SUPPRESS)
    parser.add_argument("--worker-args", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        port, count, m, size, repeats, mapped = map(int, args.worker_args.split(","))
        work = _board_worker if args.worker == "board" else _gloo_worker
        work(port, count, m, size, repeats, bool(mapped))
        return 0
    if args.rounds:
        return _main_rounds(args)
    return _main_faults(args)


def _main_rounds(args: argparse.Namespace) -> int:
    path = ROOT / "benchmarks" / "measured" / "elastic_rounds.json"
    sizes = [int(x) for x in args.sizes.split(",")]
    islands = [int(x) for x in args.islands.split(",")]
    started = time.perf_counter()
    record = {"machine": machine(), "sizes_mb": sizes}
    record |= bench_rounds(sizes, islands, args.repeats)
    record["large"] = _if_fits(3 * LARGE + (2 << 30), large_crossing)
    record["large"]["note"] = "2 islands, one round, file-backed messages and inbox"
    print(json.dumps({"large": record["large"]}), flush=True)
    record["seconds"] = time.perf_counter() - started
    path.write_text(json.dumps(record, indent=1))
    return 0


def _main_faults(args: argparse.Namespace) -> int:
    path = pathlib.Path(args.out)
    record = json.loads(path.read_text()) if path.exists() else {}
    if record.get("steps") != args.steps or record.get("exchange") != EXCHANGE:
        record = {"steps": args.steps, "exchange": EXCHANGE, "results": {}}
    record |= {"machine": machine(), "grace_s": GRACE, "kill_at": KILL_AT}
    cases = ["uninterrupted", "killed"] + (["link_cut"] if args.link_cut else [])
    port = 25400
    for seed in range(args.seeds):
        done = record["results"].setdefault(str(seed), {})
        for case in cases:
            if case in done:  # resumable: recorded cases are skipped
                continue
            port += 1
            scratch = pathlib.Path(f"/tmp/sdiloco-elastic-{os.getpid()}-{case}-{seed}")
            done[case] = run_case(case, scratch, args.steps, seed, port)
            print(json.dumps({"seed": seed, "case": case, **done[case]}), flush=True)
            record["summary"] = summarize(record["results"])
            path.write_text(json.dumps(record, indent=1))
    print(json.dumps(record["summary"], indent=1))
    return 0


# ------------------------------------------------------ round time against message size

SIZES_MB = (1, 16, 64, 256, 1024)
LARGE = 2_300_000_000
"""Bytes of the message of the large crossing: above 2 GiB (2,147,483,648), the
largest value JAX's coordination service could hold (one protobuf)."""


def bench_rounds(sizes_mb: Sequence[int], islands: Sequence[int], repeats: int) -> dict:
    """Round time of the board (each island posts one message and reads the
    others') beside a gloo all-gather of the same bytes between the same number of
    processes, per message size; a configuration whose processes would not fit in
    the memory available is skipped, and the record says so."""
    out: dict = {"repeats": repeats, "islands": {}}
    for count in islands:
        rows = out["islands"].setdefault(str(count), {})
        for mb in sizes_mb:
            size, reps = mb << 20, repeats if mb <= 64 else max(2, repeats // 2 + 1)
            row: dict = {}
            # islands: own message + one aliased inbox row each; coordinator: a copy each
            need = 3 * count * size + (1 << 30)
            row["board"] = _if_fits(need, lambda: _board_rounds(count, size, reps))
            # gloo: every process holds its input and the gathered [M, B] (twice)
            need = count * (2 * count + 1) * size + (1 << 30)
            row["gloo"] = _if_fits(need, lambda: _gloo_rounds(count, size, reps))
            rows[str(mb)] = row
            print(json.dumps({"islands": count, "MB": mb, **row}), flush=True)
    return out


def large_crossing(repeats: int = 1) -> dict:
    """Two islands, a round of messages of `LARGE` bytes (file-backed, so that the
    machine's memory holds the coordinator's copies), each checked by its digest."""
    del repeats
    return _board_rounds(2, LARGE, 1, mapped=True)


def _if_fits(need: int, fn: Callable[[], dict]) -> dict:
    free = _available()
    if need > free:
        return {"skipped": f"needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} free"}
    return fn()


def _available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _board_rounds(count: int, size: int, repeats: int, mapped: bool = False) -> dict:
    """A coordinator (`python -m sdiloco coordinate`) and `count` worker islands that
    run `repeats` rounds of `size`-byte messages through `board.Rounds`."""
    port = _free_port()
    board = [f"--board=127.0.0.1:{port}", "--grace=600", "--board-timeout=900"]
    coordinator = _local(["coordinate", f"--replicas={count}", *board])
    workers = _workers("board", port, count, size, repeats, mapped)
    results = _collect([*workers, coordinator], timeout=1800)[:count]
    out = _per_round(results, repeats)
    if mapped:
        out |= {
            "bytes": size,
            "digests_equal": all(r["digests_equal"] for r in results),
        }
    return out


def _gloo_rounds(count: int, size: int, repeats: int) -> dict:
    port = _free_port()
    workers = _workers("gloo", port, count, size, repeats, False)
    return _per_round(_collect(workers, timeout=1800), repeats)


def _workers(kind, port, count, size, repeats, mapped) -> list[subprocess.Popen]:
    """`count` worker processes of `kind` ("board" or "gloo")."""
    argv = [sys.executable, "-m", "benchmarks.elastic", f"--worker={kind}"]
    args = f"--worker-args={port},{count},{{m}},{size},{repeats},{int(mapped)}"
    return [
        subprocess.Popen([*argv, args.format(m=m)], env=_env(), cwd=ROOT, **_captured())
        for m in range(count)
    ]


def _per_round(results: list[dict], repeats: int) -> dict:
    """Each round's time on its slowest process, and their median (without the
    first round, which connects, when there are more)."""
    per_round = np.max([r["seconds"] for r in results], axis=0)
    return {
        "median_s": float(np.median(per_round[1:] if repeats > 1 else per_round)),
        "rounds_s": [round(float(x), 4) for x in per_round],
    }


def _collect(procs: list[subprocess.Popen], timeout: float) -> list[dict]:
    """Each process's last output line as JSON (the coordinator's: its summary)."""
    out = []
    for p, (text, _) in zip(procs, communicate_all(procs, timeout)):
        if p.returncode != 0:
            raise RuntimeError(f"a process failed:\n{text[-3000:]}")
        out.append(json.loads(text.strip().splitlines()[-1]))
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _message(size: int, m: int, mapped: bool) -> np.ndarray:
    if not mapped:
        return np.full(size, m + 1, np.uint8)
    path = f"/tmp/sdiloco-large-{os.getpid()}-{m}"
    x = np.memmap(path, np.uint8, "w+", shape=(size,))
    step = 1 << 26
    for start in range(0, size, step):  # a pattern that differs along the message
        x[start : start + step] = (start // step + m) % 251
    os.unlink(path)  # the mapping stays until the process ends
    return x


def _board_worker(port: int, count: int, m: int, size: int, repeats: int, mapped: bool):
    """One island of `_board_rounds`: `repeats` rounds through `board.Rounds` into
    an inbox whose rows share one buffer (the timing of a whole inbox, the memory of
    one row), or file-backed rows for the large crossing."""
    import hashlib

    from sdiloco.distributed import board as board_lib, net

    board = board_lib.Board(f"127.0.0.1:{port}", m + 1, heartbeat_s=60.0)
    depot = net.Depot(board.local_host())
    board.put(board_lib.Keys.island("depot", m), depot.address.encode())
    board.put(board_lib.Keys.island("hello", m), b"1")
    own = _message(size, m, mapped)
    if mapped:
        path = f"/tmp/sdiloco-inbox-{os.getpid()}"
        inbox = np.memmap(path, np.uint8, "w+", shape=(count, size))
        os.unlink(path)
    else:
        row = np.empty(size, np.uint8)
        inbox = np.lib.stride_tricks.as_strided(row, (count, size), (0, 1))
    rounds = board_lib.Rounds(board, depot, m, count, timeout_s=900.0, keep_s=1.0)
    for r in range(repeats):
        rounds(f"{r}-0", own, inbox=inbox)
    result: dict = {"seconds": [x.waited_s for x in rounds.log]}
    if mapped:

        def digest(x):
            return hashlib.blake2b(memoryview(x), digest_size=16).hexdigest()

        board.put(f"digest/{m}", digest(own).encode())
        others = [j for j in range(count) if j != m]
        result["digests_equal"] = all(
            bytes(board.get(f"digest/{j}", 600.0)).decode() == digest(inbox[j])
            for j in others
        )
    board.put(board_lib.Keys.island("done", m), b"1")
    rounds.close()
    depot.close()
    board.close()
    print(json.dumps(result), flush=True)


def _gloo_worker(port: int, count: int, m: int, size: int, repeats: int, mapped: bool):
    """One process of `_gloo_rounds`: `repeats` all-gathers of `size` bytes over
    gloo (`multihost_utils.process_allgather`)."""
    del mapped
    import jax
    from jax.experimental import multihost_utils

    jax.distributed.initialize(
        f"127.0.0.1:{port}", count, m, initialization_timeout=300
    )
    x = np.full(size, m + 1, np.uint8)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        multihost_utils.process_allgather(x)
        seconds.append(time.perf_counter() - start)
    jax.distributed.shutdown()
    print(json.dumps({"seconds": seconds}), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
