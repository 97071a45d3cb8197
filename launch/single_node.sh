#!/usr/bin/env bash
# One node, N GPUs (nccl), or N CPU processes (gloo) when no GPU is present.
#   launch/single_node.sh 8 experiment=bibtex train.epochs=20
# Everything after the process count is passed to hydra as overrides.
set -euo pipefail
nproc=${1:?usage: launch/single_node.sh NPROC [hydra overrides...]}; shift
# No cd: relative paths in the overrides (run_dir=, data.path=) mean what they mean where the user stands.
repo=$(cd "$(dirname "$0")/.." && pwd)
exec "$repo/.venv/bin/torchrun" --standalone --nproc-per-node="$nproc" -m xc.cli.train "$@"
