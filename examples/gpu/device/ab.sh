#!/bin/bash
# Same-GPU A/B of two pagedllm trees, alternating A B A B so drift in clocks or heat shows up in both:
#   A = .snap (payload.sh: HEAD), B = .snapb (`git archive BASE | tar -x -C .snapb`; echo BASE > .snapb/HEAD).
# usage: bash examples/gpu/device/ab.sh [W1,W5] [ROUNDS]   -> $OUT/ab_{A,B}{1..ROUNDS}.json and logs
W=${1:-W1,W5}
ROUNDS=${2:-2}
source examples/gpu/device/setup.sh || exit 3
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target /tmp/oursb \
  .whl/ours/*.whl ./.snapb 2>&1 | grep -v WARN
echo "A=$(cat .snap/HEAD) B=$(cat .snapb/HEAD)"
for r in $(seq 1 "$ROUNDS"); do
  for side in A B; do
    site=/tmp/ours; [ "$side" = B ] && site=/tmp/oursb
    tree=.snap; [ "$side" = B ] && tree=.snapb
    date -u +%H:%M:%S
    PYTHONPATH=$site timeout 200 python3 "$tree/examples/gpu/bench_suite.py" --workloads "$W" \
      --out "$OUT/ab_${side}${r}.json" > "$OUT/ab_${side}${r}_log.txt" 2>&1
    echo "$side$r rc=$?"; grep -E "^\[W[1-5]|start-up:" "$OUT/ab_${side}${r}_log.txt" | cut -c1-200
  done
done
date -u +%H:%M:%S
