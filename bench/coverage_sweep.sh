#!/bin/bash
# The coverage sweep of the shipped winners (bench/results/coverage_and_fallbacks.md), run on
# the GPU machine from a clean archive of the repository (`git archive HEAD -o out/head.tar`
# first), then the serving wrapper's CUDA-graph test and a route print. Writes under $OUT.
set -u
source .device/setup.sh
mkdir -p /tmp/w && tar -xf out/head.tar -C /tmp/w && cp mla_tune/shipped/tuning.db /tmp/w/mla_tune/shipped/
cd /tmp/w
export PYTHONPATH=/tmp/site:/tmp/w
T0=$(date +%s)
stamp() { echo "$(( $(date +%s) - T0 )) s: $*" | tee -a "$OUT/timing.txt"; }
python3 -c "import torch, triton; from mla_tune.backends import source_hashes as s; print('torch', torch.__version__, 'triton', triton.__version__, s())" > "$OUT/stack.txt" 2>&1
stamp "setup done: $(cat $OUT/stack.txt)"
DB="$OUT/coverage.db"
COMMON="--suite coverage --backend triton --no-baseline --db $DB --time-budget 0.02 --runoff 2 --pin triton.block_n=64 --pin triton.fast_mode=true"
run_sweep() {
  local name=$1 cap=$2; shift 2
  local t=$(date +%s)
  timeout -s INT "$cap" python3 -m mla_tune sweep $COMMON "$@" > "$OUT/sweep_$name.log" 2>&1
  echo "rc=$? wall=$(( $(date +%s) - t )) s" >> "$OUT/sweep_$name.log"
  stamp "sweep $name: $(tail -1 "$OUT/sweep_$name.log")"
}
run_sweep bf16 68 -f bf16 --pin triton.kv_load=tma --pin triton.num_stages=2
run_sweep fp8 78 -f fp8 --pin triton.compute=fp8 --pin triton.kv_load=pointer,tma --pin triton.num_stages=3
run_sweep mxfp4 64 -f mxfp4 --pin triton.kv_load=pointer --pin triton.num_stages=2
timeout 40 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_wrapper.py -k graph > "$OUT/pytest_graph.log" 2>&1; stamp "graph test rc=$?: $(tail -1 $OUT/pytest_graph.log)"
python3 -m mla_tune route --shape 4x8192 --heads 32 --q-len 4 --db "$DB" > "$OUT/route.txt" 2>&1; stamp "route rc=$?"
gzip -k "$DB"
