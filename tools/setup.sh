#!/usr/bin/env bash
# Set up xc on a fresh machine: creates .venv and installs everything the project and its tests need (with the
# extras `ray` for miner=ray and `plots` for the benchmarks' figures; a plain `pip install -e .` leaves them out).
#   bash tools/setup.sh          CPU machine: CPU build of torch (no CUDA downloads), faiss-cpu
#   bash tools/setup.sh --gpu    GPU machine: CUDA build of torch from PyPI, faiss-gpu
# Re-running is safe (it reuses .venv). PYTHON=python3.11 picks the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=2.13.0
mode=cpu
[[ "${1:-}" == "--gpu" ]] && mode=gpu

"${PYTHON:-python3}" -m venv .venv
pip=(.venv/bin/python -m pip install --disable-pip-version-check -q)

if [[ $mode == cpu ]]; then
  # The +cpu build carries no CUDA libraries (~200 MB instead of several GB). Prefer a local wheel
  # (a --find-links directory from pip's config) and fall back to PyTorch's CPU index.
  "${pip[@]}" --no-index --no-deps "torch==${TORCH_VERSION}+cpu" 2>/dev/null \
    || "${pip[@]}" --no-deps "torch==${TORCH_VERSION}+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
  "${pip[@]}" -e ".[cpu,dev,ray,plots]"
else
  "${pip[@]}" "torch==${TORCH_VERSION}"
  "${pip[@]}" -e ".[gpu,dev,ray,plots]"
fi
.venv/bin/python - <<'PY'
import diskannpy, faiss, numpy, torch
print(f"xc ready: torch {torch.__version__} (cuda: {torch.cuda.is_available()}), numpy {numpy.__version__}, "
      f"faiss {faiss.__version__}, diskannpy (rust) ok")
PY
