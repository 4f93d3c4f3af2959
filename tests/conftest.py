"""Test configuration: strict dtype promotion, several CPU devices, hypothesis profiles."""

import os
import subprocess
import sys
import tempfile


# Must happen before jax initialises its backend: four CPU devices, and XLA:CPU
# compiling fast (`LEVEL_FLAG` and `EMITTER_FLAG` below).
os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0"
    " --xla_cpu_use_fusion_emitters=false",
)

import hypothesis
import jax
import jax.random as jr
import pytest


LEVEL_FLAG = "--xla_backend_optimization_level=0"
EMITTER_FLAG = "--xla_cpu_use_fusion_emitters=false"
"""The suite's compiler flags: LLVM unoptimised, and XLA's older elemental emitters
for fusions in place of its MLIR fusion emitters. Compiles dominate the suite's time:
a FAST tiny-xs run of Streaming FP4 takes 11 CPU-s with both in place of 17-19 with
the first alone, and 23.5 at XLA's defaults; the suite took 16 % less CPU with both
than with the first alone (2,401 against 2,871 CPU-s, cold cache, 2 cores, side by
side). No test compares a number with the records' (made at XLA's defaults), and the
subprocesses a test compares with compile as it does (`helpers.cpu_env`). But the
two flags together round one program otherwise than another that XLA's defaults (or
either flag alone) round alike, so the tests that check two formulations of a step
bitwise (marked `two_programs`) run in a child pytest without `EMITTER_FLAG`
(`pytest_pyfunc_call`)."""
CHILD = "SDILOCO_TEST_CHILD"
"""Set in the child process a `two_programs` test runs in."""

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_num_cpu_devices", 4)
# XLA:CPU compiles dominate the suite's time; identical programs (the same step built
# twice, e.g. a run and its resumed half) are compiled once and reused across runs.
COMPILE_CACHE = os.environ.get(
    "SDILOCO_JAX_CACHE", os.path.join(tempfile.gettempdir(), "sdiloco-jax-cache")
)
jax.config.update("jax_compilation_cache_dir", COMPILE_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
# The tests' subprocesses (CLI runs, multi-process jobs, islands, notebooks) share it
# too: a resumed job loads the programs of the run it resumes, and one test's job
# those of another with the same flags. JAX reads these when it is imported.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", COMPILE_CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

hypothesis.settings.register_profile(
    "dev", max_examples=20, derandomize=True, database=None, deadline=None
)
hypothesis.settings.register_profile(
    "ci", max_examples=100, derandomize=True, database=None, deadline=None
)
hypothesis.settings.load_profile(os.environ.get("SDILOCO_HYPOTHESIS_PROFILE", "dev"))


HLO_JAX_VERSION = "0.10.2"
"""The jax version the `hlo` tests were written for: they read the program XLA
compiles (which collectives, loops and copies it holds), which another jax and XLA may
lay out otherwise with no bug. On another version they are skipped, saying so."""


HEAVY_FIRST = ("notebook", "multiprocess", "integration")
"""The tiers whose tests each take tens of seconds to minutes, run before the rest, so
that no long test is left for one worker at the end while the other has finished
(about 2 minutes of the suite's 26 in a fresh clone, when the notebooks came last);
the short unit tests fill in around them. `pytest -n 2` hands tests out in this order,
one at a time as a worker frees up (`pytest_xdist_make_scheduler` below)."""

MULTIPROCESS_FILES = (
    "tests/test_distributed.py",
    "tests/test_elastic.py",
    "tests/test_scale_out.py",
    "tests/test_wan.py",
)
"""The files that hold the `multiprocess` tests (checked at collection). Under
`pytest -n 2` each of these files runs whole on one worker, one test after another:
a multi-process test starts 2-4 processes that wait on each other in real time, and
two such jobs at once on 2 cores took 1.2-1.8x as long each (the SIGKILL test
139 -> 187 s). xdist's own `--dist=loadgroup` would do it by marker, but with pytest
9.2 it groups nothing (xdist 3.8 renames `item._nodeid`, which pytest 9 no longer
reads), and the scheduler sees only test ids, hence the files."""


def _file(nodeid: str) -> str:
    return nodeid.split("::")[0]


def scope(nodeid: str) -> str:
    """The unit `pytest -n 2` hands to a worker that a test belongs to: the test
    itself, or "multiprocess" for every test of `MULTIPROCESS_FILES`."""
    return "multiprocess" if _file(nodeid) in MULTIPROCESS_FILES else nodeid


def _tier(item) -> int:
    return next(
        (i for i, m in enumerate(HEAVY_FIRST) if m in item.keywords), len(HEAVY_FIRST)
    )


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class MultiProcessFilesTogether(LoadScopeScheduling):
        """Every test on its own, in collection order, but the multi-process files
        together (a larger scope goes first: the 2-4-process jobs start at once)."""

        def _split_scope(self, nodeid: str) -> str:
            return scope(nodeid)

    return MultiProcessFilesTogether(config, log)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_tier)  # stable: the order within a tier is the collection's
    multiprocess = {
        _file(item.nodeid) for item in items if "multiprocess" in item.keywords
    }
    strays = sorted(multiprocess - set(MULTIPROCESS_FILES))
    if strays:
        raise pytest.UsageError(
            f"multiprocess tests in {strays}: add the files to "
            "conftest.MULTIPROCESS_FILES"
        )
    if jax.__version__ == HLO_JAX_VERSION:
        return
    skip = pytest.mark.skip(
        reason=f"reads XLA's compiled program as jax {HLO_JAX_VERSION} lays it out "
        f"(jax {jax.__version__} here)"
    )
    for item in items:
        if "hlo" in item.keywords:
            item.add_marker(skip)


def pytest_pyfunc_call(pyfuncitem):
    """A `two_programs` test runs in a child pytest, compiled without
    `EMITTER_FLAG` (its verdict is the child's; its output is shown if it fails)."""
    if "two_programs" not in pyfuncitem.keywords or os.environ.get(CHILD):
        return None
    flags = [f for f in os.environ["XLA_FLAGS"].split() if f != EMITTER_FLAG]
    env = dict(os.environ, XLA_FLAGS=" ".join(flags), **{CHILD: "1"})
    argv = ["-m", "pytest", "-q", "-m", "", "-p", "no:cacheprovider"]
    proc = subprocess.run(
        [sys.executable, *argv, pyfuncitem.nodeid],
        cwd=pyfuncitem.config.rootpath,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        pytest.fail(
            f"in a child process compiled without {EMITTER_FLAG}:\n"
            + (proc.stdout + proc.stderr)[-6000:],
            pytrace=False,
        )
    return True


@pytest.fixture
def getkey():
    """Return a function that hands out fresh, deterministic PRNG keys."""
    key = jr.key(0)

    def _getkey():
        nonlocal key
        key, sub = jr.split(key)
        return sub

    return _getkey
