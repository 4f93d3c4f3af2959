"""How far two runs one rounding apart drift by the end of training.

The step with a `Participation` input is another XLA program than the step without
one; with everyone present the two compute the same arithmetic and differ only where
XLA:CPU rounds its fusions otherwise (about one float32 ulp per step). Each method of
the standard run (`sdiloco.paper.experiments.setup`, M = 4, as in the `chaos`
notebook) is trained both ways over seeds; the relative difference of their final
held-out losses is the noise floor of a comparison between two recorded runs.

Usage: `python -m benchmarks.drift [--seeds 0 1]` (runs are recorded like the
notebooks', so a second call re-reads them).
"""

import argparse

import numpy as np

from sdiloco.paper import experiments as ex


METHODS = {
    "Data-Parallel": "data_parallel",
    "DiLoCo": "diloco",
    "Streaming FP4": "streaming_overlap_fp4",
}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.drift")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = p.parse_args(argv)
    ex.enable_compile_cache()
    print("| method | seed | final loss | with an all-present trace | relative gap |")
    print("|---|---|---|---|---|")
    gaps = []
    for name, preset in METHODS.items():
        plain = ex.setup(preset, method={"num_replicas": 4})
        traced = plain.replace(failures={})
        for seed in args.seeds:
            a = ex.run_one(name, plain, seed).final()
            b = ex.run_one(name, traced, seed).final()
            gaps.append(abs(b - a) / a)
            print(
                f"| {name} | {seed} | {a:.6f} | {b:.6f} | {gaps[-1]:.2e} |", flush=True
            )
    print(f"largest relative gap {max(gaps):.2e}, median {np.median(gaps):.2e}")


if __name__ == "__main__":
    main()
