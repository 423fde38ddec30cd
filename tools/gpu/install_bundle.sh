# Install .gpu-bundle/common and .gpu-bundle/<name> (made by tools/gpu/bundle.sh) on a host without a package
# index, into /tmp/site-<name>, and export what the checks need (PYTHONPATH, LD_LIBRARY_PATH). To be sourced:
#   source tools/gpu/install_bundle.sh <nixl|ucx|mooncake> && tools/gpu/check.sh
# A device call carries .gpu-bundle/common, .gpu-bundle/<name> and this checkout. Returns non-zero if the
# plugin does not load afterwards.
name=${1:?usage: source tools/gpu/install_bundle.sh <nixl|ucx|mooncake>}
bundle=.gpu-bundle
site=/tmp/site-$name
libs=/tmp/site-$name-libs
rm -rf "$site" "$libs"
mkdir -p "$site" "$libs"
shopt -s nullglob
wheels=("$bundle"/common/*.whl "$bundle/$name"/*.whl)
shopt -u nullglob
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "${wheels[@]}" \
  || return 1
if [ -f "$bundle/$name/site.tgz" ]; then tar -C "$site" -xzf "$bundle/$name/site.tgz" || return 1; fi
if [ -f "$bundle/$name/libs.tgz" ]; then
  tar -C "$libs" -xzf "$bundle/$name/libs.tgz" || return 1
  for so in "$libs"/libs/*; do  # only what the image lacks: its own libraries win
    ldconfig -p | grep -q " $(basename "$so") " || ln -s "$so" "$libs/"
  done
fi
# The CUDA runtime the engines link (torch's wheels carry it; not on the loader's path by default).
cudart=$(find /opt /usr/local -name 'libcudart.so.13*' 2>/dev/null | head -1)
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
export LD_LIBRARY_PATH=$libs${cudart:+:$(dirname "$cudart")}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PYTHONUNBUFFERED=1 UCX_WARN_UNUSED_ENV_VARS=n PLUGINS=$name  # check.sh: this plugin only
python3 -c "import aioembed_$name; from aioembed.transports.registry import resolve_transport as r; \
print('$name:', r('$name').capabilities)"
