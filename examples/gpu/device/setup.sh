# Sourced on the device machine from the repo root: the carried wheels and .snap into /tmp/ours (README.md).
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ours \
  .whl/ours/*.whl 2>&1 | grep -v WARN
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target /tmp/ours \
  ./.snap 2>&1 | grep -v WARN
export PYTHONPATH=/tmp/ours
python3 -c "import pagedllm" || return 3 2>/dev/null || exit 3
echo "pagedllm $(cat .snap/HEAD 2>/dev/null) in /tmp/ours"
nvidia-smi --query-gpu=name,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader
