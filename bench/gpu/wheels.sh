#!/usr/bin/env bash
# Download the wheels the GPU check carries (carry.txt), each at the version installed in this
# environment (the one the tests ran with), built for the GPU machine's Python 3.12 on x86-64 Linux,
# into bench/gpu/wheels (ignored by git; about 12 MB). Needs a package index; run from anywhere.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
rm -rf wheels && mkdir -p wheels
for name in $(grep -v '^#' carry.txt | grep -v '^\s*$'); do
  version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d wheels "$name==$version"
done
ls -l wheels
