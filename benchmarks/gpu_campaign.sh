#!/usr/bin/env bash
# The whole GPU campaign in one run (eight minutes on one H100 or H200), everything written into one folder:
#
#   bash benchmarks/gpu_campaign.sh OUTDIR            # on the GPU machine, from the repository root
#   bash benchmarks/gpu_campaign.sh OUTDIR --smoke    # on CPU: proves the driver end to end, measures nothing
#
# OUTDIR is also packed into OUTDIR.tgz at the end. The device tool brings back at most 8 files from $OUT, and
# nothing from a call that outlives its limit, so keep OUTDIR outside $OUT and the call well inside its limit:
#   CAMPAIGN_BUDGET_S=480 timeout 540 bash benchmarks/gpu_campaign.sh /tmp/campaign; \
#     cp /tmp/campaign.tgz /tmp/campaign/steps.tsv /tmp/campaign/campaign.log "$OUT"/
#
# Steps, each logged to OUTDIR/campaign.log and timed; a failing step is recorded and the next one runs. On the GPU
# they come in the order the GPU issue needs them, each cut to what is left of CAMPAIGN_BUDGET_S (default 520 s;
# a lease is about 15 minutes, the machine's start included):
#   1. the machine: nvidia-smi, torch / CUDA / driver versions (environment.json), and a time-boxed first touch of
#      CUDA (the campaign stops there if CUDA does not start)
#   2. `pytest -m gpu` (CUDA graphs, copy stream, pinned buffers)
#   3. gpu_offload.py on the DiT stack, LLM prefill and decode at batch 1 against accelerate, diffusers and vLLM's
#      functional_call: the issue's targets (written after each family, so a cut-short lease keeps them)
#   4. tests/test_simulated_device.py with OFFLOAD_TEST_DEVICE=cuda (every strategy's device path, the stream and
#      capture defects, on real streams): its fast tests, then a torch.profiler trace of one offloaded forward
#      (pinned copies overlapping compute), then its slow tests
#   5. the DiT stack under inductor, mixture-of-experts decode with routed expert fetches, the disk tier
# diffusers is not installed on the GPU machines: carry its wheel in .whl/ (see the device tool's README) and
# this script installs it into /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: gpu_campaign.sh OUTDIR [--smoke]}"
SMOKE="${2:-}"
BUDGET_S="${CAMPAIGN_BUDGET_S:-520}"
mkdir -p "$OUT"
# The GPU image's python3 is a virtualenv's: call it by name or by its own path (a symbolic link to it elsewhere
# loses the virtualenv, and torch with it)
PY="${PYTHON:-python3}"
LOG="$OUT/campaign.log"
START=$(date +%s)
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d)}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

elapsed() { echo $(( $(date +%s) - START )); }
step() {  # step NAME TIMEOUT_S COMMAND...: run, log, record status and seconds in OUTDIR/steps.tsv
  local name="$1" limit="$2"; shift 2
  local t0=$(date +%s)
  echo "=== $name ($(elapsed) s into the campaign)" | tee -a "$LOG"
  timeout "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" | tee -a "$OUT/steps.tsv"
}
left() { echo $(( BUDGET_S - $(elapsed) )); }
capped() {  # capped NAME LIMIT_S COMMAND...: step, its limit cut to what is left of the budget; skipped under 30 s
  local name="$1" limit="$2" room; shift 2
  room=$(( $(left) - 10 ))
  if [ "$room" -lt 30 ]; then
    echo "=== $name skipped: $(left) s left of $BUDGET_S" | tee -a "$LOG"
    printf '%s\tskipped\t0\n' "$name" >>"$OUT/steps.tsv"
    return
  fi
  step "$name" $(( limit < room ? limit : room )) "$@"
}

if [ "$SMOKE" = "--smoke" ]; then
  DEVICE=cpu
  step environment 60 "$PY" -c "import json, torch, sys; sys.path.insert(0, 'benchmarks'); from common import environment; json.dump(environment(), open('$OUT/environment.json', 'w'), indent=2)"
  step tests-gpu 120 "$PY" -m pytest -q -m gpu tests/test_gpu.py
  step gpu-offload-reduced 300 "$PY" benchmarks/gpu_offload.py --smoke --device cpu --reps 2 --rss off --no-plot \
    --methods none ours-layerwise-p1-eager ours-budget-eager diffusers-group-block --out "$OUT/gpu_offload_reduced.json"
  step profile 120 "$PY" benchmarks/profile_forward.py --device cpu --layers 2 --hidden 64 --out "$OUT/profile.json"
  step moe-decode 120 "$PY" benchmarks/moe_decode.py --device cpu --rounds 1 --calls 1 --out "$OUT/moe_decode.json"
  step disk-tier 300 "$PY" benchmarks/disk_tier.py --device sim --hidden 64 --layers 2 --rounds 1 \
    --out "$OUT/disk_tier.json"
else
  DEVICE=cuda
  timeout 30 nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
  # the first touch of the GPU, time-boxed: a machine whose CUDA start hangs spends no more of the lease
  step cuda-start 90 "$PY" -c "import torch; torch.zeros(1, device='cuda'); print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
  if [ "$(tail -1 "$OUT/steps.tsv" | cut -f2)" != 0 ]; then
    echo "CUDA did not start: campaign stopped" | tee -a "$LOG"
    tar czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")"
    exit 1
  fi
  step environment 60 "$PY" -c "import json, torch, sys; sys.path.insert(0, 'benchmarks'); from common import environment; json.dump(environment(), open('$OUT/environment.json', 'w'), indent=2)"
  capped tests-gpu 150 "$PY" -m pytest -q -rfE -n 4 --timeout 120 -m gpu tests/test_gpu.py
  capped gpu-offload 200 "$PY" benchmarks/gpu_offload.py --reps 5 --warmup 1 --rss off --no-plot \
    --dit-blocks 8 --dit-seq 4096 --llm-layers 6 --llm-prefill-seq 1024 --workloads dit llm_prefill llm_decode_b1 \
    --methods none ours-layerwise-p1-eager ours-layerwise-p2-eager ours-budget-eager accelerate-cpu_offload \
    diffusers-group-block vllm-functional_call --out "$OUT/gpu_offload.json"
  # the device-path tests written for the simulated device, on the real one
  OFFLOAD_TEST_DEVICE=cuda capped tests-device-path 90 "$PY" -m pytest -q -rfE -n 4 --timeout 60 -m "not slow" \
    tests/test_simulated_device.py
  capped profile 60 "$PY" benchmarks/profile_forward.py --device cuda --out "$OUT/profile.json"
  OFFLOAD_TEST_DEVICE=cuda capped tests-device-path-slow 120 "$PY" -m pytest -q -rfE -n 4 --timeout 90 -m slow \
    tests/test_simulated_device.py
  capped gpu-offload-inductor 150 "$PY" benchmarks/gpu_offload.py --reps 5 --warmup 1 --rss off --no-plot \
    --dit-blocks 8 --dit-seq 4096 --workloads dit \
    --methods none none-inductor ours-layerwise-p1-inductor ours-layerwise-p2-inductor diffusers-group-block \
    --out "$OUT/gpu_offload_inductor.json"
  capped moe-decode 60 "$PY" benchmarks/moe_decode.py --device cuda --dtype bfloat16 --hidden 1024 --layers 8 \
    --experts 64 --top-k 8 --vocab 32000 --out "$OUT/moe_decode.json"
  capped disk-tier 90 "$PY" benchmarks/disk_tier.py --device cuda --rounds 3 --out "$OUT/disk_tier_cuda.json"
fi
echo "campaign done in $(elapsed) s on $DEVICE; steps (name, exit status, seconds) in $OUT/steps.tsv" | tee -a "$LOG"
tar czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")"
