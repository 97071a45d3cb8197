#!/usr/bin/env bash
# N CPU processes with gloo (no GPU needed): for development, tests, and CPU-only clusters.
#   launch/cpu_gloo.sh 2 parallel.num_label_shards=2 train.epochs=3
# Threads are split between the processes so they do not oversubscribe the cores.
set -euo pipefail
nproc=${1:?usage: launch/cpu_gloo.sh NPROC [hydra overrides...]}; shift
# No cd: relative paths in the overrides (run_dir=, data.path=) mean what they mean where the user stands.
repo=$(cd "$(dirname "$0")/.." && pwd)
cores=$(nproc)
export XC_THREADS=${XC_THREADS:-$(( cores / nproc > 0 ? cores / nproc : 1 ))}
exec "$repo/.venv/bin/torchrun" --standalone --nproc-per-node="$nproc" -m xc.cli.train \
  parallel.backend=gloo train.device=cpu "$@"
