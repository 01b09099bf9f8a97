#!/usr/bin/env bash
# Builds .gpu-kit/ (git-ignored) at the repository root: Ray 2.60.0 (ray[tune,train]) and torchao 0.18.0 for the
# lent H200 host (python 3.12, torch 2.11+cu130, no network, no Ray or torchao), slimmed to fit the device
# tool's 64 MiB per call beside the te-kit (shared/te-kit, copied to .te-kit/) and the tracked tree. Run it here
# (it downloads PyPI's cp312 wheels), then carry both: run(carry=[".te-kit", ".gpu-kit"], command="source
# .te-kit/install.sh || exit 1; source .gpu-kit/install.sh || exit 1; ..."). See install.sh for what each
# archive holds and smoke-sweep.yaml for a one-minute check on the GPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
kit=.gpu-kit
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pip=(python3 -m pip download -q --disable-pip-version-check --only-binary=:all: --python-version 3.12
     --platform manylinux2014_x86_64 --implementation cp --abi cp312 -d "$work/dl")
"${pip[@]}" --no-deps "ray==2.60.0" "torchao==0.18.0" \
    jsonschema jsonschema-specifications referencing rpds-py tensorboardx
mkdir -p "$work/ray" "$work/ao" "$kit/wheels"
rm -f "$kit"/*.tar.xz "$kit"/wheels/*.whl
python3 -m zipfile -e "$work"/dl/ray-2.60.0-*.whl "$work/ray"
python3 -m zipfile -e "$work"/dl/torchao-0.18.0-*.whl "$work/ao"
# not needed for tune/train on the host: Java jars, RLlib, Serve, the LLM library, the dashboard's web UI build
rm -rf "$work"/ray/ray/jars "$work"/ray/ray/rllib "$work"/ray/ray/serve "$work"/ray/ray/llm "$work"/ray/ray/dashboard/client
find "$work/ao/torchao" -name '_C*.so' -delete  # cutlass/mxfp8 kernels (Blackwell); float8 uses torch._scaled_mm
(cd "$work/ray" && find . -type f -exec sh -c 'head -c4 "$1" | grep -q ELF' _ {} \; -print) | sed 's|^\./||' > "$work/elf"
(cd "$work/ray" && xargs -a "$work/elf" -r strip --strip-unneeded 2>/dev/null || true)
# zipfile -e keeps no file modes: raylet, gcs_server and the other programs must be executable on the host
(cd "$work/ray" && xargs -a "$work/elf" -r chmod +x)
(cd "$work/ray" && tar -cf - -T "$work/elf" | xz -9 --x86 --lzma2=preset=9 > "$OLDPWD/$kit/ray-bin.tar.xz")
(cd "$work/ray" && find . -type f | sed 's|^\./||' | grep -vxF -f "$work/elf" | tar -cf - -T - | xz -9 > "$OLDPWD/$kit/ray-py.tar.xz")
(cd "$work/ao" && tar -cf - torchao torchao-0.18.0.dist-info | xz -9 > "$OLDPWD/$kit/torchao-0.18.0-slim.tar.xz")
mv "$work"/dl/jsonschema-*.whl "$work"/dl/jsonschema_specifications-*.whl "$work"/dl/referencing-*.whl \
   "$work"/dl/rpds_py-*.whl "$work"/dl/tensorboardx-*.whl "$kit/wheels/"
cp benchmarks/gpu_kit/install.sh benchmarks/gpu_kit/smoke-sweep.yaml "$kit/"
du -sh "$kit"
