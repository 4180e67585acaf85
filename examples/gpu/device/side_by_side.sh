#!/bin/bash
# vLLM 0.20.0 then pagedllm on the same GPU, one after the other (README.md beside this file).
# usage: bash examples/gpu/device/side_by_side.sh [W1,W2,W3,W4,W5]
#   -> $OUT/{vllm_result,pagedllm_suite}.json and both logs
W=${1:-W1,W2,W3,W4,W5}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
date -u +%H:%M:%S
python3 anchors/vllm/device_install.py .vl /tmp/site || exit 3
PYTHONPATH=/tmp/site timeout 330 python3 anchors/vllm/bench_vllm.py --workloads "$W" > "$OUT/vllm_log.txt" 2>&1
echo "vllm rc=$?"; grep -E "VLLM_JSON|^\[W" "$OUT/vllm_log.txt" | cut -c1-300
date -u +%H:%M:%S
source examples/gpu/device/setup.sh || exit 3
timeout 240 python3 examples/gpu/bench_suite.py --workloads "$W" --vllm "$OUT/vllm_result.json" \
  --out "$OUT/pagedllm_suite.json" > "$OUT/pagedllm_log.txt" 2>&1
echo "pagedllm rc=$?"; grep -E "^\||^startup|^\[W[1245]|start-up:|WARN|Error" "$OUT/pagedllm_log.txt" | cut -c1-300
date -u +%H:%M:%S
