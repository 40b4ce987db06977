#!/usr/bin/env bash
# GPU check of the Triton path, in one go (< 8 minutes on an H200):
#   1. installs what it needs from wheels carried in the repo (.whl/*.whl; no registry);
#   2. runs the kernel tests on the GPU (attention, fused MoE when its test exists, and the
#      triton backend's layer-level tests) and the EAGLE-3 trainer's tests (on the GPU);
#   3. scripts/gpu_check_server.py: the shipped server on --device cuda (tiny Llama, Mixtral
#      with 2 of 8 experts resident and prefetch, DeepSeek-V2 MLA, SmolLM2-135M; plain,
#      NGRAM, STANDALONE chain and tree) against a CPU float32 server, decode tok/s;
#   then scripts/gpu_check.py: times every kernel against its torch reference, measures the
#      decode kernel's fraction of copy bandwidth, runs the engine end to end on a random
#      Llama with and without speculation (greedy equality, decode tokens/s), and a random
#      Mixtral with half its experts resident, prefetch off vs `draft` (issue 7: equality,
#      verify time, recall, stall);
#   4. prints one table (last in the output). Logs and JSON go to $GPU_CHECK_OUT (default:
#      $OUT when set, else /tmp/gpu_check).
# Without a CUDA device it says so and exits 0 at once.
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: no CUDA device (or no torch) on this machine: nothing to check here."
    echo "gpu_check: the CPU tests cover the kernels under TRITON_INTERPRET=1."
    exit 0
fi

OUT_DIR="${GPU_CHECK_OUT:-${OUT:-/tmp/gpu_check}}"
mkdir -p "$OUT_DIR"
SUMMARY="$OUT_DIR/pytest_summary.tsv"
: > "$SUMMARY"
START=$(date +%s)

# 1. Carried wheels (README: pip download ... -d .whl). Nothing else is installed.
if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/gpu_check_site .whl/*.whl || echo "gpu_check: wheel install failed"
    export PYTHONPATH="/tmp/gpu_check_site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$ROOT/python:$ROOT/sgl-kernel:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
"$PY" -c 'import torch, triton; print("gpu_check:", torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)'
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null || true

# 2. Kernel tests, compiled on the GPU (each file bounded so the whole run fits).
run_pytest() {  # name, timeout seconds, pytest args...
    local name="$1" limit="$2"; shift 2
    local log="$OUT_DIR/pytest_${name}.log"
    timeout "$limit" "$PY" -m pytest -q -p no:cacheprovider "$@" > "$log" 2>&1
    local rc=$?
    local tail_line
    tail_line="$(grep -E '(passed|failed|error|skipped|no tests ran)' "$log" | tail -1)"
    [ "$rc" = 124 ] && tail_line="TIMEOUT after ${limit}s"
    printf '%s\t%s\n' "$name" "${tail_line:-rc $rc}" >> "$SUMMARY"
    echo "gpu_check: pytest $name: ${tail_line:-rc $rc}"
    [ "$rc" = 0 ] || tail -30 "$log"
}
run_pytest triton_attention 180 test/kernel/test_triton_attention.py
if [ -f test/kernel/test_fused_moe.py ]; then
    run_pytest fused_moe 100 test/kernel/test_fused_moe.py
fi
run_pytest triton_backend 80 test/srt/test_triton_backend.py
# the EAGLE-3 trainer on the GPU (--device auto picks it): features, training, round trip
run_pytest eagle3_trainer 60 test/srt/speculative/test_eagle3_trainer.py -m "not slow"

# 3 + 4. Timings and the engine; the table is the last thing printed.
# 3. the shipped server on --device cuda against a CPU float32 server (no patches), rows
#    saved model by model so a stage stopped by its limit keeps what it found
timeout 230 "$PY" scripts/gpu_check_server.py --json "$OUT_DIR/gpu_check_server.json" \
    2>&1 | tee "$OUT_DIR/gpu_check_server.log"
[ "${PIPESTATUS[0]}" = 124 ] && echo "gpu_check: server stage stopped after 230s (partial JSON)"
LEFT=$(( 460 - ($(date +%s) - START) ))
[ "$LEFT" -lt 90 ] && LEFT=90
timeout "$LEFT" "$PY" scripts/gpu_check.py --json "$OUT_DIR/gpu_check.json" \
    --pytest-summary "$SUMMARY" 2>&1 | tee "$OUT_DIR/gpu_check.log"
rc=${PIPESTATUS[0]}
if [ "$rc" = 124 ]; then
    echo "gpu_check: timings/engine stage stopped after ${LEFT}s; partial log in $OUT_DIR/gpu_check.log"
    cat "$SUMMARY"
fi
echo "gpu_check: done in $(( $(date +%s) - START ))s (logs in $OUT_DIR)"
exit 0
