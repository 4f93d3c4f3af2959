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
import os
import shlex
import sys
from typing import Any, NoReturn

from . import config as config_lib, model as model_lib
from .methods import MERGES, OUTER_KINDS


USAGE_ERROR = 2
"""Exit status of a bad command line (argparse's convention)."""


INTERRUPTED = 130
"""Exit status of a run stopped by Ctrl-C or SIGTERM (the shell's 128 + SIGINT)."""


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m sdiloco` (and the `sdiloco` console script)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = _parser().parse_args(argv)
        args.argv = argv
        if args.command == "train":
            if args.elastic:
                return _elastic(args)
            for flag in ("min_step_s", "address"):
                if getattr(args, flag):
                    raise _UsageError(
                        f"--{flag.replace('_', '-')} without --elastic; allowed: a "
                        "flag of the elastic job"
                    )
            return _train(args)
    except _UsageError as e:
        return _fail(f"{e} (see --help)")
    except KeyboardInterrupt:  # before the loop (or a second Ctrl-C): nothing saved
        print("interrupted; no checkpoint was written.", file=sys.stderr)
        return INTERRUPTED
    return 0


def _train(args: argparse.Namespace) -> int:
    try:
        cfg = _config(args)
        if args.out is not None and args.checkpoint_every is None:
            # With --out, resumable by default: a checkpoint at every evaluation
            # (and one on Ctrl-C / SIGTERM, see train.run).
            cfg = cfg.replace(checkpoint_every=cfg.eval_every)
    except ValueError as e:
        return _fail(str(e))
    # Only now, the checks passed: importing the training loop is slow.
    from .checkpoint import CheckpointError

    try:
        from .train import (
            Interrupted,
            NonFiniteLoss,
            check_data,
            check_out_dir,
            run,
            sync_warning,
        )
    except ModuleNotFoundError as e:  # the core install, without the lab extra
        return _fail(
            f"training needs the lab extra ({e.name} is not installed): "
            "pip install 'sdiloco[lab]'"
        )

    from . import cluster

    failed = _connect(args, cluster)
    if failed is not None:
        return failed
    try:  # before the warning: a bad file or --out is the one line
        if args.out is not None:
            check_out_dir(args.out)
        check_data(cfg)
    except ValueError as e:
        return _fail(str(e))
    warning = sync_warning(cfg)
    if warning is not None and cluster.is_primary():
        print(warning, file=sys.stderr, flush=True)
    try:
        history = run(cfg, args.out, **_run_options(args))
    except (CheckpointError, ValueError) as e:  # another run in --out; a bad layout
        return _fail(str(e))
    except NonFiniteLoss as e:
        return _fail(str(e), status=1)
    except Interrupted as e:
        print(
            f"stopped at step {e.step}, checkpoint saved; resume with: "
            f"python -m sdiloco {shlex.join(args.argv)}",
            file=sys.stderr,
        )
        return INTERRUPTED
    finally:
        cluster.disconnect()
    if cluster.is_primary():
        _report(history, args.out)
    return 0


def _run_options(args: argparse.Namespace) -> dict[str, Any]:
    """`train.run`'s options from the flags (where the replicas live, resuming,
    the bar, what a non-finite loss does)."""
    return {
        "devices_per_replica": args.devices_per_replica,
        "fsdp": args.fsdp,
        "courier": args.courier,
        "resume": not args.no_resume,
        "progress": not args.no_progress,
        "nonfinite_loss": args.nonfinite_loss,
    }


def _connect(args: argparse.Namespace, cluster: Any) -> int | None:
    """Join the job the flags describe (nothing for one process); the exit status
    of a failure, after its one line."""
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
    return None


def _report(history: Any, out: str | None) -> None:
    """The end of a run: its final evaluation and summary as JSON on stdout, then on
    stderr the losses, bits, wall time and the files written (and `loss.png` of the
    training curve, where matplotlib is installed)."""
    summary = {"evals": history.evals[-1:], "summary": history.summary}
    print(json.dumps(summary, indent=1))
    s, rows, evals = history.summary, history.rows, history.evals
    lines = [f"done: {s['steps']} steps in {s['wall_s']:.0f} s of training"]
    if s["start_step"] == s["steps"]:  # its checkpoint was its last step
        lines[0] = (
            f"already done: {s['steps']} steps (its checkpoint is the last step; "
            f"nothing trained now), {s['wall_s']:.0f} s of training"
        )
    elif s["start_step"]:
        lines[0] += f" (resumed at step {s['start_step']}; every segment counted)"
    if rows:
        lines.append(f"  final train loss    {rows[-1]['loss/train']:.4f}")
    if evals:
        lines.append(f"  final held-out loss {evals[-1]['eval/global']:.4f} (global)")
    lines.append(
        f"  bits sent           {s['bits_total']:,} (peak {s['peak_bits_per_step']:,} "
        "in one step, per replica)"
    )
    if out is not None:
        plot = _plot_loss(history, out)
        names = ["config.json", "history.json", "history.csv", "evals.csv"]
        names += ["checkpoints/"] + ([plot] if plot else [])
        found = [n for n in names if os.path.exists(os.path.join(out, n))]
        lines.append(f"  files in {out}: {', '.join(found)}")
    print("\n".join(lines), file=sys.stderr)


def _plot_loss(history: Any, out: str) -> str | None:
    """`loss.png` in `out`: train loss per logged step and held-out evaluations;
    None (nothing written) without matplotlib, which only the paper extra installs."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    rows, evals = history.rows, history.evals
    ax.plot([r["step"] for r in rows], [r["loss/train"] for r in rows], label="train")
    if evals:
        ax.plot(
            [e["step"] for e in evals],
            [e["eval/global"] for e in evals],
            "o-",
            label="held-out (global)",
        )
    ax.set(xlabel="step", ylabel="loss (nats/token)", title=history.config.title())
    ax.legend()
    fig.savefig(os.path.join(out, "loss.png"), dpi=100, bbox_inches="tight")
    plt.close(fig)
    return "loss.png"


def _elastic(args: argparse.Namespace) -> int:
    """`train --elastic`: the whole elastic job, one Ray actor per island."""
    for flag in ("coordinator", "num_processes", "process_id", "devices_per_replica"):
        if getattr(args, flag) is not None:
            return _fail(f"--{flag.replace('_', '-')} with --elastic; allowed: none.")
    if args.courier or args.fsdp or args.auto_distributed:
        return _fail(
            "--courier/--fsdp/--auto-distributed with --elastic; allowed: none."
        )
    try:
        cfg = _config(args)
        if args.out is not None and args.checkpoint_every is None:
            cfg = cfg.replace(checkpoint_every=cfg.eval_every)
        options = _elastic_options(args, cfg)
    except ValueError as e:
        return _fail(str(e))
    try:
        from .ray_job import run_job
    except ModuleNotFoundError as e:
        return _fail(f"{e}; the elastic job needs Ray: pip install 'sdiloco[elastic]'")
    try:
        result = run_job(
            cfg,
            options,
            args.out,
            resume=not args.no_resume,
            progress=not args.no_progress,
            min_step_s=args.min_step_s,
        )
    except (ConnectionError, RuntimeError) as e:  # Ray could not start or join
        return _fail(f"the elastic job could not start Ray: {e}", status=1)
    for m in sorted(result.errors):
        print(f"error: {result.errors[m]}", file=sys.stderr)
    if not result.summaries:
        return _fail("the elastic job ended: no island could finish.", status=1)
    print(
        json.dumps(
            {
                m: {"evaluation": s["evaluation"], "healed": s["healed"]}
                for m, s in sorted(result.summaries.items())
            }
        )
    )
    return 1 if result.errors else 0


def _elastic_options(args: argparse.Namespace, cfg: Any) -> Any:
    """The elastic job's options, every check made before Ray starts."""
    from .elastic import ElasticOptions, check_min_step_s
    from .train import check_island, check_out_dir

    options = ElasticOptions(
        args.address,
        grace_s=args.grace,
        timeout_s=args.elastic_timeout,
        heartbeat_s=args.heartbeat,
        start_s=float(args.init_timeout),
        max_restarts=args.max_restarts,
    )
    check_min_step_s(args.min_step_s)
    if cfg.method.num_replicas < 2:
        raise ValueError(
            f"--replicas={cfg.method.num_replicas}; allowed: M >= 2 islands."
        )
    check_island(cfg, (0, cfg.method.num_replicas))
    if args.out is not None:
        check_out_dir(args.out)
    return options


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
    if args.rounds is not None and args.rounds < 1:
        raise ValueError(
            f"--rounds={args.rounds}; allowed: a positive number of outer rounds "
            "(default 50)."
        )
    rounds = 50 if args.rounds is None else args.rounds
    regime = config_lib.Regime(args.tokens_per_param, rounds)
    return regime.apply(config_lib.preset(args.preset, **_changes(args)))


def _changes(args: argparse.Namespace) -> dict:
    """The preset changes the flags ask for (flags not given change nothing)."""
    method = _given(
        num_replicas=args.replicas,
        sync_every=args.sync_every,
        overlap=args.overlap,
        alpha=args.alpha,
        quantizer=args.quantizer,
        compressor=args.compressor,
        merge=args.merge,
    )
    if method.get("quantizer") == "none":
        method["quantizer"] = None
    # One flag replaces the preset's compression; both are refused by the config.
    if args.compressor is not None and args.quantizer is None:
        method["quantizer"] = None
    if args.quantizer is not None and args.compressor is None:
        method["compressor"] = None
    outer = _given(
        kind=args.outer,
        lr=args.outer_lr,
        momentum=args.outer_momentum,
        momentum_warmup=args.outer_momentum_warmup,
    )
    if outer:
        method["outer"] = outer
    changes = _given(
        model=args.model,
        vocab_size=args.vocab,
        steps=args.steps,
        seed=args.seed,
        checkpoint_every=args.checkpoint_every,
        eval_windows=args.eval_windows,
        quorum=args.quorum,
    )
    data = _given(
        global_batch_size=args.batch_size,
        token_file=args.tokens,
        token_dtype=args.token_dtype,
        seed=args.seed,
    )
    if method:
        changes["method"] = method
    if data:
        changes["data"] = data
    inner = _given(lr=args.lr, kind=args.inner)
    if inner:
        changes["inner"] = inner
    return changes


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m sdiloco", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    t = sub.add_parser(
        "train", help="train a preset on the embedded corpus (or --tokens)"
    )
    paper = [name for name in config_lib.PRESETS if name not in config_lib.DERIVED]
    t.add_argument(
        "--preset",
        default="streaming_overlap_fp4",
        help=f"the method: the paper's ({', '.join(paper)}) or one after it "
        f"({', '.join(config_lib.DERIVED)}); default: streaming_overlap_fp4, "
        "Streaming DiLoCo with overlapped FP4 communication",
    )
    _add_method_flags(t.add_argument_group("model and method"))
    _add_optimizer_flags(t.add_argument_group("optimizers"))
    _add_budget_flags(t.add_argument_group("budget and data"))
    _add_output_flags(t.add_argument_group("outputs"))
    _add_device_flags(t.add_argument_group("devices and processes"))
    _add_elastic_flags(t.add_argument_group("the elastic job (Ray)"))
    return parser


def _add_method_flags(t: Any) -> None:
    """The model and the method's knobs."""
    run, method = config_lib.RunConfig, config_lib.StreamingConfig
    t.add_argument(
        "--model",
        help=f"model preset (default {run.model}), one of: "
        f"{', '.join(model_lib.TINY_SCALES)} (byte-level, vocabulary 256; the "
        f"embedded corpus) and the paper's {', '.join(model_lib.PAPER_SCALES)} "
        "(vocabulary 32,000)",
    )
    t.add_argument(
        "--vocab",
        type=int,
        help="the model's vocabulary instead of the preset's (every id of --tokens "
        "must be below it)",
    )
    t.add_argument("--steps", type=int, help=f"total inner steps (default {run.steps})")
    t.add_argument(
        "--replicas", type=int, help=f"M, the replicas (default {method.num_replicas})"
    )
    t.add_argument(
        "--sync-every",
        type=int,
        help=f"H, inner steps between two syncs of a fragment (default "
        f"{method.sync_every}; diloco 30); a run shorter than H never syncs",
    )
    t.add_argument(
        "--overlap", type=int, help=f"tau (default {method.overlap}; 0 without overlap)"
    )
    t.add_argument(
        "--alpha",
        type=float,
        help=f"mixing factor (default {method.alpha}; 0: each replica takes θ_g)",
    )
    t.add_argument(
        "--quantizer",
        help="outer-gradient format (e3m0, e2m1, e4m3, bf16, fp32, ...) or none",
    )
    t.add_argument(
        "--compressor",
        metavar="SPEC",
        help="outer-gradient compressor as stages instead of --quantizer, e.g. "
        "'int2,ef' or 'topk:0.03/64,int2,ef:0.9' (chunked top-k, 2-bit, error "
        "feedback with decay; sdiloco.compression.parse)",
    )
    t.add_argument(
        "--merge",
        help=f"merge policy: {' or '.join(MERGES)} (default alpha, the paper's; "
        "eager: each replica's own outer step during the overlap)",
    )
    t.add_argument(
        "--quorum",
        type=int,
        metavar="K",
        help="--preset decoupled: the minimum quorum, senders a round needs to "
        "merge, 1..M (default ⌈M/2⌉)",
    )


def _add_optimizer_flags(t: Any) -> None:
    """The inner and outer optimizers, the batch and the seed."""
    t.add_argument(
        "--inner",
        help=f"inner optimizer: {' or '.join(config_lib.INNER_KINDS)} (default "
        "adamw; muon: Muon on the blocks' weight matrices, Adam on the rest)",
    )
    t.add_argument(
        "--outer",
        help=f"outer optimizer: {' or '.join(OUTER_KINDS)} (default nesterov, "
        "the paper's; sgd: no momentum)",
    )
    t.add_argument(
        "--outer-lr",
        type=float,
        help="outer learning rate (default: the tuned one, else "
        f"{config_lib.OuterConfig.lr})",
    )
    t.add_argument(
        "--outer-momentum",
        type=float,
        help="outer Nesterov momentum (default: the tuned one, else "
        f"{config_lib.OuterConfig.momentum})",
    )
    t.add_argument(
        "--outer-momentum-warmup",
        type=int,
        metavar="K",
        help="ramp the outer momentum from 0 over each fragment's first K syncs "
        "(default 0: none)",
    )
    t.add_argument(
        "--batch-size",
        type=int,
        help="global batch size in sequences (default: the tuned one, else "
        f"{config_lib.DataConfig.global_batch_size})",
    )
    t.add_argument(
        "--lr",
        type=float,
        help="peak inner learning rate (default: the tuned one, else "
        f"{config_lib.InnerConfig.lr})",
    )
    t.add_argument(
        "--seed",
        type=int,
        help="seed of the model, the compressors and the data order (default 0)",
    )


def _add_budget_flags(t: Any) -> None:
    """The budget, the data and what a non-finite loss does."""
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
    t.add_argument(
        "--tokens",
        help="a token file instead of the corpus: a 1-D .npy of uint8/uint16/uint32 "
        "ids, or raw ids (see --token-dtype), each below the model's vocabulary; the "
        "last 10%% is held out",
    )
    t.add_argument(
        "--token-dtype",
        choices=config_lib.TOKEN_DTYPES,
        help=f"dtype of a raw --tokens file (default "
        f"{config_lib.DataConfig.token_dtype}; a .npy file's is read from it)",
    )
    t.add_argument(
        "--nonfinite-loss",
        choices=("stop", "continue"),
        default="stop",
        help="a NaN or infinite training or held-out loss stops the run with exit "
        "status 1 (default), or is recorded and trained on",
    )


def _add_output_flags(t: Any) -> None:
    """Checkpoints, outputs and progress."""
    run = config_lib.RunConfig
    t.add_argument(
        "--checkpoint-every",
        type=int,
        help="steps between checkpoints (default with --out: at every evaluation, "
        f"{run.eval_every} steps for the presets; 0: only at the end)",
    )
    t.add_argument(
        "--out",
        help="output directory (history, loss.png, checkpoints); the same command "
        "again resumes from its newest checkpoint",
    )
    t.add_argument(
        "--no-resume", action="store_true", help="ignore checkpoints in --out"
    )
    t.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_elastic_flags(d: Any) -> None:
    """The flags of the elastic job (`--elastic`: one Ray actor per island)."""
    d.add_argument(
        "--elastic",
        action="store_true",
        help="run the elastic job: each replica an island (a Ray actor) that may "
        "die and rejoin; a local Ray instance unless --address",
    )
    d.add_argument("--address", help="with --elastic: an existing Ray cluster")
    d.add_argument(
        "--grace",
        type=float,
        default=5.0,
        help="seconds a round waits for a missing island (default 5)",
    )
    d.add_argument(
        "--elastic-timeout",
        type=float,
        default=120.0,
        help="seconds any wait on the syncer or a peer may last (default 120)",
    )
    d.add_argument(
        "--heartbeat",
        type=float,
        default=10.0,
        help="seconds after which a silent island is not asked to serve a heal "
        "(default 10)",
    )
    d.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="how often Ray restarts each island (default 3)",
    )
    d.add_argument(
        "--min-step-s",
        type=float,
        default=0.0,
        help="with --elastic: each island's inner steps take at least this many "
        "seconds (it sleeps the rest), a slower accelerator emulated on one machine "
        "(default 0)",
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
