#!/usr/bin/env bash
# gpu-kit: Ray 2.60.0 (ray[tune,train], slimmed) and torchao 0.18.0 for the offline H200 host
# (python 3.12, torch 2.11+cu130; no network). Installs into TARGET (default /tmp/gpu-site) and
# APPENDS it to PYTHONPATH, so it composes with the te-kit (which puts /tmp/te-site first):
#
#   source .te-kit/install.sh || exit 1; source .gpu-kit/install.sh || exit 1; <your command>
#
# Contents (benchmarks/gpu_kit/build.sh makes them from PyPI's wheels):
#   ray-bin.tar.xz   the ELF files of ray-2.60.0-cp312 manylinux2014 (raylet, gcs_server, _raylet.so, ...),
#                    symbols stripped (strip --strip-unneeded), xz with the x86 BCJ filter
#   ray-py.tar.xz    the rest of ray + its dist-info, without jars/ (Java), rllib/, serve/, llm/ and
#                    dashboard/client/ (the web UI build); ray.data stays (ray.air imports it)
#   torchao-0.18.0-slim.tar.xz  torchao's abi3 wheel without its _C*.so (cutlass/mxfp8 kernels: Blackwell
#                    MX paths; float8 training and FP8 serving go through torch._scaled_mm)
#   wheels/          Ray's pure deps the host lacks: jsonschema (+specifications, referencing, rpds-py),
#                    tensorboardX. pydantic (ray.train.v2 needs it) comes from the te-kit's wheels/ when
#                    the te-kit is not already on PYTHONPATH (place it beside this kit as .te-kit/).
# Re-running is cheap (a stamp skips a finished install); GPU_KIT_FORCE=1 reinstalls;
# GPU_KIT_CHECK=1 also imports ray, ray.tune, ray.train and torchao.

_gpu_kit_install() (
  set -euo pipefail
  KIT=$1; TARGET=$2; PY=${PYTHON:-python3}
  say() { echo "gpu-kit: $*" >&2; }
  die() { echo "gpu-kit: ERROR: $*" >&2; exit 1; }
  v=$("$PY" -c 'import sys; print(f"{sys.version_info.major}.{sys.version_info.minor}")')
  [ "$v" = 3.12 ] || die "python here is $v; Ray's binaries in this kit are cp312"
  [ "$(uname -m)" = x86_64 ] || die "this kit is x86_64 only (here: $(uname -m))"
  stamp=$( (cd "$KIT" && ls -l *.tar.xz wheels | awk '{print $5, $9}') | cksum | cut -d' ' -f1)
  if [ "${GPU_KIT_FORCE:-0}" != 1 ] && [ -f "$TARGET/.gpu-kit-stamp" ] && [ "$(cat "$TARGET/.gpu-kit-stamp")" = "$stamp" ]; then
    say "already installed in $TARGET"; exit 0
  fi
  t0=$(date +%s)
  rm -rf "$TARGET"; mkdir -p "$TARGET"
  for a in "$KIT"/*.tar.xz; do xz -dc "$a" | tar -C "$TARGET" -xf - & done
  wait
  whls=("$KIT"/wheels/*.whl)
  # pydantic: only when it is not importable already (the te-kit's /tmp/te-site holds the same version)
  if ! "$PY" -c 'import pydantic' 2>/dev/null; then
    p=$(ls "$KIT"/wheels/pydantic-[0-9]*.whl "$KIT"/../.te-kit/wheels/pydantic-[0-9]*.whl 2>/dev/null | head -1 || true)
    [ -n "$p" ] || die "pydantic is not importable and no pydantic wheel is in $KIT/wheels or $KIT/../.te-kit/wheels (carry .te-kit too)"
    d=$(dirname "$p")
    for w in "$d"/pydantic-[0-9]*.whl "$d"/pydantic_core-*.whl "$d"/annotated_types-*.whl "$d"/typing_inspection-*.whl; do
      [ -f "$w" ] && whls+=("$w")
    done
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
      --target "$TARGET" "${whls[@]}" 2>&1 | grep -v -i "warning: target directory\|root user" >&2 || true
  [ -x "$TARGET/ray/core/src/ray/raylet/raylet" ] || die "ray's raylet missing in $TARGET after unpacking"
  [ -f "$TARGET/torchao/__init__.py" ] || die "torchao missing in $TARGET after unpacking"
  [ -d "$TARGET/jsonschema" ] || die "pip install of wheels/ into $TARGET failed"
  echo "$stamp" > "$TARGET/.gpu-kit-stamp"
  say "installed into $TARGET in $(( $(date +%s) - t0 )) s"
)

_gpu_kit_main() {
  local kit target
  kit=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
  target=${1:-/tmp/gpu-site}
  _gpu_kit_install "$kit" "$target" || return 1
  # append (the te-kit's folder stays first); no duplicate when sourced twice
  case ":${PYTHONPATH:-}:" in *":$target:"*) ;; *) export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$target" ;; esac
  if [ "${GPU_KIT_CHECK:-0}" = 1 ]; then
    ${PYTHON:-python3} -c 'import ray, ray.tune, ray.train, torchao; print("gpu-kit: import OK, ray", ray.__version__, "torchao", torchao.__version__)' || return 1
  fi
  echo "gpu-kit: PYTHONPATH=$PYTHONPATH" >&2
}

if (return 0 2>/dev/null); then
  _gpu_kit_main "$@"
else
  _gpu_kit_main "$@" || exit 1
fi
