#!/usr/bin/env bash
# `--verify` on a machine of another type and another jax: the lent GPU machine (jax
# 0.11.2 there, 0.10.2 here), once on its GPU and, at the same time, on its CPU. No
# committed record is current there, so each re-trains the headline cell and checks the
# new seed-paired gap against the published interval. Writes $OUT/{gpu,cpu}.log.
# Needs grain, array-record and portpicker as py3.12 wheels in .whl/ (carried).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  lscpu | grep -E "Model name|^CPU\(s\)|Flags" | cut -c1-400
  python3 -c "import jax, jaxlib, equinox, optax; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'equinox', equinox.__version__, 'optax', optax.__version__)"
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
JAX_PLATFORMS=cpu timeout "${1:-480}" python3 -m sdiloco.paper --verify 2 \
  > "$OUT/cpu.log" 2>&1 &
cpu=$!
timeout "${1:-480}" python3 -m sdiloco.paper --verify 2 2>&1 | tee "$OUT/gpu.log"
wait $cpu; echo "cpu exit $?"; cat "$OUT/cpu.log"
