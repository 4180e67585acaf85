#!/bin/bash
# The online path on one GPU: `pagedllm serve` then `vllm serve` (vLLM 0.20.0), the 8B shape with dummy weights,
# each driven by the same load generators (examples/gpu/bench_online.py: `vllm bench serve` and ours) at
# concurrency 1 / 64 / 256, random and shared-prefix prompts, streaming /v1/completions.
# Carry: .snap .whl/online .vl anchors   (62 MiB with the tree; .snap from payload.sh; .whl/ours is not needed: its
#   wheels are the vLLM site's versions, linked from there; .whl/online: the wheels below, from the repo root on a machine
#   with PyPI: python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
#   --platform manylinux_2_17_x86_64 -d .whl/online uvicorn==0.54.0 watchfiles==1.3.0 jmespath==1.1.0
#   model-hosting-container-standards==0.1.16 prometheus-fastapi-instrumentator==8.1.0 python-multipart==0.0.34
#   -- what `vllm serve` imports beyond the anchor payload, and uvicorn for ours too)
# usage: bash examples/gpu/device/online.sh [pagedllm,vllm] [extra args for `bench_online.py load`]
#   -> $OUT/online_{pagedllm,vllm}.json, online_table.md, both servers' logs; ~6-8 minutes
WHICH=${1:-pagedllm,vllm}; shift
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false
MODEL=/tmp/online_8b
NAME=llama-8b-dummy
# The step shape of README's side-by-side (max_num_seqs 1024, a 16,384-token step budget) on both servers.
ENGINE_ARGS="--load-format dummy --dtype bfloat16 --seed 0 --max-num-seqs 1024 --max-num-batched-tokens 16384 \
  --gpu-memory-utilization 0.9 --served-model-name $NAME"
date -u +%H:%M:%S
python3 anchors/vllm/device_install.py .vl /tmp/site || exit 3
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/online/*.whl 2>&1 | grep -v WARN
SRC=.snap; [ -d .snap ] || SRC=.  # the committed snapshot (payload.sh), else this working tree
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target /tmp/ours \
  ./$SRC 2>&1 | grep -v WARN
# pagedllm's and its server's dependencies that the image lacks, from the vLLM site (the versions .whl/ours holds,
# and the builds vLLM serves with), nothing else of it.
mkdir -p /tmp/srv && for m in pydantic pydantic_core annotated_types typing_extensions.py typing_inspection gguf \
  fastapi starlette msgspec zmq pyzmq.libs uvicorn opentelemetry sniffio; do ln -sfn /tmp/site/$m /tmp/srv/$m; done
export PYTHONPATH=/tmp/ours:/tmp/srv
python3 -c "import pagedllm.plugins.server.app" || exit 3
echo "pagedllm $(cat $SRC/HEAD 2>/dev/null || echo working-tree) in /tmp/ours"
nvidia-smi --query-gpu=name,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader
python3 examples/gpu/bench_online.py prepare $MODEL || exit 3

BUDGET=${ONLINE_BUDGET_S:-570}  # the whole script, inside one 600 s device command
left() { local l=$((BUDGET - SECONDS - 20)); [ "$l" -lt "$1" ] && echo $((l > 10 ? l : 10)) || echo "$1"; }

wait_healthy() {  # url pid seconds
  python3 - "$@" <<'EOF'
import os, sys, time, urllib.request
url, pid, limit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
t0 = time.time()
while time.time() - t0 < limit:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit(f"server {pid} exited")
    try:
        if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
            print(f"healthy after {time.time() - t0:.1f} s"); sys.exit(0)
    except Exception:
        time.sleep(1)
sys.exit(f"not healthy after {limit:.0f} s")
EOF
}

stop() {  # pid: SIGINT (a drain: nothing is in flight), then SIGKILL to it and its children after 30 s, so
          # that no engine-core process keeps the GPU's memory from the next server
  local kids; kids=$(ps -o pid= --ppid "$1" 2>/dev/null)
  kill -INT "$1" 2>/dev/null
  for _ in $(seq 1 30); do kill -0 "$1" 2>/dev/null || break; sleep 1; done
  for p in $1 $kids; do kill -0 "$p" 2>/dev/null && kill -KILL "$p" 2>/dev/null; done
  sleep 2
}

run_side() {  # label port start_limit_s load_limit_s command...
  local label=$1 port=$2 start_limit load_limit=$4; start_limit=$(left "$3"); shift 4
  date -u +%H:%M:%S
  "$@" --port "$port" > "$OUT/${label}_server.log" 2>&1 &
  local pid=$!
  if wait_healthy "http://127.0.0.1:$port" "$pid" "$start_limit"; then
    PYTHONPATH=/tmp/site:/tmp/ours timeout "$(left "$load_limit")" python3 examples/gpu/bench_online.py load \
      "http://127.0.0.1:$port" $MODEL --label "$label" --model-name $NAME --server-pid "$pid" \
      --out "$OUT/online_${label}.json" "${EXTRA[@]}" 2>&1 | grep -E "^\[$label\]|Error|error" | cut -c1-300
  else
    tail -20 "$OUT/${label}_server.log"
  fi
  stop "$pid"
}

EXTRA=("$@")
if [[ $WHICH == *pagedllm* ]]; then
  # shellcheck disable=SC2086
  PYTHONPATH=/tmp/ours:/tmp/srv run_side pagedllm 8100 120 150 \
    python3 -m pagedllm.cli.serve_cmd $MODEL $ENGINE_ARGS --device cuda --log-level warning --no-ui
fi
if [[ $WHICH == *vllm* ]]; then
  # shellcheck disable=SC2086
  PYTHONPATH=/tmp/site run_side vllm 8200 240 150 \
    python3 -m vllm.entrypoints.cli.main serve $MODEL $ENGINE_ARGS --uvicorn-log-level warning \
    --disable-uvicorn-access-log
fi
files=(); for side in pagedllm vllm; do [ -f "$OUT/online_$side.json" ] && files+=("$OUT/online_$side.json"); done
[ ${#files[@]} -gt 0 ] && python3 examples/gpu/bench_online.py table "${files[@]}" | tee "$OUT/online_table.md"
date -u +%H:%M:%S
