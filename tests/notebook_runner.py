"""One process that runs notebooks' `.py` files one after another, as `python
notebook.py` would, for `test_notebooks` (`NotebookRunner`).

Each xdist worker starts one and hands it every notebook it is given, so that the
imports (jax, equinox, matplotlib, the package: ~2.7 CPU-s) happen once per worker
rather than once per notebook, and what jax keeps in memory (its caches of traced and
compiled programs) stays for the next notebook. What a notebook runs in is as `python
notebook.py` gives it: fresh globals as `__main__`, its folder the working directory
and first on `sys.path`, the environment the test asks for; matplotlib's figures are
closed after it. Besides jax's caches, a notebook shares with the ones before it only
the FAST runs they trained, which it would read from `experiments.FAST_RUNS` anyway.

Protocol: one JSON line in per notebook (`path`, `env`, `log`: where its stdout and
stderr go), one JSON line back (`ok`, `error`: the traceback). Run as a script.
"""

import contextlib
import json
import os
import pathlib
import runpy
import select
import subprocess
import sys
import traceback


def _run(path: pathlib.Path, env: dict[str, str], log: pathlib.Path) -> dict:
    import matplotlib.pyplot as plt  # here: `MPLBACKEND` is in the runner's env

    before = dict(os.environ)
    os.environ.update(env)
    os.chdir(path.parent)
    sys.argv = [path.name]
    sys.path.insert(0, str(path.parent))
    error = ""
    with (
        open(log, "w") as out,
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(out),
    ):
        try:
            runpy.run_path(str(path), run_name="__main__")
        except SystemExit as e:
            if e.code not in (None, 0):
                error = traceback.format_exc()
        except Exception:
            error = traceback.format_exc()
        finally:
            sys.path.remove(str(path.parent))
            plt.close("all")
            os.environ.clear()  # the next notebook gets the runner's env and its own
            os.environ.update(before)
    return {"ok": not error, "error": error}


def serve() -> None:
    # The replies go to the original stdout alone: anything else written to file
    # descriptor 1 (a library's own print) goes to stderr.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for line in sys.stdin:
        request = json.loads(line)
        reply = _run(
            pathlib.Path(request["path"]), request["env"], pathlib.Path(request["log"])
        )
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


class NotebookRunner:
    """A `serve` process, started on first use and again after one dies or times
    out."""

    def __init__(self, env: dict[str, str], log: pathlib.Path):
        self.env, self.log = env, log
        self.proc: subprocess.Popen | None = None

    def run(
        self, path: pathlib.Path, env: dict[str, str], log: pathlib.Path, timeout: float
    ) -> dict:
        """Run notebook `path` with `env` added; its output is written to `log`.
        Returns `ok` and `error`; a runner that died or ran past `timeout` seconds
        is stopped, and `error` says so."""
        if self.proc is None or self.proc.poll() is not None:
            self.close()
            with open(self.log, "a") as stderr:
                self.proc = subprocess.Popen(
                    [sys.executable, __file__],
                    env=self.env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=stderr,
                    text=True,
                )
        assert self.proc.stdin and self.proc.stdout
        request = {"path": str(path), "env": env, "log": str(log)}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if line:
            return json.loads(line)
        self.close()
        why = "ran past its time limit" if not ready else "died"
        tail = self.log.read_text()[-3000:] if self.log.exists() else ""
        return {"ok": False, "error": f"the notebook runner {why}; its stderr:\n{tail}"}

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.communicate()  # waits, and closes its pipes
            self.proc = None


if __name__ == "__main__":
    serve()
