"""Command line: `python -m sdiloco train --preset NAME [--steps N] [--out DIR] ...`.

The flags change a named preset of `sdiloco.lab.config`; the config is built, and so
checked, before anything is trained or written. A bad flag or value prints one line,
`error: <message>`, on stderr and exits with status 2.

The same command runs one process (the one-device simulation, or a mesh over this
host's devices with `--devices-per-replica`) and each process of a multi-process job:
add `--coordinator HOST:PORT --num-processes N --process-id I`, or `--auto-distributed`
where `jax.distributed.initialize()` reads them from the cluster (SLURM, Cloud TPU,
Kubernetes). A job that cannot gather within `--init-timeout` seconds exits with
status 1 and one line saying why.
"""

import argparse
import json
import sys
from typing import Any, NoReturn

from . import config as config_lib


USAGE_ERROR = 2
"""Exit status of a bad command line (argparse's convention)."""


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m sdiloco` (and the `sdiloco` console script)."""
    try:
        args = _parser().parse_args(argv)
        if args.command == "train":
            return _train(args) if args.board is None else _island(args)
        if args.command == "coordinate":
            return _coordinate(args)
    except _UsageError as e:
        return _fail(f"{e} (see --help)")
    return 0


def _train(args: argparse.Namespace) -> int:
    try:
        cfg = _config(args)
    except ValueError as e:
        return _fail(str(e))
    # Only now, the checks passed: importing the training loop is slow.
    from .checkpoint import CheckpointError

    try:
        from .train import run
    except ModuleNotFoundError as e:  # the core install, without the lab extra
        print(
            f"error: training needs the lab extra ({e.name} is not installed): "
            "pip install 'sdiloco[lab]'",
            file=sys.stderr,
        )
        return 2

    from . import cluster

    try:
        cluster.connect(
            args.coordinator,
            args.num_processes,
            args.process_id,
            auto=args.auto_distributed,
            timeout_s=args.init_timeout,
        )
    except ValueError as e:
        return _fail(str(e))
    except cluster.ConnectError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        history = run(
            cfg,
            args.out,
            devices_per_replica=args.devices_per_replica,
            fsdp=args.fsdp,
            courier=args.courier,
            resume=not args.no_resume,
            progress=not args.no_progress,
        )
    except (CheckpointError, ValueError) as e:  # another run in --out; a bad layout
        return _fail(str(e))
    finally:
        cluster.disconnect()
    if cluster.is_primary():
        summary = {"evals": history.evals[-1:], "summary": history.summary}
        print(json.dumps(summary, indent=1))
    return 0


def _board(args: argparse.Namespace) -> Any:
    from .elastic import BoardOptions  # light: the training loop is not imported

    return BoardOptions(
        args.board,
        grace_s=args.grace,
        timeout_s=args.board_timeout,
        heartbeat_s=args.heartbeat,
        connect_timeout_s=args.init_timeout,
    )


def _island(args: argparse.Namespace) -> int:
    """`train --board HOST:PORT --replica m`: one island of the elastic job."""
    for flag in ("coordinator", "num_processes", "process_id", "devices_per_replica"):
        if getattr(args, flag) is not None:
            return _fail(f"--{flag.replace('_', '-')} with --board; allowed: one.")
    if args.courier or args.fsdp or args.auto_distributed:
        return _fail("--courier/--fsdp/--auto-distributed with --board; allowed: none.")
    if args.replica is None:
        return _fail("--board needs --replica (this island, 0 ... M - 1).")
    try:
        cfg = _config(args)
        options = _board(args)
        from .elastic import check_island

        check_island(cfg, args.replica)
    except ValueError as e:
        return _fail(str(e))
    from ..distributed.board import BoardError
    from .elastic import island

    try:
        summary = island(cfg, args.replica, options, args.out)
    except BoardError as e:
        return _fail(str(e), status=1)
    print(
        json.dumps({"evaluation": summary["evaluation"], "healed": summary["healed"]})
    )
    return 0


def _coordinate(args: argparse.Namespace) -> int:
    """`coordinate --board HOST:PORT --replicas M`: the elastic job's coordinator."""
    if args.board is None:
        return _fail("coordinate needs --board HOST:PORT (where to serve).")
    if args.replicas is None or args.replicas < 2:
        return _fail(f"--replicas={args.replicas}; allowed: M >= 2 islands.")
    try:
        options = _board(args)
    except ValueError as e:
        return _fail(str(e))
    from ..distributed.board import BoardError
    from .elastic import run_coordinator

    try:
        decisions = run_coordinator(args.replicas, options, args.out)
    except BoardError as e:
        return _fail(str(e), status=1)
    late = sum(d["timed_out"] for d in decisions)
    print(json.dumps({"rounds": len(decisions), "decided_at_deadline": late}))
    return 0


def _config(args: argparse.Namespace) -> config_lib.RunConfig:
    """The preset with the flags' changes, then the budget's steps, H and warmup.

    With `--tokens-per-param` the run is the notebooks' (`sdiloco.paper.experiments
    .setup`): the same `config.Regime` computes its steps, H (from `--rounds`,
    default 50), warmup and evaluations.
    """
    if args.tokens_per_param is None:
        if args.rounds is not None:
            raise ValueError(
                f"--rounds={args.rounds} needs --tokens-per-param (a budget)."
            )
        return config_lib.preset(args.preset, **_changes(args))
    for flag, value in (("--steps", args.steps), ("--sync-every", args.sync_every)):
        if value is not None:
            raise ValueError(
                f"{flag}={value} with --tokens-per-param={args.tokens_per_param}; "
                "the budget sets the steps and H (give one or the other)."
            )
    regime = config_lib.Regime(args.tokens_per_param, args.rounds or 50)
    return regime.apply(config_lib.preset(args.preset, **_changes(args)))


def _changes(args: argparse.Namespace) -> dict:
    """The preset changes the flags ask for (flags not given change nothing)."""
    method = _given(
        num_replicas=args.replicas,
        sync_every=args.sync_every,
        overlap=args.overlap,
        alpha=args.alpha,
        quantizer=args.quantizer,
    )
    if method.get("quantizer") == "none":
        method["quantizer"] = None
    changes = _given(
        model=args.model,
        steps=args.steps,
        seed=args.seed,
        checkpoint_every=args.checkpoint_every,
        eval_windows=args.eval_windows,
    )
    data = _given(
        global_batch_size=args.batch_size, token_file=args.tokens, seed=args.seed
    )
    if method:
        changes["method"] = method
    if data:
        changes["data"] = data
    if args.lr is not None:
        changes["inner"] = {"lr": args.lr}
    return changes


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m sdiloco", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    t = sub.add_parser(
        "train", help="train a preset on the embedded corpus (or --tokens)"
    )
    t.add_argument(
        "--preset",
        default="streaming_overlap_fp4",
        help=f"the paper's method, one of {sorted(config_lib.PRESETS)} (default: "
        "Streaming DiLoCo with overlapped FP4 communication)",
    )
    t.add_argument("--model", help="model preset, e.g. tiny-s, tiny-m, tiny-deep")
    t.add_argument("--steps", type=int, help="total inner steps")
    t.add_argument("--replicas", type=int, help="M")
    t.add_argument("--sync-every", type=int, help="H")
    t.add_argument("--overlap", type=int, help="tau")
    t.add_argument("--alpha", type=float, help="mixing factor")
    t.add_argument(
        "--quantizer",
        help="outer-gradient format (e3m0, e2m1, e4m3, bf16, fp32, ...) or none",
    )
    t.add_argument("--batch-size", type=int, help="global batch size (sequences)")
    t.add_argument("--lr", type=float, help="peak inner learning rate")
    t.add_argument(
        "--seed", type=int, help="seed of the model, the compressors and the data order"
    )
    t.add_argument(
        "--tokens-per-param",
        type=float,
        help="train this budget (20: compute-optimal): sets the steps, H, warmup and "
        "evaluations as the paper notebooks do (instead of --steps/--sync-every)",
    )
    t.add_argument(
        "--rounds",
        type=int,
        help="outer rounds of the budget (H = steps / rounds; default 50)",
    )
    t.add_argument(
        "--eval-windows",
        type=int,
        help="held-out windows per evaluation (default: every window)",
    )
    t.add_argument("--tokens", help="a token file (.npy or raw) instead of the corpus")
    t.add_argument("--checkpoint-every", type=int, help="steps between checkpoints")
    t.add_argument("--out", help="output directory (history, checkpoints)")
    t.add_argument(
        "--no-resume", action="store_true", help="ignore checkpoints in --out"
    )
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_device_flags(t.add_argument_group("devices and processes"))
    _add_board_flags(t.add_argument_group("elastic islands (one process each)"))
    t.add_argument("--replica", type=int, help="with --board: this island, 0 .. M-1")
    _add_coordinate(sub)
    return parser


def _add_coordinate(sub: Any) -> None:
    """The `coordinate` command: the elastic job's coordinator."""
    c = sub.add_parser(
        "coordinate", help="the coordinator of an elastic job (holds no replica)"
    )
    c.add_argument("--replicas", type=int, help="M, the job's islands")
    c.add_argument("--out", help="directory for coordinator.json (the decisions)")
    c.add_argument(
        "--init-timeout",
        type=int,
        default=300,
        help="seconds to wait for every island to join (default 300)",
    )
    _add_board_flags(c)


def _add_board_flags(d: Any) -> None:
    """The flags of the elastic job's board (the coordinator and every island)."""
    d.add_argument(
        "--board", help="HOST:PORT of the elastic job's coordinator (its board)"
    )
    d.add_argument(
        "--grace",
        type=float,
        default=5.0,
        help="seconds a round waits for a missing island (default 5)",
    )
    d.add_argument(
        "--board-timeout",
        type=float,
        default=120.0,
        help="seconds any wait on the board may last (default 120)",
    )
    d.add_argument(
        "--heartbeat",
        type=int,
        default=10,
        help="seconds without a heartbeat after which the board counts a process "
        "as gone, and JAX's runtime ends a process that cannot reach the board "
        "(default 10)",
    )


def _add_device_flags(d: Any) -> None:
    """The flags of where the replicas live (devices, processes, the courier)."""
    d.add_argument(
        "--devices-per-replica",
        type=int,
        help="spread each replica over this many devices (mesh axis 'data'); default "
        "in one process: the one-device simulation; in a job: all devices / M",
    )
    d.add_argument(
        "--fsdp",
        action="store_true",
        help="also split each replica's parameters and inner state over its devices",
    )
    d.add_argument(
        "--courier",
        action="store_true",
        help="overlap the exchange of an overlapped method (tau >= 1) with the next "
        "inner steps: the last device of each process communicates (on CPU, give "
        "each process one more device)",
    )
    d.add_argument("--coordinator", help="HOST:PORT of process 0 (multi-process)")
    d.add_argument("--num-processes", type=int, help="processes in the job")
    d.add_argument("--process-id", type=int, help="this process, 0 .. N-1")
    d.add_argument(
        "--auto-distributed",
        action="store_true",
        help="read the coordinates from the cluster (jax.distributed.initialize())",
    )
    d.add_argument(
        "--init-timeout",
        type=int,
        default=300,
        help="seconds to wait for every process to join (default 300)",
    )


class _UsageError(Exception):
    """A command line argparse rejects (unknown flag, a value of the wrong type)."""


class _Parser(argparse.ArgumentParser):
    """An `ArgumentParser` whose errors are one line (`main` prints it), not usage."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


def _fail(message: str, status: int = USAGE_ERROR) -> int:
    """Print `error: <message>` as one line on stderr; returns `status`."""
    print(f"error: {' '.join(message.split())}", file=sys.stderr)
    return status


def _given(**options):
    """The options the user gave (not None)."""
    return {k: v for k, v in options.items() if v is not None}
