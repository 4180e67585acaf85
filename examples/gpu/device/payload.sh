#!/bin/bash
# Builds what a device call carries (README.md beside this file): .whl/ours and .snap, from the repo root.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qx "/.snap/" .git/info/exclude 2>/dev/null || printf "/.snap/\n/.vl/\n" >> .git/info/exclude
mkdir -p .whl/ours
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl/ours gguf==0.19.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 typing_extensions==4.16.0
rm -rf .snap && mkdir .snap && git archive HEAD | tar -x -C .snap && git rev-parse --short HEAD > .snap/HEAD
du -sh .whl/ours .snap
