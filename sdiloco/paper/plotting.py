"""Shared plotting and artifact writing for the paper-figure notebooks.

Every notebook under `notebooks/` writes its artifact through this module, so that each
artifact in `paper_figures/` comes with the same metadata and the same look:

- `save_figure(fig, name, ...)` writes `<name>.png` and `<name>.json`;
- `save_table(rows, name, ...)` writes `<name>.md` (the paper's layout), `<name>.csv`
  and `<name>.json`.

The JSON records the configuration, seeds, package versions, git commit, whether the
notebook ran in FAST mode and how long it took. A file whose bytes would not change is
not written again, and a JSON that would differ only in its stamps (`STAMPS`: time,
commit, machine) is left as it is, so re-rendering leaves a clean checkout clean. `FAST` (environment variable
`SDILOCO_FAST=1`) selects the notebooks' small mode; `SDILOCO_FIGURES_DIR` redirects the
output (the tests write to a temporary directory).

Notebooks, artifacts and the run cache belong to a repository checkout, never to the
installed package: `repo_root()` finds it from `$SDILOCO_REPO` or the current directory.
"""

import csv
import dataclasses
import datetime
import importlib.metadata
import io
import json
import math
import os
import pathlib
import platform
import subprocess
import time
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib.pyplot as plt

from ..lab import fields


FAST: bool = os.environ.get("SDILOCO_FAST", "0") not in ("", "0", "false", "False")
"""Whether notebooks run their small, same-code-path mode (`SDILOCO_FAST=1`)."""

REPO_MARKERS = ("notebooks", "pyproject.toml")
"""What a directory holds to count as a checkout of this repository."""

_SOURCE_ROOT = pathlib.Path(__file__).resolve().parents[2]


def find_checkout() -> pathlib.Path | None:
    """The repository checkout to work in, or None outside one.

    `$SDILOCO_REPO` if set; else the nearest directory holding `notebooks/` and
    `pyproject.toml`, from the current directory upwards; else the checkout this
    module was imported from (an editable install). An installed wheel is no
    checkout, so nothing is ever read from or written into site-packages.
    """
    env = os.environ.get("SDILOCO_REPO")
    if env:
        return pathlib.Path(env).resolve()
    cwd = pathlib.Path.cwd().resolve()
    for d in (cwd, *cwd.parents, _SOURCE_ROOT):
        if all((d / m).exists() for m in REPO_MARKERS):
            return d
    return None


def repo_root() -> pathlib.Path:
    """`find_checkout()`, or the current directory outside a checkout."""
    return find_checkout() or pathlib.Path.cwd().resolve()


REPO_ROOT = repo_root()
"""The checkout (or current directory) when this module was imported."""

METHOD_COLORS: dict[str, str] = {
    "data_parallel": "tab:blue",
    "diloco": "tab:orange",
    "streaming": "tab:green",
    "streaming_overlap": "tab:purple",
    "streaming_overlap_fp4": "tab:red",
}
"""The paper's colours: Data-Parallel blue, DiLoCo orange, Streaming green, ours red."""

STAMPS = ("created", "wall_s_since_import", "git_commit", "machine")
"""Fields of an artifact's JSON that change at every execution: they are written
only with a change of anything else."""

_START = time.perf_counter()
_PACKAGES = ("sdiloco", "jax", "jaxlib", "equinox", "optax", "numpy", "matplotlib")


def output_dir() -> pathlib.Path:
    """Where artifacts go: `$SDILOCO_FIGURES_DIR`, else `paper_figures/` of the repo."""
    env = os.environ.get("SDILOCO_FIGURES_DIR")
    path = pathlib.Path(env) if env else repo_root() / "paper_figures"
    path.mkdir(parents=True, exist_ok=True)
    return path


def published_results(name: str) -> list[dict[str, Any]]:
    """The result rows of the artifact `name` as last saved in `output_dir()` (its
    `.json`), or `[]` if it has none: what a notebook published before, e.g. the
    choices a search run again keeps (`tuning.TIE`)."""
    path = output_dir() / f"{name}.json"
    if not path.exists():
        return []
    return list(json.loads(path.read_text()).get("results") or [])


def style() -> None:
    """One look for every figure (called by the notebooks before plotting)."""
    plt.rcParams.update(
        {
            "figure.dpi": 110,
            "savefig.dpi": 130,
            "figure.figsize": (6.4, 4.0),
            "axes.grid": True,
            "grid.alpha": 0.3,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "legend.frameon": False,
            "font.size": 10,
        }
    )


def git_commit() -> str:
    """The repository's HEAD commit (with "+dirty" if the tree has changes), or "unknown"."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=repo_root(),
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=repo_root(),
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def versions() -> dict[str, str]:
    """Versions of the packages that produced an artifact."""
    out = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def _jsonable(x: Any) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        # As the config's own JSON: a field added after the sidecars were written is
        # left out at its default, so they stay as they were (`fields.new_field`).
        return _jsonable(fields.to_dict(x))
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item") and getattr(x, "ndim", 1) == 0:
        return getattr(x, "item")()
    if hasattr(x, "tolist"):
        return getattr(x, "tolist")()
    if isinstance(x, str | int | float | bool) or x is None:
        return x
    return repr(x)


def write_meta(
    name: str,
    *,
    notebook: str,
    config: Any = None,
    seeds: Sequence[int] = (),
    results: Any = None,
    changed: bool = False,
    **extra: Any,
) -> pathlib.Path:
    """Write `<name>.json`: config, seeds, versions, commit, mode, wall time, results.

    An existing `<name>.json` that differs only in its `STAMPS` is left as it is,
    unless `changed` (the artifact itself was written anew)."""
    meta = {
        "artifact": name,
        "notebook": notebook,
        "fast_mode": FAST,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "wall_s_since_import": round(time.perf_counter() - _START, 1),
        "git_commit": git_commit(),
        "versions": versions(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "seeds": list(seeds),
        "config": _jsonable(config),
        "results": _jsonable(results),
        **{k: _jsonable(v) for k, v in extra.items()},
    }
    path = output_dir() / f"{name}.json"
    if path not in _BEFORE:  # as this process found it (a table and a figure may
        _BEFORE[path] = path.read_bytes() if path.exists() else None  # share it)
    before = _BEFORE[path]
    if before is not None and not changed:
        try:
            old = json.loads(before)
        except ValueError:
            old = None
        if isinstance(old, dict) and _same(
            _unstamped(old), _unstamped(_jsonable(meta))
        ):
            _write(path, before)
            return path
    path.write_text(json.dumps(meta, indent=1) + "\n")
    return path


_BEFORE: dict[pathlib.Path, bytes | None] = {}
"""Each sidecar JSON as it was before this process first wrote it."""


def _unstamped(meta: dict) -> dict:
    return {k: v for k, v in meta.items() if k not in STAMPS}


def _same(a: Any, b: Any) -> bool:
    """Equal JSON, floats within 1e-12 relative (a sum's last bit differs between
    machines; no result is read at that precision)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return a == b or math.isclose(a, b, rel_tol=1e-12) or (a != a and b != b)
    return a == b


def _write(path: pathlib.Path, data: bytes) -> bool:
    """Write `data` to `path` unless it holds those bytes already; whether it wrote."""
    if path.exists() and path.read_bytes() == data:
        return False
    path.write_bytes(data)
    return True


def save_figure(fig, name: str, *, label: str = "", **meta: Any) -> pathlib.Path:
    """Save `fig` as `<name>.png` (plus `<name>.json`, see `write_meta`), with
    `label` (e.g. the regime of its runs) printed under it."""
    if label:
        fig.text(0.5, 0.0, label, ha="center", va="top", fontsize=7, wrap=True)
    path = output_dir() / f"{name}.png"
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight")
    changed = _write(path, buffer.getvalue())
    write_meta(name, changed=changed, **({"label": label} if label else {}), **meta)
    return path


def markdown_table(
    rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None
) -> str:
    """A GitHub Markdown table of `rows` (floats as written by `format_value`)."""
    columns = list(columns or rows[0].keys())
    lines = [
        "| " + " | ".join(columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    for r in rows:
        lines.append(
            "| " + " | ".join(format_value(r.get(c, "")) for c in columns) + " |"
        )
    return "\n".join(lines) + "\n"


def format_value(v: Any) -> str:
    """Floats to 4 significant digits (3 decimals below 10); everything else `str`."""
    if isinstance(v, float):
        if v != v:
            return "nan"
        if abs(v) >= 1e5 or (0 < abs(v) < 1e-3):
            return f"{v:.3g}"
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def save_table(
    rows: Sequence[Mapping[str, Any]],
    name: str,
    *,
    columns: Sequence[str] | None = None,
    title: str = "",
    notes: str = "",
    **meta: Any,
) -> pathlib.Path:
    """Write `<name>.md` (title, table, notes), `<name>.csv` and `<name>.json`."""
    columns = list(columns or rows[0].keys())
    md = (f"# {title}\n\n" if title else "") + markdown_table(rows, columns)
    if notes:
        md += "\n" + notes.strip() + "\n"
    out = output_dir()
    changed = _write(out / f"{name}.md", md.encode())
    text = io.StringIO(newline="")
    w = csv.DictWriter(text, fieldnames=columns, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    changed = _write(out / f"{name}.csv", text.getvalue().encode()) or changed
    write_meta(name, results=list(rows), changed=changed, **meta)
    return out / f"{name}.md"
