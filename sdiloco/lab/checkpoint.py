"""Checkpoints of a whole run with orbax: state, data iterators, config, history.

One checkpoint holds, under one step directory written atomically by orbax:
`state` (every array of the algorithm state: global params, outer states, replicas,
inner states, in-flight fragments, step, key), `config` (the `RunConfig` JSON) and
`meta` (host-side counters, the metrics history and each replica's data iterator
position). Restoring checks, before touching anything, that the checkpoint exists,
has every item, was written by the same config, and holds arrays of the names,
shapes and dtypes of the current run's state (read from the checkpoint's metadata,
before any array is read): a mismatch is an error naming the arrays that differ,
never a silent partial restore or a cast.

Across processes, every process calls `save` and `restore` with the same arguments:
each writes the shards its devices hold, process 0 writes the JSON items and commits
the step directory. The state is restored into the shardings of the template, so a
checkpoint written on one layout (e.g. 2 processes x 2 devices) restores on any other
that holds the same run (e.g. 1 process x 4 devices, or the one-device simulation).
The directory must be one that every process sees (a shared filesystem or bucket).
"""

import json
import os
import shutil
import sys
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath


STATE, CONFIG, META = "state", "config", "meta"


class CheckpointError(ValueError):
    """A checkpoint that is missing, partial, or from another config or model."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint that cannot be read (partial, or damaged files); an older one of
    the same directory may still be intact."""


def _quiet_closed_loops() -> None:
    """After a failed read, tensorstore's pending callbacks reach orbax's closed
    event loop and each prints `RuntimeError: Event loop is closed` (through
    `sys.unraisablehook`), later and out of context; drop those, keep the rest.
    Installed (once) before `Checkpointer.restore` reads anything: the callbacks
    can come before the read's own error does."""
    previous = sys.unraisablehook
    if getattr(previous, "_sdiloco", False):
        return

    def hook(unraisable: Any) -> None:
        e = unraisable.exc_value
        if not (isinstance(e, RuntimeError) and str(e) == "Event loop is closed"):
            previous(unraisable)

    setattr(hook, "_sdiloco", True)
    sys.unraisablehook = hook


class Checkpointer:
    """Saves and restores runs in `directory` (a `CheckpointManager` underneath).

    Args:
        directory: where step directories are written (created if needed).
        config_json: the run's config as canonical JSON; restoring a checkpoint whose
            config differs raises `CheckpointError`.
        keep: how many checkpoints to keep (the oldest are deleted).
    """

    def __init__(self, directory: str | os.PathLike, config_json: str, keep: int = 2):
        self.directory = os.path.abspath(os.fspath(directory))
        self.config = json.loads(config_json)
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
        )

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        """The steps of every complete checkpoint, oldest first."""
        return sorted(self.manager.all_steps())

    def set_aside(self, step: int) -> str:
        """Rename the checkpoint of `step` to `<step>.damaged` (replacing an older
        one of that name), out of the manager's sight; returns the new path."""
        src = os.path.join(self.directory, str(step))
        dst = src + ".damaged"
        if os.path.isdir(dst):
            shutil.rmtree(dst)
        os.rename(src, dst)
        self.manager.reload()
        return dst

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Save the state's arrays, the config and `meta` (JSON: history, positions)."""
        items = {
            STATE: ocp.args.StandardSave(eqx.filter(state, eqx.is_array)),
            CONFIG: ocp.args.JsonSave(self.config),
            META: ocp.args.JsonSave(meta),
        }
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        self.manager.wait_until_finished()

    def restore(
        self, template: Any, step: int | None = None, abstract: Any = None
    ) -> tuple[Any, dict]:
        """Restore into a state shaped like `template`.

        Args:
            template: a state of the current run (e.g. `alg.init(model)`); its arrays
                give the expected structure, shapes and dtypes, its non-array leaves
                (static parts of the model) are reused.
            step: which checkpoint; default the latest.
            abstract: `ShapeDtypeStruct`s of the template's arrays with the shardings
                to restore into (default: each template array's own sharding).

        Returns:
            The restored state and `meta`.

        Raises:
            CheckpointError: no checkpoint, a partial one, another config, or a state
                that does not match the template.
        """
        _quiet_closed_loops()
        if step is None:
            step = self.latest_step()
        if step is None or step not in self.manager.all_steps():
            raise CheckpointError(
                f"no checkpoint{'' if step is None else f' at step {step}'} in "
                f"{self.directory} (found steps {sorted(self.manager.all_steps())})."
            )
        step_dir = os.path.join(self.directory, str(step))
        expected = [STATE, CONFIG, META]
        missing = [i for i in expected if not os.path.isdir(os.path.join(step_dir, i))]
        if missing:
            raise CorruptCheckpoint(
                f"checkpoint {step_dir} is partial: missing items {missing}; refusing "
                "to restore part of a run."
            )
        try:
            saved = self.manager.restore(
                step, args=ocp.args.Composite(**{CONFIG: ocp.args.JsonRestore()})
            )[CONFIG]
        except Exception as e:  # a damaged JSON item: any error of the reader
            raise CorruptCheckpoint(
                f"checkpoint {step_dir}: cannot read its config: {_short(e)}"
            ) from e
        if saved != self.config:
            diff = _diff(saved, self.config)
            raise CheckpointError(
                f"checkpoint {step_dir} was written by another config; differing "
                f"fields (checkpoint vs this run): {diff}."
            )
        arrays, static = eqx.partition(template, eqx.is_array)
        differences = _compare(_saved_arrays(step_dir), _arrays(arrays))
        if differences:
            raise CheckpointError(
                f"checkpoint {step_dir} holds a state that does not match this run's "
                f"(checkpoint vs this run): {'; '.join(differences)}."
            )
        if abstract is None:
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, arrays)
        items = {
            STATE: ocp.args.StandardRestore(abstract),
            META: ocp.args.JsonRestore(),
        }
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:  # names, shapes and dtypes matched: damaged files
            raise CorruptCheckpoint(
                f"checkpoint {step_dir}: cannot read its arrays or meta: {_short(e)}"
            ) from e
        return eqx.combine(restored[STATE], static), restored[META]

    def close(self) -> None:
        """Wait for pending writes and release the manager."""
        self.manager.wait_until_finished()
        self.manager.close()


def _saved_arrays(step_dir: str) -> dict[str, str]:
    """`{name: "dtype[shape]"}` of the state arrays in a checkpoint (metadata only)."""
    path = epath.Path(step_dir) / STATE
    try:
        tree = ocp.StandardCheckpointHandler().metadata(path).tree
    except Exception as e:  # a damaged metadata file: any error of the reader
        raise CorruptCheckpoint(
            f"checkpoint {step_dir}: cannot read the state's metadata: {_short(e)}"
        ) from e
    return {
        _name(p): _spec(m.shape, m.dtype)
        for p, m in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def _arrays(tree: Any) -> dict[str, str]:
    """`{name: "dtype[shape]"}` of the arrays of `tree`, named as orbax names them."""
    return {
        _name(p): _spec(x.shape, x.dtype)
        for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def _compare(saved: dict[str, str], want: dict[str, str], limit: int = 5) -> list[str]:
    """What differs between the checkpoint's arrays and the run's, first `limit`."""
    out = [
        f"{k}: {saved[k]} vs {want[k]}"
        for k in sorted(saved.keys() & want.keys())
        if saved[k] != want[k]
    ]
    for what, names in (
        ("missing from the checkpoint", sorted(want.keys() - saved.keys())),
        ("only in the checkpoint", sorted(saved.keys() - want.keys())),
    ):
        if names:
            more = f" and {len(names) - limit} more" if len(names) > limit else ""
            out.append(f"{what}: {names[:limit]}{more}")
    if len(out) > limit:
        out = out[:limit] + [f"and {len(out) - limit} more differences"]
    return out


def _short(e: BaseException, limit: int = 160) -> str:
    """The first line of an error, cut to `limit` characters (tensorstore's errors
    carry a whole spec)."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _name(path: tuple) -> str:
    parts = (getattr(k, "name", getattr(k, "key", getattr(k, "idx", k))) for k in path)
    return ".".join(str(p) for p in parts)


def _spec(shape: Any, dtype: Any) -> str:
    return f"{jnp.dtype(dtype).name}[{','.join(str(d) for d in shape)}]"


def _diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [f"{prefix[:-1]}: {a!r} vs {b!r}"]
