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

import gc
import json
import logging
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


def _quiet_failed_reads() -> None:
    """Drop the echoes of a failed read, printed later and out of context, and keep
    everything else.

    When one array of a checkpoint cannot be read, orbax's restore raises that
    error (which `Checkpointer.restore` turns into one line), and every other read
    still pending fails the same way with nobody to await it. Depending on timing,
    each is printed through `sys.unraisablehook` ("Exception ignored in: <coroutine
    ...>"), or by asyncio's logger ("_GatheringFuture exception was never
    retrieved"), with TensorStore's whole spec (dozens of lines per array); and
    tensorstore's late callbacks print `RuntimeError: Event loop is closed`.
    Installed (once) before `Checkpointer.restore` reads anything: the echoes can
    come before the read's own error does.
    """
    previous = sys.unraisablehook
    if not getattr(previous, "_sdiloco", False):

        def hook(unraisable: Any) -> None:
            if not _is_read_echo(unraisable):
                previous(unraisable)

        setattr(hook, "_sdiloco", True)
        sys.unraisablehook = hook
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _NeverRetrieved) for f in asyncio_log.filters):
        asyncio_log.addFilter(_NeverRetrieved())


_ORBAX = f"{os.sep}orbax{os.sep}checkpoint{os.sep}"
"""Where orbax's checkpoint code lives (a part of its files' paths)."""


def _is_read_echo(unraisable: Any) -> bool:
    """Whether an unraisable error is an echo of a failed orbax read: a coroutine of
    orbax's that failed unawaited, or tensorstore's callback on a closed loop."""
    e = unraisable.exc_value
    if isinstance(e, RuntimeError) and str(e) == "Event loop is closed":
        return True
    code = getattr(unraisable.object, "cr_code", None)  # a coroutine's code
    return code is not None and _ORBAX in code.co_filename


class _NeverRetrieved(logging.Filter):
    """Drops asyncio's "exception was never retrieved" of a failed read's echo: an
    error raised in orbax's code, or set by tensorstore (no Python frame) naming
    its storage; keeps every other record."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is None or "never retrieved" not in str(record.msg):
            return True
        files, tb = [], error.__traceback__
        while tb is not None:
            files.append(tb.tb_frame.f_code.co_filename)
            tb = tb.tb_next
        if any(_ORBAX in f for f in files):
            return False
        return bool(files) or not any(s in str(error) for s in _TENSORSTORE_WORDS)


_TENSORSTORE_WORDS = ("OCDBT", "TensorStore", "tensorstore")
"""Words of tensorstore's storage errors (the reads a checkpoint restore makes)."""


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
        _quiet_failed_reads()
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
        diff = _diff(_unnamed(saved), _unnamed(self.config))
        if diff:
            raise CheckpointError(
                f"checkpoint {step_dir} was written by another config; differing "
                f"fields (checkpoint vs this run): {diff}. To train this config, "
                "start afresh in the same directory with --no-resume "
                "(run(..., resume=False); the old checkpoints are moved to "
                "checkpoints.old) or give another --out; to continue the old run, "
                "use its config (config.json in that directory)."
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
            error = CorruptCheckpoint(
                f"checkpoint {step_dir}: cannot read its arrays or meta: {_short(e)}"
            )
            del e  # its traceback holds the failed reads' coroutines
            gc.collect()  # closed now, their echoes dropped: not later, mid-run
            raise error from None
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
    text = text.split(" See full TensorStore details")[0]  # a spec, not a reason
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _name(path: tuple) -> str:
    parts = (getattr(k, "name", getattr(k, "key", getattr(k, "idx", k))) for k in path)
    return ".".join(str(p) for p in parts)


def _spec(shape: Any, dtype: Any) -> str:
    return f"{jnp.dtype(dtype).name}[{','.join(str(d) for d in shape)}]"


def _unnamed(config: Any) -> Any:
    """A config's JSON without its `name`: a label, not part of what is trained
    (a checkpoint of the same run under another name restores)."""
    if isinstance(config, dict):
        return {k: v for k, v in config.items() if k != "name"}
    return config


def _diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [f"{prefix[:-1]}: {a!r} vs {b!r}"]
