#!/bin/bash
# vLLM 0.20.0 then pagedllm on the same GPU, one after the other, for each model shape (README.md beside this file).
# usage: bash examples/gpu/device/side_by_side.sh [W1,W2,W3,W4,W5] [SHAPE[,SHAPE...]] [SCALE] [QUANT[,QUANT...]]
#   SHAPE: a name from examples/gpu/model_shapes.py (default llama-3.1-8b); SCALE: the fraction of W1/W2/W4/W5's
#   requests both sides run (default 1); QUANT: none (bf16, the default), gptq, awq (a checkpoint's
#   quantization_config: vLLM's Marlin kernels beside ours) or fp8 (both engines quantize the bf16 weights while
#   loading), each shape run once per QUANT. Each engine's run is cut at VLLM_TIMEOUT / OURS_TIMEOUT seconds
#   (default 330 / 240, the 8B's at scale 1). MAX_SEQS=N caps both engines' running batch (--max-num-seqs N;
#   default each engine's own: 1024 on both).
#   -> $OUT/{vllm_result,pagedllm_suite}.json and both logs for the default shape in bf16; another shape or a
#      quantization adds _SHAPE / _QUANT to each name (vllm_result_SHAPE_QUANT.json, pagedllm_log_QUANT.txt, ...)
W=${1:-W1,W2,W3,W4,W5}
SHAPES=${2:-llama-3.1-8b}
SCALE=${3:-1}
QUANTS=${4:-none}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
date -u +%H:%M:%S
# The default shape in bf16 passes no --shape or --quantization (an anchor copied unchanged from ../shared still
# runs it). Any other is checked by both sides here, before minutes of installs and start-ups: a typo in a name
# fails in seconds.
shape_arg() { [ "$1" = llama-3.1-8b ] || echo "--shape $1"; }
quant_arg() { [ "$1" = none ] || echo "--quantization $1"; }
seqs_arg() { [ -z "${MAX_SEQS:-}" ] || echo "--max-num-seqs $MAX_SEQS"; }
for S in ${SHAPES//,/ }; do
  for Q in ${QUANTS//,/ }; do
    [ "$S" = llama-3.1-8b ] && [ "$Q" = none ] && continue
    # shellcheck disable=SC2046
    python3 anchors/vllm/bench_vllm.py $(shape_arg "$S") $(quant_arg "$Q") --workloads "$W" --dry-run > /dev/null || exit 2
    # shellcheck disable=SC2046
    python3 examples/gpu/bench_suite.py $(shape_arg "$S") $(quant_arg "$Q") --workloads "$W" --dry-run > /dev/null || exit 2
  done
done
python3 anchors/vllm/device_install.py .vl /tmp/site || exit 3
source examples/gpu/device/setup.sh || exit 3
for S in ${SHAPES//,/ }; do
  for Q in ${QUANTS//,/ }; do
    X=$([ "$S" = llama-3.1-8b ] || echo "_$S")$([ "$Q" = none ] || echo "_$Q")
    echo "== $S $Q (scale $SCALE)"; date -u +%H:%M:%S
    # shellcheck disable=SC2046
    PYTHONPATH=/tmp/site timeout "${VLLM_TIMEOUT:-330}" python3 anchors/vllm/bench_vllm.py $(shape_arg "$S") \
      $(quant_arg "$Q") $(seqs_arg) --workloads "$W" --scale "$SCALE" > "$OUT/vllm_log$X.txt" 2>&1
    echo "vllm $S $Q rc=$?"; grep -E "VLLM_JSON|^\[W" "$OUT/vllm_log$X.txt" | cut -c1-300
    date -u +%H:%M:%S
    # shellcheck disable=SC2046
    timeout "${OURS_TIMEOUT:-240}" python3 examples/gpu/bench_suite.py $(shape_arg "$S") $(quant_arg "$Q") \
      $(seqs_arg) --workloads "$W" --scale "$SCALE" --vllm "$OUT/vllm_result$X.json" --out "$OUT/pagedllm_suite$X.json" \
      > "$OUT/pagedllm_log$X.txt" 2>&1
    echo "pagedllm $S $Q rc=$?"; grep -E "^\||^shape|^\[W[1245]|start-up:|WARN|Error" "$OUT/pagedllm_log$X.txt" | cut -c1-300
  done
done
date -u +%H:%M:%S
