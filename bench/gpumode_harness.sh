#!/usr/bin/env bash
# The GPU MODE mixed-mla harness on a file written by `mla-tune export --submission`, where
# mla-tune is not importable.
#
# usage: bench/gpumode_harness.sh SUBMISSION.py HARNESS_DIR OUT_DIR [MODE[:SECONDS] ...]
#
# HARNESS_DIR holds the harness's eval.py, utils.py and task.py (gpu-mode/reference-kernels,
# problems/amd_202602 and its mixed-mla/; not part of this repository). Its reference.py
# needs aiter (AMD only), so bench/gpumode_reference.py stands in for it. The specs are
# those of mixed-mla/task.yml. Each mode (default: test benchmark leaderboard) runs as
# `POPCORN_FD=3 python3 eval.py MODE SPECS` in a fresh folder holding only these files,
# with PYTHONPATH unset; its report (fd 3) goes to OUT_DIR/MODE.txt, stderr to
# OUT_DIR/MODE.stderr. MLA_TUNE_TRACE=1 makes the submission print each shape's route.
# Mode `probe` runs bench/gpumode_leaderboard_probe.py there instead (the same call under
# the benchmark and leaderboard protocols and variants of them) on the specs in
# $PROBE_SPECS (default below); its lines go to OUT_DIR/probe.txt, its data to
# OUT_DIR/probe.json.
set -uo pipefail
sub=$1 harness=$2 out=$3
shift 3
modes=("$@")
[ ${#modes[@]} -gt 0 ] || modes=(test benchmark leaderboard)
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)
run=$(mktemp -d)
cp "$sub" "$run/submission.py"
cp "$harness/eval.py" "$harness/utils.py" "$harness/task.py" "$run/"
cp "$here/gpumode_reference.py" "$run/reference.py"
cp "$here/gpumode_leaderboard_probe.py" "$run/probe.py"
cat > "$run/tests.txt" <<'SPECS'
batchsize: 4; qseqlen: 1; kvseqlen: 1024; seed: 4220
batchsize: 32; qseqlen: 1; kvseqlen: 1024; seed: 5412
batchsize: 64; qseqlen: 1; kvseqlen: 8192; seed: 1360
batchsize: 256; qseqlen: 1; kvseqlen: 8192; seed: 9826
SPECS
cat > "$run/benchmarks.txt" <<'SPECS'
batchsize: 4; qseqlen: 1; kvseqlen: 1024; seed: 4217
batchsize: 4; qseqlen: 1; kvseqlen: 8192; seed: 4220
batchsize: 32; qseqlen: 1; kvseqlen: 1024; seed: 5412
batchsize: 32; qseqlen: 1; kvseqlen: 8192; seed: 5415
batchsize: 64; qseqlen: 1; kvseqlen: 1024; seed: 1357
batchsize: 64; qseqlen: 1; kvseqlen: 8192; seed: 1360
batchsize: 256; qseqlen: 1; kvseqlen: 1024; seed: 9823
batchsize: 256; qseqlen: 1; kvseqlen: 8192; seed: 9826
SPECS
cd "$run"
unset PYTHONPATH
if python3 -c 'import mla_tune' 2>/dev/null; then
    echo "mla_tune is importable in $run; refusing to run" >&2
    exit 1
fi
echo "in $run: python3 -c 'import mla_tune' fails (as it must)"
for item in "${modes[@]}"; do
    mode=${item%%:*}
    limit=${item#*:}
    [ "$limit" != "$item" ] || limit=600
    specs=benchmarks.txt
    [ "$mode" = test ] && specs=tests.txt
    t0=$(date +%s)
    if [ "$mode" = probe ]; then
        # shellcheck disable=SC2086 # the specs are words
        MLA_TUNE_TRACE=1 timeout "$limit" python3 probe.py "$out" \
            ${PROBE_SPECS:-4x8192:4220 4x1024:4217 32x1024:5412} \
            >"$out/probe.txt" 2>"$out/probe.stderr"
    else
        MLA_TUNE_TRACE=1 POPCORN_FD=3 timeout "$limit" python3 eval.py "$mode" "$specs" \
            3>"$out/$mode.txt" 2>"$out/$mode.stderr"
    fi
    echo "$mode: exit $? after $(( $(date +%s) - t0 )) s"
done
