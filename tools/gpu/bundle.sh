#!/usr/bin/env bash
# Make the folders a GPU host without a package index (the lent device machines) needs to run
# tools/gpu/check.sh, each small enough to travel with one device call (64 MiB with the working tree):
#   .gpu-bundle/common    this project's and the plugins' wheels, and the pure-Python packages the host may lack
#   .gpu-bundle/nixl      nixl-cu13
#   .gpu-bundle/ucx       ucxx-cu13 and the UCX / RMM libraries it loads
#   .gpu-bundle/mooncake  the Mooncake engine (CUDA 13 build) without its store and expert-parallel libraries
#                         (the transport imports mooncake.engine only), and the shared libraries the engine
#                         links that a bare image lacks (taken from this host; used there only where missing)
# On the host, per call: `source tools/gpu/install_bundle.sh <nixl|ucx|mooncake>`, then tools/gpu/check.sh.
# Usage: tools/gpu/bundle.sh [PYTHON_VERSION]   (the host's Python, default 3.12). Needs pip and network here.
set -euo pipefail
pyver=${1:-3.12}
cd "$(dirname "$0")/../.."
root=$PWD
out=$root/.gpu-bundle
PY=${PY:-$root/.venv/bin/python}
rm -rf "$out"
mkdir -p "$out"/common "$out"/nixl "$out"/ucx "$out"/mooncake
platforms=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_26_x86_64 \
         manylinux_2_27_x86_64 manylinux_2_28_x86_64; do platforms+=(--platform "$p"); done
fetch() {  # fetch DEST SPEC...: wheels for the host's Python, without their dependencies
  local dest=$1; shift
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    "${platforms[@]}" -d "$dest" "$@"
}
for d in . transports/mooncake transports/ucx transports/nixl; do
  "$PY" -m pip wheel -q --no-deps "$d" -w "$out/common"
done
fetch "$out/common" "anyio>=4.6,<5" sniffio pyzmq "msgpack>=1.0.8,<2" trio outcome sortedcontainers attrs
fetch "$out/nixl" "nixl-cu13>=1.5.1,<2"
fetch "$out/ucx" "ucxx-cu13>=0.52" "libucxx-cu13==0.52.*" "rmm-cu13==26.10.*" "librmm-cu13==26.10.*" \
  "libucx-cu13>=1.19,<1.22" "rapids-logger==0.3.*"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fetch "$tmp" "mooncake-transfer-engine-cuda13>=0.3.14"
mkdir "$tmp/site"
(cd "$tmp/site" && unzip -q "$tmp"/mooncake_transfer_engine_cuda13-*.whl)
(cd "$tmp/site/mooncake" && rm -f _store*.so _ep*.so libmooncake_pg*.so libmooncake_ep_device.so \
  mooncake_client mooncake_master transfer_engine_bench)
tar -C "$tmp/site" -czf "$out/mooncake/site.tgz" .
# The engine's own links that the wheel does not carry, with libcurl's; glibc's own libraries stay behind.
lib=/usr/lib/x86_64-linux-gnu
mkdir "$tmp/libs"
for so in libibverbs.so.1 libmlx5.so.1 libnuma.so.1 libnl-3.so.200 libnl-route-3.so.200 libcurl.so.4; do
  cp -L "$lib/$so" "$tmp/libs/" || { echo "bundle.sh: $lib/$so missing here (apt-get install libibverbs1 libnuma1 libcurl4)" >&2; exit 1; }
done
ldd "$lib/libcurl.so.4" | awk '/=>/ {print $3}' \
  | grep -vE '/(libc|libm|libpthread|libdl|librt|ld-linux[^/]*)\.so' | xargs -r cp -L -t "$tmp/libs/"
tar -C "$tmp" -czf "$out/mooncake/libs.tgz" libs
du -sh "$out"/*
