"""The collectives of a compiled training step on a 2 x 2 mesh, per mesh axis.

Builds the training loop's step (`sdiloco.lab.train.build` on a
`cluster.Placement` of 2 replicas x 2 devices per replica, 4 CPU devices) for
Data-Parallel and Streaming DiLoCo with overlapped FP4, with and without FSDP, and
prints what each mesh axis carries, read off the compiled program
(`sdiloco.distributed.collectives`): every collective counts once, those inside the
per-fragment branches too, so a Streaming row is a step in which every fragment is
sent; and the bytes of the training state one device holds. Nothing is timed.

    python -m benchmarks.mesh_collectives [--model tiny-s]
"""

import argparse
import os


os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402

from sdiloco import distributed  # noqa: E402
from sdiloco.lab import cluster, config as config_lib, train  # noqa: E402


def table(model: str) -> list[dict]:
    """One row per (method, FSDP, axis, kind, dtype): bytes each device sends."""
    rows = []
    for preset in ("data_parallel", "streaming_overlap_fp4"):
        method = {} if preset == "data_parallel" else {"sync_every": 30}
        cfg = config_lib.preset(
            preset, model=model, method=method, data={"global_batch_size": 16}
        )
        for fsdp in (False, True):
            place = cluster.Placement.of(2, devices_per_replica=2, fsdp=fsdp)
            r = train.build(cfg, place)
            state = place.state(r.init_state())
            batch = place.batch(r.iterators())
            with jax.numpy_dtype_promotion("standard"):
                text = place.step(r.algorithm).lower(state, batch).compile().as_text()
            device = place.mesh.devices.flat[0]
            held = sum(
                shard.data.nbytes
                for x in jax.tree.leaves(state)
                if isinstance(x, jax.Array)
                for shard in x.addressable_shards
                if shard.device == device
            )
            print(f"{preset} fsdp={fsdp}: state bytes on one device {held:,}")
            totals: dict[tuple, int] = {}
            for c in distributed.collectives(text, place.mesh):
                key = (",".join(c.axes or ()) or "-", c.kind, c.dtype)
                totals[key] = totals.get(key, 0) + c.bytes_per_device
            for (axis, kind, dtype), nbytes in sorted(totals.items()):
                rows.append(
                    dict(
                        method=preset,
                        fsdp=fsdp,
                        axis=axis,
                        kind=kind,
                        dtype=dtype,
                        bytes=nbytes,
                        params=r.model_config.num_params(),
                    )
                )
            if preset != "data_parallel" and not fsdp:
                wire = distributed.wire_bytes(text, 2, place.mesh)
                bits = r.algorithm.bits_per_fragment(r.model)
                print(
                    f"{model} Streaming FP4: bytes per replica message across "
                    f"'replica' {wire}; accounting bits/8 "
                    f"{[int(-(-int(b) // 8)) for b in bits]}"
                )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-s")
    args = p.parse_args()
    rows = table(args.model)
    print(
        f"model {args.model}: {rows[0]['params']:,} parameters, 4N = "
        f"{4 * rows[0]['params']:,} B; mesh replica=2 x data=2"
    )
    print("| method | FSDP | axis | collective | dtype | bytes per device per step |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['method']} | {r['fsdp']} | {r['axis']} | {r['kind']} | "
            f"{r['dtype']} | {r['bytes']:,} |"
        )


if __name__ == "__main__":
    main()
