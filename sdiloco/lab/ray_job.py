"""The elastic job's driver: Ray started or joined, the syncer and islands made, and
their deaths, restarts and ends watched (`run_job`; `train --elastic`).

The driver is the process of the command. It makes the syncer (`max_restarts=0`:
a lost syncer ends the job, which the same command resumes from the islands'
checkpoints) and one island actor per replica (`max_restarts`: Ray restarts a
killed island, whose `run` the driver calls again; it heals and rejoins), tells
the syncer which actor is which island (so no other process can claim one) and
when an island's process died. It ends when every island has ended, with one line
per island that could not finish, and one line when no island could.
"""

import dataclasses
import json
import os
import time
from typing import Any

from .config import RunConfig
from .elastic import ElasticOptions, Island, _write, fingerprint, object_store_size


@dataclasses.dataclass
class JobResult:
    """What the job left: each finished island's summary, one line for each island
    that could not finish, and the syncer's report (decisions, refusals)."""

    summaries: dict[int, dict[str, Any]]
    errors: dict[int, str]
    syncer: dict[str, Any]
    restarts: dict[int, int]


def start_ray(options: ElasticOptions, config: RunConfig, namespace: str) -> None:
    """Join `options.address`, or start a local instance: dashboard off, token
    authentication on, the object store sized to the job (`object_store_size`).

    Token authentication is asked for before Ray is imported (`RAY_AUTH_MODE=token`,
    which Ray reads once): a local instance makes its token (`~/.ray/auth_token`),
    a cluster's is read from there or from `RAY_AUTH_TOKEN`. A job refuses to run
    with it turned off."""
    mode = os.environ.setdefault("RAY_AUTH_MODE", "token")
    if mode != "token":
        raise ValueError(
            f"RAY_AUTH_MODE={mode!r}; allowed: 'token' (the elastic job keeps Ray's "
            "token authentication on)."
        )
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    common: dict[str, Any] = dict(
        namespace=namespace, log_to_driver=True, configure_logging=False
    )
    if options.address is not None:
        ray.init(address=options.address, **common)
        return
    size = options.object_store_bytes or object_store_size(config)
    ray.init(
        address="local",  # a new instance, whatever other cluster runs here
        num_cpus=max(2, os.cpu_count() or 2),
        object_store_memory=size,
        include_dashboard=False,
        **common,
    )


def run_job(
    config: RunConfig,
    options: ElasticOptions,
    out_dir: str | None,
    *,
    resume: bool = True,
    progress: bool = False,
    min_step_s: float = 0.0,
) -> JobResult:
    """Run the elastic job of `config` (M = `config.method.num_replicas` islands)
    until every island has ended (see the module)."""
    import ray

    from ..distributed.syncer import Syncer

    count = config.method.num_replicas
    start_ray(options, config, namespace=f"sdiloco-{os.getpid()}")
    try:
        syncer = _syncer(ray, Syncer, config, options)
        _write(out_dir, "syncer.pid", str(ray.get(syncer.ping.remote())))
        context = ray.get_runtime_context()
        where = {"namespace": context.namespace, "address": context.gcs_address}
        _write(out_dir, "ray.json", json.dumps(where))
        actor = ray.remote(Island)
        placement = _placement(ray)
        islands = [
            actor.options(
                name=f"island-{m}",
                max_restarts=options.max_restarts,
                max_task_retries=0,
                num_cpus=0,
                max_concurrency=4,
                scheduling_strategy=placement(m),
            ).remote()
            for m in range(count)
        ]
        for m, a in enumerate(islands):
            syncer.register.remote(m, a)
        args = (options, out_dir, syncer)
        kw = dict(resume=resume, progress=progress, min_step_s=min_step_s)

        def start(m: int) -> Any:
            return islands[m].run.remote(config, m, *args, **kw)

        result = _watch(start, count, syncer, options.max_restarts, out_dir)
        if out_dir is not None:
            _write(out_dir, "syncer.json", json.dumps(result.syncer, indent=1))
        return result
    finally:
        ray.shutdown()


def _syncer(ray: Any, kind: Any, config: RunConfig, options: ElasticOptions) -> Any:
    """The job's syncer actor: no restart (its state is the rounds in flight), on
    the driver's node (a node cut off from the others takes no syncer with it)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    return (
        ray.remote(kind)
        .options(
            name="syncer",
            max_restarts=0,
            num_cpus=0,
            max_concurrency=10_000,
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
        )
        .remote(
            config.method.num_replicas,
            fingerprint(config),
            grace_s=options.grace_s,
            start_s=options.start_s,
            keep_s=options.keep_s,
            heartbeat_s=options.heartbeat_s,
            serve_s=max(10.0, 2 * options.grace_s),
            steps=config.steps,
        )
    )


def _watch(
    start: Any, count: int, syncer: Any, max_restarts: int, out_dir: str | None
) -> JobResult:
    """Start every island and wait for them all; an island whose process died
    (Ray restarted its actor), that fell out of step with the job, or whose run
    raised an error of any other kind, is run again while it has restarts left: it
    heals from a live peer. No island's error ends the job."""
    import ray
    from ray import exceptions as rx

    running = {start(m): m for m in range(count)}
    result = JobResult({}, {}, {}, {m: 0 for m in range(count)})
    while running:
        ready, _ = ray.wait(list(running), num_returns=1, timeout=1.0)
        for ref in ready:
            m = running.pop(ref)
            try:
                out = ray.get(ref)
            except rx.ActorUnavailableError:  # being restarted: ask again soon
                _tell(syncer, "lost", m, False)
                time.sleep(0.5)
                running[start(m)] = m
                continue
            except rx.RayActorError:  # its process died: Ray restarts the actor
                out = _after_death(syncer, m, out_dir)
            except rx.RayError as e:  # its run raised, or Ray lost its result:
                # that island's end, not the job's
                out = {"error": f"island {m} failed: {_cause(e)}", "again": True}
            if "summary" in out:
                result.summaries[m] = out["summary"]
                continue
            result.restarts[m] += out["again"]
            if out["again"] and result.restarts[m] <= max_restarts:
                _tell(syncer, "lost", m, False)
                running[start(m)] = m
                continue
            _tell(syncer, "lost", m, True)
            result.errors[m] = out["error"]
            if out["again"]:
                result.errors[m] += (
                    f"; ended {result.restarts[m]} times, no restart left "
                    f"(max_restarts={max_restarts})"
                )
    try:
        result.syncer = ray.get(syncer.report.remote(), timeout=10)
    except Exception:  # noqa: BLE001 - the syncer is gone: no report
        result.syncer = {}
    return result


def _after_death(syncer: Any, m: int, out_dir: str | None) -> dict[str, Any]:
    """What a dead island's run counts as: finished, when it had trained its last
    step and written its summary (it died serving heals after it); else a restart."""
    import ray

    try:
        done = bool(ray.get(syncer.is_done.remote(m), timeout=10))
    except Exception:  # noqa: BLE001 - the syncer is gone: the islands say so
        done = False
    path = None if out_dir is None else os.path.join(out_dir, f"island-{m}.json")
    if done and path is not None and os.path.exists(path):
        with open(path) as f:
            return {"summary": json.load(f)}
    return {"error": f"island {m} died", "again": True}


def _cause(error: Any) -> str:
    """One line for an error of an island's run (Ray wraps what the run raised)."""
    cause = getattr(error, "cause", None) or error
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[-1] if text else ''}"


def _tell(syncer: Any, method: str, *args: Any) -> None:
    """A call to the syncer that may fail (it is gone: the islands say so)."""
    try:
        getattr(syncer, method).remote(*args)
    except Exception:  # noqa: BLE001
        pass


def _placement(ray: Any) -> Any:
    """Where island m goes: on a cluster of several nodes, on node m mod n (the
    nodes alive at the start, in the order of their ids), pinned: Ray restarts it on
    that node, and an island whose node is gone is out of the job (the others go
    on). On one node, anywhere. Ray's `SPREAD`, and its soft node affinity, are best
    effort: on three fresh nodes they put two of three islands on one node."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    if len(nodes) < 2:
        return lambda m: "SPREAD"
    return lambda m: NodeAffinitySchedulingStrategy(nodes[m % len(nodes)], soft=False)
