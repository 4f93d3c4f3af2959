"""Where the test suite's time goes: a pytest plugin and its summary.

Run the suite with the plugin (a cold compilation cache, as on a fresh machine)::

    SDILOCO_JAX_CACHE=$(mktemp -d) SUITE_TIME_OUT=/tmp/suite-time \\
        python -m pytest -p benchmarks.suite_time -n 2 -m ""
    python -m benchmarks.suite_time /tmp/suite-time

Per test (in the pytest process only: a test's subprocesses, e.g. notebooks and
islands, count as its wall time) it records the wall time, the CPU time (of the pytest
process and of the subprocesses it waited for; well under the wall time means the test
mostly waits), each XLA compilation (its time and a hash of the program compiled) and
JAX's tracing and lowering time. The
summary gives them per file and for the slowest tests, and how much compile time went
to a program the same worker had compiled before (what sharing programs between tests
would save; the compilation cache also shares them across workers).
"""

import collections
import hashlib
import json
import os
import pathlib
import resource
import sys
import time

import pytest


OUT = "SUITE_TIME_OUT"
"""Environment variable: the folder the plugin writes one JSON-lines file per
process to (default `suite-time` in the working directory)."""

_rows: list[dict] = []
_test = {"id": "<collection>"}


def _record_compiles() -> None:
    from jax._src import compiler, dispatch, monitoring
    from jax._src.interpreters import mlir

    compile_or_get_cached = compiler.compile_or_get_cached

    def timed(backend, module, *args, **kwargs):
        start = time.perf_counter()
        executable = compile_or_get_cached(backend, module, *args, **kwargs)
        seconds = time.perf_counter() - start
        program = hashlib.sha1(mlir.module_to_bytecode(module)).hexdigest()[:16]
        name = str(module.operation.attributes["sym_name"]).strip('"')
        _rows.append(
            {"test": _test["id"], "kind": "compile", "s": seconds, "program": program}
            | {"name": name}
        )
        return executable

    compiler.compile_or_get_cached = timed
    phases = {dispatch.JAXPR_TRACE_EVENT: "trace"}
    phases[dispatch.JAXPR_TO_MLIR_MODULE_EVENT] = "lower"

    def listen(event, seconds, **kwargs):
        if event in phases:
            _rows.append({"test": _test["id"], "kind": phases[event], "s": seconds})

    monitoring.register_event_duration_secs_listener(listen)


def pytest_configure(config):
    _record_compiles()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _test["id"] = item.nodeid
    start, cpu = time.perf_counter(), _cpu_seconds()
    yield
    seconds = time.perf_counter() - start
    _rows.append({"test": item.nodeid, "kind": "wall", "s": seconds})
    _rows.append({"test": item.nodeid, "kind": "cpu", "s": _cpu_seconds() - cpu})
    _test["id"] = "<between tests>"


def _cpu_seconds() -> float:
    """CPU seconds used so far by this process and the subprocesses it has waited on."""
    used = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        used += usage.ru_utime + usage.ru_stime
    return used


def pytest_unconfigure(config):
    out = pathlib.Path(os.environ.get(OUT, "suite-time"))
    out.mkdir(parents=True, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(out / f"{worker}-{os.getpid()}.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in _rows)


def summarize(folder: pathlib.Path, slowest: int = 25) -> str:
    """The plugin's records in `folder`, per file and for the `slowest` tests."""
    per_file = collections.defaultdict(collections.Counter)
    per_test = collections.defaultdict(collections.Counter)
    seen: dict[tuple[str, str], bool] = {}
    programs = set()
    for path in sorted(folder.glob("*.jsonl")):
        worker = path.name.split("-")[0]
        for line in path.read_text().splitlines():
            row = json.loads(line)
            kind, seconds = row["kind"], row["s"]
            tallies = (per_file[row["test"].split("::")[0]], per_test[row["test"]])
            for tally in tallies:
                tally[kind] += seconds
            if kind == "compile":
                programs.add(row["program"])
                again = seen.setdefault((worker, row["program"]), False)
                seen[(worker, row["program"])] = True
                for tally in tallies:
                    tally["compiles"] += 1
                    tally["again"] += seconds if again else 0.0
    total = sum(per_file.values(), collections.Counter())
    head = f"{'':44} {'wall':>7} {'cpu':>6} {'compile':>8} {'count':>6} {'again':>6}"
    head += f" {'trace':>6} {'lower':>6}"

    def line(name, t):
        return (
            f"{name[-44:]:44} {t['wall']:7.0f} {t['cpu']:6.0f} {t['compile']:8.0f} "
            f"{t['compiles']:6.0f} {t['again']:6.0f} {t['trace']:6.0f} "
            f"{t['lower']:6.0f}"
        )

    lines = [
        "seconds summed over the workers; 'again': compiles of a program the same "
        f"worker had compiled before; {len(programs)} distinct programs",
        head,
        line("all", total),
    ]
    lines += [line(f, t) for f, t in sorted(per_file.items(), key=_by_wall)]
    lines += ["", f"the {slowest} slowest tests", head]
    ranked = sorted(per_test.items(), key=_by_wall)[:slowest]
    lines += [line(name, t) for name, t in ranked]
    return "\n".join(lines)


def _by_wall(item):
    return -item[1]["wall"]


if __name__ == "__main__":
    folder = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "suite-time")
    print(summarize(folder))
