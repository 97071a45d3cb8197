#!/usr/bin/env bash
# Several nodes with c10d rendezvous. Run the same command on every node:
#   NNODES=2 NPROC_PER_NODE=8 RDZV_ENDPOINT=node0:29400 RUN_ID=astra-1 launch/multi_node.sh experiment=bibtex
# run_dir and data.cache_dir must be on storage every node sees (the miner reads the run dir too).
# --max-restarts lets torchrun restart all ranks from the last checkpoint after a failure.
set -euo pipefail
: "${NNODES:?set NNODES}" "${NPROC_PER_NODE:?set NPROC_PER_NODE}" "${RDZV_ENDPOINT:?set RDZV_ENDPOINT host:port}"
# No cd: relative paths in the overrides (run_dir=, data.path=) mean what they mean where the user stands.
repo=$(cd "$(dirname "$0")/.." && pwd)
# Restarts across nodes: each agent counts its own restarts, so the per-attempt store prefix that
# xc/distributed/comm.py adds may disagree between nodes; a fresh store per attempt avoids reading
# addresses a dead attempt left behind (pytorch/pytorch#135712).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
exec "$repo/.venv/bin/torchrun" --nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE" \
  --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="${RUN_ID:-xc}" \
  --max-restarts="${MAX_RESTARTS:-3}" -m xc.cli.train "$@"
