"""Command line: `python -m sdiloco train --preset NAME [--steps N] [--out DIR] ...`."""

import argparse
import json
import sys

from .lab import config as config_lib


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m sdiloco` (and the `sdiloco` console script)."""
    parser = argparse.ArgumentParser(prog="python -m sdiloco", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser(
        "train", help="train a preset on the embedded corpus (or --tokens)"
    )
    t.add_argument(
        "--preset",
        default="streaming_overlap_fp4",
        choices=sorted(config_lib.PRESETS),
        help="the paper's method (default: Streaming DiLoCo with overlapped FP4 communication)",
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
    t.add_argument("--seed", type=int, help="model/data seed")
    t.add_argument("--tokens", help="a token file (.npy or raw) instead of the corpus")
    t.add_argument("--checkpoint-every", type=int, help="steps between checkpoints")
    t.add_argument("--out", help="output directory (history, checkpoints)")
    t.add_argument(
        "--no-resume", action="store_true", help="ignore checkpoints in --out"
    )
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    if args.command == "train":
        from .lab.train import run

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
        )
        data = _given(global_batch_size=args.batch_size, token_file=args.tokens)
        if method:
            changes["method"] = method
        if data:
            changes["data"] = data
        if args.lr is not None:
            changes["inner"] = {"lr": args.lr}
        cfg = config_lib.preset(args.preset, **changes)
        history = run(
            cfg, args.out, resume=not args.no_resume, progress=not args.no_progress
        )
        print(
            json.dumps(
                {"evals": history.evals[-1:], "summary": history.summary}, indent=1
            )
        )
    return 0


def _given(**options):
    """The options the user gave (not None)."""
    return {k: v for k, v in options.items() if v is not None}


if __name__ == "__main__":
    sys.exit(main())
