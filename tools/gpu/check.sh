#!/usr/bin/env bash
# The GPU checks, on a host with a CUDA device and the plugins installed with their CUDA builds
# (e.g. pip install -e '.[test,cli]' 'transports/nixl[cu13]' 'transports/ucx[cu13]' 'transports/mooncake[cuda13]'; on a host
# without a package index: tools/gpu/bundle.sh here, then `source tools/gpu/install_bundle.sh NAME` there).
# For each installed plugin: the shared CUDA suite (must pass, nothing skipped), then its race tests
# without the stream fences (they must fail); then a GPU-to-GPU bench line per plugin. Exits non-zero
# if any of that does not hold. Changes nothing.
set -u
PY=${PY:-python3}
case "$PY" in */*) PY=$(realpath "$PY") ;; *) PY=$(command -v "$PY") ;; esac
[ -x "$PY" ] || { echo "tools/gpu/check.sh: no Python interpreter at '${PY}'" >&2; exit 2; }
cd "$(dirname "$0")/../.." || exit 2
here=$PWD
"$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo "tools/gpu/check.sh: $PY sees no CUDA device (or has no torch); nothing to check" >&2; exit 1; }
failed=0
for plugin in ${PLUGINS:-nixl ucx mooncake}; do
  "$PY" -c "import aioembed_$plugin" 2>/dev/null || { echo "== $plugin: not installed, skipped"; continue; }
  echo "== $plugin: CudaSuite (must pass, none skipped)"
  out=$(cd "transports/$plugin" && "$PY" -m pytest tests/test_gpu.py -p no:cacheprovider -q -rA 2>&1)
  status=$?
  echo "$out" | grep -E "^(PASSED|FAILED|ERROR|SKIPPED) "; echo "$out" | tail -1
  if [ "$status" -ne 0 ] || echo "$out" | tail -1 | grep -q skipped; then echo "== $plugin: FAILED"; failed=1; fi
  echo "== $plugin: race tests without the stream fences (at least one must fail)"
  out=$(cd "transports/$plugin" && PYTHONPATH="$here/tools/gpu${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pytest \
    tests/test_gpu.py -p without_fences -p no:cacheprovider -q -rA \
    -k "producing_kernel or non_contiguous or released_lease or copy_into_out_waits" 2>&1)
  status=$?
  echo "$out" | grep -E "^(PASSED|FAILED|ERROR) " ; echo "$out" | tail -1
  if [ "$status" -eq 0 ]; then echo "== $plugin: the race tests passed without the fences: they catch nothing"; failed=1; fi
done
# GPU-to-GPU bench lines: NIXL against raw NIXL on the same GPU bytes; Mooncake and UCX have no raw GPU
# baseline yet, so their lines show aioembed alone (no ratio).
for plugin in ${PLUGINS:-nixl ucx mooncake}; do
  "$PY" -c "import aioembed_$plugin" 2>/dev/null || continue
  case $plugin in
    nixl) opts='{ write_timeout = 20.0 }'; sizes=${BENCH_SIZES:-8192,20000,100000} ;;
    ucx) opts='{ tls = "tcp,cuda_copy,cuda_ipc", host = "127.0.0.1" }'; sizes=${BENCH_SIZES:-20000,100000} ;;
    mooncake) opts='{ protocol = "tcp", hostname = "127.0.0.1" }'; sizes=${BENCH_SIZES:-20000,100000} ;;
  esac
  cfg=$(mktemp --suffix=.toml)
  printf '[aioembed]\ntransport = "%s"\ndevice = "cuda:0"\ntransport_options = %s\n' "$plugin" "$opts" > "$cfg"
  echo "== $plugin: GPU to GPU bench"
  "$PY" -m aioembed bench --config "$cfg" --workloads "${BENCH_WORKLOADS:-sizes,resume}" --sizes "$sizes" --repeat "${BENCH_REPEAT:-5}" \
    ${BENCH_JSON_DIR:+--json "$BENCH_JSON_DIR/bench-$plugin.json"} || failed=1
  rm -f "$cfg"
done
exit "$failed"
