#!/usr/bin/env bash
# The wheels `scute serve` needs that the H200 machine's image lacks (fastapi and what it needs but the image
# has), built for its Python 3.12, downloaded into .whl/ (ignored by git, 3 MB): `bash bench/run_gpu.sh serving`
# installs them there when the device call carries .whl (the device tool's `carry`). Versions: those the
# project's CPU environment (.venv, `make setup`) installs. Run from anywhere: bash bench/gpu_wheels.sh
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
pins=$("$PY" -m pip list --format=freeze 2>/dev/null | grep -i -E \
  '^(fastapi|starlette|pydantic|pydantic[-_]core|uvicorn|annotated[-_]types|annotated[-_]doc|typing[-_]inspection)==')
platforms=""
for n in 2_28 2_27 2_24 2_17 2014 1; do
  case $n in 2014|1) platforms="$platforms --platform manylinux${n}_x86_64" ;;
             *) platforms="$platforms --platform manylinux_${n}_x86_64" ;; esac
done
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $platforms -d .whl $pins \
  2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
ls .whl
