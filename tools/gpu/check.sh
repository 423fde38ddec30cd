#!/usr/bin/env bash
# The GPU checks, on a host with a CUDA device and the plugins installed with their CUDA builds
# (e.g. pip install -e '.[test]' 'transports/nixl[cu13]' 'transports/ucx[cu13]' 'transports/mooncake[cuda13]').
# For each installed plugin: the shared CUDA suite, then its race tests without the stream fences (they
# must FAIL), then a GPU-to-GPU bench line. Output goes to stdout; nothing is changed.
set -u
cd "$(dirname "$0")/../.."
PY=$(command -v "${PY:-python3}" || realpath "${PY:-python3}")
here=$PWD
"$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo "tools/gpu/check.sh: this host has no CUDA device; nothing to check" >&2; exit 1; }
for plugin in nixl ucx mooncake; do
  "$PY" -c "import aioembed_$plugin" 2>/dev/null || { echo "== $plugin: not installed, skipped"; continue; }
  echo "== $plugin: CudaSuite"
  (cd "transports/$plugin" && "$PY" -m pytest tests/test_gpu.py -p no:cacheprovider -q -rA 2>&1 | tail -12)
  echo "== $plugin: race tests without the stream fences (expected to fail)"
  (cd "transports/$plugin" && PYTHONPATH="$here/tools/gpu${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pytest tests/test_gpu.py \
    -p without_fences -p no:cacheprovider -q -rA -k "producing_kernel or non_contiguous or released_lease" 2>&1 | tail -6)
done
if "$PY" -c "import aioembed_nixl" 2>/dev/null; then
  cfg=$(mktemp --suffix=.toml)
  printf '[aioembed]\ntransport = "nixl"\ndevice = "cuda:0"\n' > "$cfg"
  echo "== nixl: GPU to GPU bench (raw NIXL moves the same GPU bytes)"
  "$PY" -m aioembed bench --config "$cfg" --workloads sizes,resume --sizes 8192,20000,100000 --repeat 5
  rm -f "$cfg"
fi
