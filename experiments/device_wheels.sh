# Sourced by the scripts that carry Python packages to the GPU machine (Python 3.12,
# manylinux x86_64, no network): experiments/device_prepare.sh and
# scripts/gpu_tests_prepare.sh download with the first function here, on this machine;
# experiments/device_env.sh and scripts/gpu_tests.sh install with the second, there.
#
#   device_wheels_download DIR NAME...   each NAME as NAME==VERSION, or at the version that
#                                        $PY (default python3) has installed; no dependencies
#   device_wheels_install DIR TARGET     DIR/*.whl into TARGET (for PYTHONPATH), once per
#                                        machine (TARGET/.prism-installed marks it done)
DEVICE_WHEEL_PLATFORM=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
                       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

device_wheels_download() {
  local dir="$1" name spec
  shift
  mkdir -p "$dir"
  for name in "$@"; do
    spec="$name"
    if [[ "$name" != *==* ]]; then
      spec="$name==$("${PY:-python3}" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$name")" \
        || { echo "device_wheels_download: $name is not installed for ${PY:-python3}: name its version" >&2; return 1; }
    fi
    "${PY:-python3}" -m pip download -q --no-deps --only-binary=:all: "${DEVICE_WHEEL_PLATFORM[@]}" -d "$dir" "$spec" \
      || { echo "device_wheels_download: no Python 3.12 manylinux wheel of $spec" >&2; return 1; }
  done
}

device_wheels_install() {
  local dir="$1" target="$2"
  # once per machine: a job started beside another reuses the installed wheels instead of
  # rewriting what the other one reads
  [ -f "$target/.prism-installed" ] && return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" \
    "$dir"/*.whl && touch "$target/.prism-installed"
}
