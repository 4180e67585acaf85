#!/bin/bash
# The KV tiers' benchmark on one H200 (tools/bench_kv_tiers.py): Llama-3.1-8B shape, bf16, dummy weights; no
# connector, the host tier, then host + disk tiers, one engine after the other in one process.
# Carry: .snap .whl/ours   (payload.sh; the tool runs from .snap, i.e. the HEAD that was archived)
# usage: bash examples/gpu/device/kv_tiers.sh [extra args for bench_kv_tiers.py]   -> $OUT/kv_tiers.json, log
#
# Sizes: 64 conversations x 2,048-token system prompts = 131,072 prefix tokens = 16 GiB of KV (128 KiB per
# token), against a device pool of 4,096 blocks x 16 = 65,536 tokens, so a conversation's prefix is evicted
# before its next turn. The host mode's tier holds all of it (32 GiB, pinned); host + disk keeps a quarter in
# host memory (4 GiB) and the rest in files under /tmp (device disk: 64 GiB).
source examples/gpu/device/setup.sh || exit 3
date -u +%H:%M:%S
mkdir -p /tmp/l8b && python3 - <<'EOF' || exit 3
import json, sys
sys.path.insert(0, ".snap/examples/gpu")
from h200_check import LLAMA_8B_CONFIG
json.dump(LLAMA_8B_CONFIG, open("/tmp/l8b/config.json", "w"))
EOF
free -g | head -2; df -h /tmp | tail -1
timeout 560 python3 .snap/tools/bench_kv_tiers.py --model /tmp/l8b --load-format dummy --device cuda \
  --dtype bfloat16 --num-prefixes 64 --prefix-len 2048 --turns 3 --turn-len 128 --max-tokens 64 \
  --block-size 16 --device-blocks 4096 --max-num-seqs 256 --max-num-batched-tokens 16384 \
  --host-gb 32 --small-host-gb 4 --disk-gb 40 --disk-root /tmp --id-low 1000 --id-high 120000 \
  --out "$OUT/kv_tiers.json" "$@" > "$OUT/kv_tiers_log.txt" 2>&1
echo "rc=$?"; grep -E "^\[(none|host)|Error|error" "$OUT/kv_tiers_log.txt" | cut -c1-600 | tail -8
tail -30 "$OUT/kv_tiers_log.txt" | grep -v "^\[" | tail -22
date -u +%H:%M:%S
