#!/usr/bin/env bash
# A time-boxed H200 run of everything at once, from the repository root on the GPU machine
# (two H200s for the --gpus comparison); the FlashInfer and torch trials of the shipped H200
# DB come from it (bench/results/flashinfer_baseline.md, torch_family.md):
#     source .device/setup.sh && OUT=/some/dir bash bench/h200_timeboxed.sh
# It writes $OUT/tuning.db (all trials and winners), $OUT/winners.json, $OUT/session.log,
# $OUT/h200_suite.md and $OUT/dispatch_overhead.md. Each step has its own time limit so a
# slow step cannot cost the others; every trial is stored as soon as it is measured.
set -uo pipefail
out=${OUT:-/tmp/mla-tune-h200}
mkdir -p "$out"
db=$out/tuning.db
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
start=$SECONDS
deadline=${DEADLINE_S:-560}
step() { echo; echo "== [$((SECONDS - start)) s] $*"; }
# Seconds a step may take: its own cap, or what is left before the deadline.
cap() { local left=$((deadline - (SECONDS - start))); echo $(( $1 < left ? $1 : (left > 5 ? left : 5) )); }

# Narrowed spaces for a time-boxed run: the knob values the Triton development runs
# (bench/triton_dev.py) found best and FlashInfer's fastest paths
# (bench/results/flashinfer_baseline.md). The full spaces stay the default.
pins=(--pin triton.block_n=32 --pin triton.num_stages=3 --pin triton.compute=bf16,fp16
      --pin triton.fast_mode=true --pin triton.num_splits=0,1,2,4,8,16
      --pin flashinfer.backend=fa3 --pin flashinfer.launch=direct
      --pin flashinfer.fp8_scale=fold --pin flashinfer.page_size=1,64
      --pin torch.compute_dtype=bfloat16 --pin torch.chunk_size=0 --pin torch.num_splits=1,16)

if [ "${1:-}" = "--second-pass" ]; then
  db=mla_tune/shipped/tuning.db  # the shipped results, written on purpose by their path
  step "FlashInfer bf16 on the suites"
  timeout "$(cap 150)" python3 bench/h200_suite.py --suite seeds --suite leaderboard-v1 \
      --kv-format bf16 --backend flashinfer --db "$db" --time-budget 0.2 \
      --pin flashinfer.backend=fa3 --pin flashinfer.launch=direct --pin flashinfer.page_size=1,64
  step "Triton MXFP4 on the suites"
  timeout "$(cap 150)" python3 bench/h200_suite.py --suite leaderboard-v1 --kv-format mxfp4 \
      --backend triton --db "$db" --time-budget 0.2 --pin triton.num_stages=2 \
      --pin triton.fast_mode=true --pin triton.num_splits=0,2,4,8,16
  step "tables"
  python3 bench/h200_suite.py --suite seeds --suite leaderboard-v1 --db "$db" --report-only \
      --out "$out/h200_suite.md"
  python3 -m mla_tune export --db "$db" --out "$out/winners.json"
  cp "$db" "$out/tuning.db"
  step "done"
  exit 0
fi

step "doctor"
timeout "$(cap 60)" python3 -m mla_tune doctor --device cuda

step "torch family, full space, 256x8192 bf16"
timeout "$(cap 120)" python3 -m mla_tune sweep --shape 256x8192 -f bf16 --device cuda --backend torch \
    --no-baseline --time-budget 0.3 --db "$db"

step "seeds + leaderboard-v1 suites, triton vs flashinfer vs torch"
timeout "$(cap 220)" python3 bench/h200_suite.py --suite seeds --suite leaderboard-v1 --db "$db" \
    --gpus "$ngpu" --time-budget 0.2 --out "$out/h200_suite.md" "${pins[@]}"

step "dispatcher overhead on the tuned winners"
python3 -m mla_tune export --db "$db" --out "$out/winners.json"
timeout "$(cap 90)" python3 bench/dispatch_overhead.py --winners "$out/winners.json" \
    --out "$out/dispatch_overhead.md"

step "report"
COLUMNS=200 timeout "$(cap 30)" python3 -m mla_tune report --db "$db" --suite leaderboard-v1

if [ "$ngpu" -ge 2 ]; then
  step "--gpus 2 vs --gpus 1, leaderboard-v1 bf16, triton"
  timeout "$(cap 200)" python3 bench/multi_gpu_sweep.py --backend triton --time-budget 0.2 \
      --out /tmp/mla-tune-multigpu -- "${pins[@]}"
fi

step "done"

# Second pass (the first pass's pins leave out FlashInfer's bf16 points, which need
# fp8_scale=host, and Triton's MXFP4 points): run with the first pass's DB as
# mla_tune/shipped/tuning.db:
#     source .device/setup.sh && bash bench/h200_timeboxed.sh --second-pass
