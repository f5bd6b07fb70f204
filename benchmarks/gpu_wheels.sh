#!/usr/bin/env bash
# Fill .whl/ (ignored by git: add "/.whl/" to .git/info/exclude) with the wheels the lent GPU machines
# lack for benchmarks/gpu_check.sh: Python 3.12 x86-64 builds of Ray (core only: its Java jars,
# dashboard front end and libraries (rllib, data, serve, tune, train, llm) removed, 79 MB -> 40 MB,
# so the working tree stays under the 64 MiB a call may carry), Hydra, OmegaConf and pydantic.
# Versions are this venv's, so both machines run the same ones.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/pip}
ver() { $PIP show "$1" 2>/dev/null | awk '/^Version:/{print $2}'; }
mkdir -p .whl /tmp/gpu_wheels
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
  -d /tmp/gpu_wheels "ray==$(ver ray)" "hydra-core==$(ver hydra-core)" "omegaconf==$(ver omegaconf)" \
  "pydantic==$(ver pydantic)" "pydantic-core==$(ver pydantic-core)" "annotated-types==$(ver annotated-types)" \
  "typing-inspection==$(ver typing-inspection)" "jsonschema==$(ver jsonschema)" \
  "jsonschema-specifications==$(ver jsonschema-specifications)" "referencing==$(ver referencing)" \
  "rpds-py==$(ver rpds-py)"
$PIP wheel -q --no-deps -w /tmp/gpu_wheels "antlr4-python3-runtime==$(ver antlr4-python3-runtime)"  # sdist only
for w in /tmp/gpu_wheels/*.whl; do
  case $(basename "$w") in ray-*) ;; *) cp "$w" .whl/ ;; esac
done
python3 - /tmp/gpu_wheels/ray-*.whl .whl <<'PY'
import os, sys, zipfile
src, out = sys.argv[1], sys.argv[2]
drop = ("ray/jars/", "ray/dashboard/client/build/", "ray/rllib/", "ray/data/", "ray/serve/", "ray/tune/",
        "ray/train/", "ray/llm/")
dst = os.path.join(out, os.path.basename(src))
with zipfile.ZipFile(src) as zi, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zo:
    for info in zi.infolist():  # ZipInfo keeps the executables' mode bits (raylet, gcs_server)
        if info.filename.startswith(drop):
            continue
        data = zi.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            data = "".join(line + "\n" for line in data.decode().splitlines() if not line.startswith(drop)).encode()
        zo.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
print(f"{dst}: {os.path.getsize(dst) / 1e6:.0f} MB")
PY
du -sh .whl
