#!/bin/bash
# Structured-output overhead, vLLM 0.20.0 then pagedllm on the same GPU (examples/gpu/bench_structured.py).
# Carry: .snap .whl/ours .vl anchors .sob   (.sob/extra: see below; .sob/tok.tar.xz: `python examples/gpu/bench_structured.py
#   --save-tokenizer .sob/tok && tar -cJf .sob/tok.tar.xz -C .sob tok` on a machine with the embedded model)
# usage: bash examples/gpu/device/structured.sh [vllm,pagedllm] [extra args for bench_structured.py]
WHICH=${1:-vllm,pagedllm}; shift
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
date -u +%H:%M:%S
mkdir -p /tmp/sob && tar -xJf .sob/tok.tar.xz -C /tmp/sob || exit 3
python3 anchors/vllm/device_install.py .vl /tmp/site || exit 3
# vLLM's request validation imports its lm-format-enforcer backend module (never used here), whose class
# annotations need the package: .sob/extra holds lm-format-enforcer==0.11.3 (vLLM's pin) and interegular.
ls .sob/extra/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
  .sob/extra/*.whl 2>&1 | grep -v WARN
if [[ $WHICH == *vllm* ]]; then
  PYTHONPATH=/tmp/site timeout 300 python3 examples/gpu/bench_structured.py --engine vllm --tokenizer /tmp/sob/tok \
    --out "$OUT/so_vllm.json" "$@" > "$OUT/so_vllm_log.txt" 2>&1
  echo "vllm rc=$?"; grep -E "^\[vllm|Error|error" "$OUT/so_vllm_log.txt" | cut -c1-400 | tail -8
  date -u +%H:%M:%S
fi
if [[ $WHICH == *pagedllm* ]]; then
  source examples/gpu/device/setup.sh || exit 3
  # xgrammar and its runtime from the vLLM payload's site folder (the same build vLLM uses), nothing else of it
  mkdir -p /tmp/xg && for m in xgrammar tvm_ffi; do ln -sfn /tmp/site/$m /tmp/xg/$m; done
  PYTHONPATH=/tmp/ours:/tmp/xg timeout 240 python3 examples/gpu/bench_structured.py --engine pagedllm \
    --tokenizer /tmp/sob/tok --out "$OUT/so_pagedllm.json" "$@" > "$OUT/so_pagedllm_log.txt" 2>&1
  echo "pagedllm rc=$?"; grep -E "^\[pagedllm|Error|error" "$OUT/so_pagedllm_log.txt" | cut -c1-400 | tail -8
fi
python3 examples/gpu/bench_structured.py --table "$OUT/so_vllm.json" "$OUT/so_pagedllm.json"
date -u +%H:%M:%S
