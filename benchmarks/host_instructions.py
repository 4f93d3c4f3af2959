"""Instructions per inner-only step, counted by callgrind: where Streaming DiLoCo's
extra time over plain training goes when no fragment syncs.

Usage: `python -m benchmarks.host_instructions [--steps 6] [--programs plain,float32]
[--keep DIR]` (needs `valgrind` on the PATH; about 2-3 minutes per program).

Timing cannot resolve a difference of 1-2 % per step on a shared machine; an
instruction count can: it is the same in every run. Each program of `sync_heavy.py`
(the ~1M-parameter stacked MLP, M = 2, H = 20, 2 fragments) runs in its own process
under `valgrind --tool=callgrind` with counting off while it compiles and warms up
(22 steps, past the first sends and arrivals), then on for `--steps` steps of the
inner-only stretch of a period (steps 23 onwards, where nothing is sent or arrives;
the run checks it), dispatched as in training (blocked only at the end). The count
includes every thread: the Python caller, jax's dispatch, and XLA:CPU's worker.

It prints instructions per step in four groups:
- kernels: the code XLA generated, and the libraries it calls for dots and loops
  (YNNPACK, its Slinky loop runtime, Eigen, oneDNN);
- runtime: the rest of jaxlib (jax's C++ dispatch, PjRt, XLA:CPU's thunk executor);
- Python: the interpreter (the library's own Python, e.g. `jit_step`'s call);
- allocator: libc's malloc and free (called by the runtime for buffers);
and the functions whose counts differ most from the plain program's. A count is
work, not time: the kernels run at several instructions per cycle, the runtime and
the allocator at about one, so the same count of host instructions takes longer.
Instructions are not cycles either: cache misses and the memory traffic of the
sync's loops (which do not run in an inner-only step) are not seen here.
"""

import argparse
import collections
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

from benchmarks.sync_heavy import COMPRESSORS


STEPS_BEFORE = 22
"""Steps run before counting: one period (H = 20) and 2 more, so that the counted
steps (23 onwards, at most 7 of them) neither send nor receive."""

GROUPS = ("kernels", "runtime", "Python", "allocator", "other")
PROGRAMS = ("plain", *COMPRESSORS)
"""The programs of `sync_heavy.py`: the plain baseline and each Streaming one."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="counted steps (1-7)")
    parser.add_argument("--programs", default=",".join(PROGRAMS))
    parser.add_argument("--keep", default=None, help="keep the callgrind files here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--handshake", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not 1 <= args.steps <= 7:
        parser.error(f"--steps={args.steps}: the inner-only stretch holds 1 to 7")
    if args.child:
        return child(args.child, args.steps, pathlib.Path(args.handshake))
    programs = args.programs.split(",")
    unknown = [p for p in programs if p not in PROGRAMS]
    if unknown:
        parser.error(f"--programs: {unknown} not among {', '.join(PROGRAMS)}")
    for tool in ("valgrind", "callgrind_control", "callgrind_annotate"):
        if shutil.which(tool) is None:
            sys.exit(f"host_instructions: {tool} not found on the PATH (valgrind)")
    out_dir = pathlib.Path(args.keep or tempfile.mkdtemp(prefix="host_instr_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name in programs:
        counts[name] = measure(name, args.steps, out_dir)
        print(f"{name}: {sum(counts[name].values()) / 1e6:.3f} M per step", flush=True)
    report(counts)
    if not args.keep:
        shutil.rmtree(out_dir)


def measure(name: str, steps: int, out_dir: pathlib.Path) -> dict:
    """Instructions per step of one program, by function (callgrind, exclusive)."""
    shake = out_dir / f"shake_{name}"
    shake.mkdir(exist_ok=True)
    for f in shake.iterdir():
        f.unlink()
    out = out_dir / f"{name}.callgrind"
    command = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        "--smc-check=all-non-file",  # XLA writes its code at run time
        f"--callgrind-out-file={out}",
        sys.executable,
        "-m",
        "benchmarks.host_instructions",
        f"--child={name}",
        f"--steps={steps}",
        f"--handshake={shake}",
    ]
    log = open(out_dir / f"{name}.log", "w")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        for mark, switch in (("ready", "on"), ("done", "off")):
            wait_for(shake / mark, proc)
            subprocess.run(
                ["callgrind_control", "-i", switch, str(proc.pid)],
                check=True,
                capture_output=True,
            )
            release(shake / f"go_{mark}", proc)
        if proc.wait(timeout=600) != 0:
            raise RuntimeError(f"{name}: the counted run failed; see {log.name}")
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    check = (shake / "check").read_text()
    if check != "inner-only":
        raise RuntimeError(f"{name}: the counted steps were not inner-only: {check}")
    return by_function(out, steps)


def release(fifo: pathlib.Path, proc: subprocess.Popen, limit: float = 60) -> None:
    """Write to the FIFO the child is blocked on (without blocking here if it died)."""
    start = time.monotonic()
    while True:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # fails until it reads
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() - start > limit:
                raise RuntimeError("the counted process stopped waiting") from None
            time.sleep(0.05)
    os.write(fd, b"go")
    os.close(fd)


def wait_for(path: pathlib.Path, proc: subprocess.Popen, limit: float = 900) -> None:
    start = time.monotonic()
    while not path.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"the counted process exited early ({proc.returncode})")
        if time.monotonic() - start > limit:
            raise TimeoutError(f"no {path.name} from the counted process")
        time.sleep(0.2)


def child(name: str, steps: int, shake: pathlib.Path) -> None:
    """Build one program, warm it up, and run the counted steps between handshakes."""
    import jax
    import numpy as np

    from benchmarks.sync_heavy import M, plain_program, streaming_program, workload

    params, inner, frags, period = workload()
    if name == "plain":
        step, state = plain_program(params, inner, M)
    else:
        step, state = streaming_program(params, inner, frags, COMPRESSORS[name])
    batches = period + period
    for b in batches[:STEPS_BEFORE]:
        state, metrics = step(state, b)
    jax.block_until_ready(state)
    handshake(shake, "ready")
    synced = []
    for b in batches[STEPS_BEFORE : STEPS_BEFORE + steps]:
        state, metrics = step(state, b)
        if metrics is not None:  # kept on device, read after counting
            synced.append([metrics[k] for k in ("sync/sent", "sync/applied")])
    jax.block_until_ready(state)
    handshake(shake, "done")
    busy = [bool(np.any(np.asarray(x))) for pair in synced for x in pair]
    (shake / "check").write_text("inner-only" if not any(busy) else f"{busy}")


def handshake(shake: pathlib.Path, mark: str) -> None:
    """Say `mark` and wait for the parent's go, blocked in the kernel on a FIFO (a
    polling loop would be counted)."""
    go = shake / f"go_{mark}"
    os.mkfifo(go)
    (shake / mark).touch()
    with open(go) as f:
        f.read()


LINE = re.compile(r"\s*([\d,]+) \(\s*[\d.]+%\)\s+(.*)")
GENERATED = "(code XLA generated)"


def by_function(path: pathlib.Path, steps: int) -> dict:
    """{function: instructions per step} from a callgrind file (exclusive counts)."""
    text = subprocess.run(
        ["callgrind_annotate", "--threshold=100", str(path)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return parse(text, steps)


def parse(text: str, steps: int) -> dict:
    """{function: count per step} from `callgrind_annotate`'s listing; the code XLA
    generated (no symbols, one address per kernel) is summed under one name."""
    counts: dict = collections.Counter()
    for line in text.splitlines():
        match = LINE.match(line)
        if not match or "PROGRAM TOTALS" in match.group(2):
            continue
        function = match.group(2).strip()
        if re.match(r"\?\?\?:0x[0-9a-f]+", function):
            function = GENERATED
        counts[function] += int(match.group(1).replace(",", "")) / steps
    return counts


def group(function: str) -> str:
    """The group of a function as `callgrind_annotate` names it (with its object)."""
    if function == GENERATED or re.search(
        r"ynn::|ynn_|slinky::|Eigen::|dnnl", function
    ):
        return "kernels"
    if re.search(r"malloc|_int_free|\bfree\b|memalign|unlink_chunk", function):
        return "allocator"
    if "libpython" in function or "Python-3" in function:
        return "Python"
    if "jaxlib" in function or "libjax" in function or "libstdc++" in function:
        return "runtime"
    return "other"


def report(counts: dict) -> None:
    names = list(counts)
    print("\ninstructions per inner-only step (thousands), by group:")
    print("| group | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    totals = {n: collections.Counter() for n in names}
    for n in names:
        for function, c in counts[n].items():
            totals[n][group(function)] += c
    for g in (*GROUPS, "total"):
        cells = [
            sum(totals[n].values()) if g == "total" else totals[n][g] for n in names
        ]
        print(f"| {g} | " + " | ".join(f"{c / 1e3:,.1f}" for c in cells) + " |")
    if "plain" not in counts:
        return
    base = counts["plain"]
    for n in names:
        if n == "plain":
            continue
        diff = {
            f: counts[n].get(f, 0) - base.get(f, 0) for f in set(counts[n]) | set(base)
        }
        total = sum(diff.values())
        print(
            f"\n{n} − plain: {total / 1e3:+,.1f} thousand per step "
            f"({total / sum(base.values()):+.2%}); largest differences:"
        )
        for f in sorted(diff, key=lambda f: -abs(diff[f]))[:12]:
            short = short_name(f)
            print(f"  {diff[f] / 1e3:+9.1f}  [{group(f)}] {short}")


def short_name(function: str) -> str:
    """`file:function(args) [object]` → `function`."""
    if function == GENERATED:
        return function
    name = re.sub(r" \[[^]]*\]$", "", function)
    name = name.replace("(anonymous namespace)", "{anon}")
    name = re.sub(r"\(.*", "", name)  # the arguments
    return re.sub(r"^(\?\?\?|[^ :]*\.(c|cc|cpp|h|S)):", "", name)[:90]  # the file


if __name__ == "__main__":
    main()
