#!/usr/bin/env bash
# Build the two wheels of Elastic Rollout into OUT (default: dist/ of the repository):
#
#   elastic_rollout-<v>-cp310-abi3-manylinux_2_<N>_<arch>.whl
#       the Python package, the native module elastic_rollout._native (rust/rollout-py), and the
#       binaries rollout-manager and sglang-sim in elastic_rollout/_bin/ (stripped of debug info),
#       with console scripts `rollout-manager` and `sglang-sim` (elastic_rollout._bin_entry) that
#       exec the packaged binary;
#   elastic_rollout_ray-<v>-py3-none-any.whl
#       the Ray shim (pure Python).
#
# Usage: deploy/build-wheels.sh [OUT]    (`make wheel` runs it after `cargo build --release`)
#   PROFILE=release|debug   which cargo build to package (target/$PROFILE/{rollout-manager,sglang-sim})
#                           and how maturin builds the native module; debug is for CI (no release
#                           build). The binaries must already be built: this script builds neither.
#   PYTHON                  an interpreter with maturin and pip (default .venv/bin/python)
#   TARGET                  e.g. x86_64-unknown-linux-gnu.2.28 or aarch64-unknown-linux-gnu.2.28: build
#                           for that architecture and glibc with zig (cargo-zigbuild for the binaries,
#                           `maturin --zig` for the native module), without Docker. In this mode the
#                           script builds the binaries itself, into target/<triple>/<profile>; PYTHON's
#                           environment needs `ziglang` and `cargo-zigbuild`, and rustup the target.
#                           `make wheel` uses it (glibc 2.28: RHEL/Rocky 8, Ubuntu 20.04, Debian 11 on).
#
# glibc: the binaries are plain Rust executables linked against the build machine's glibc; maturin
# audits only the native module. So the platform tag is computed here, from the newest GLIBC_x.y
# symbol version any of the two binaries needs (objdump -T), and passed to maturin as
# `--compatibility manylinux_2_y`; maturin then checks the native module against the same policy
# and fails if it needs more. The tag is thereby the glibc the wheel needs: built on Debian 12
# (glibc 2.36) the binaries need GLIBC_2.34, so the wheel is manylinux_2_34 (Ubuntu 22.04+,
# Debian 12+, RHEL 9+). With TARGET the binaries are linked against the glibc it names instead.
#
# Nothing in the checkout is changed: python/ and ray_integration/ are copied into a temp dir, the
# binaries go into the copy's _bin/ (so a checkout's find_binary never sees them), and the copy's
# pyproject.toml points maturin at the repository's rust/rollout-py (so cargo reuses target/).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${1:-$ROOT/dist}
PROFILE=${PROFILE:-release}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
TARGET=${TARGET:-}
BINS=(rollout-manager sglang-sim)

case $PROFILE in
  release) MATURIN_PROFILE=(--release) ;;
  debug) MATURIN_PROFILE=(--profile dev) ;;
  *) echo "error: PROFILE=$PROFILE: use release or debug" >&2; exit 2 ;;
esac
"$PYTHON" -m maturin --version >/dev/null 2>&1 || {
  echo "error: $PYTHON has no maturin; run 'make venv' or set PYTHON" >&2; exit 2; }
command -v readelf >/dev/null || { echo "error: readelf (binutils) is needed to read the glibc version" >&2; exit 2; }

BIN_DIR=$ROOT/target/$PROFILE
MATURIN_TARGET=()
if [[ -n $TARGET ]]; then
  TRIPLE=${TARGET%.2.*}
  [[ $TRIPLE =~ ^(x86_64|aarch64)-unknown-linux-gnu$ && $TARGET =~ \.2\.[0-9]+$ ]] || {
    echo "error: TARGET=$TARGET: use <x86_64|aarch64>-unknown-linux-gnu.2.<glibc minor>, e.g. x86_64-unknown-linux-gnu.2.28" >&2; exit 2; }
  # cargo-zigbuild and zig (the ziglang package) come from PYTHON's environment.
  export PATH="$(dirname "$PYTHON"):$PATH"
  command -v cargo-zigbuild >/dev/null && "$PYTHON" -m ziglang version >/dev/null 2>&1 || {
    echo "error: TARGET needs cargo-zigbuild and ziglang in $PYTHON's environment (make wheel installs them)" >&2; exit 2; }
  # Debug info is stripped by the link (the host's objcopy cannot read another architecture).
  CARGO_PROFILE_RELEASE_STRIP=debuginfo CARGO_PROFILE_DEV_STRIP=debuginfo \
    cargo zigbuild --target "$TARGET" $( [[ $PROFILE == release ]] && echo --release ) -p rollout-manager -p sglang-sim --bins
  BIN_DIR=$ROOT/target/$TRIPLE/$PROFILE
  MATURIN_TARGET=(--target "$TRIPLE" --zig)
fi

# The newest GLIBC_2.y any binary needs (manylinux starts at 2.17); readelf reads any architecture.
glibc_minor=17
for bin in "${BINS[@]}"; do
  path=$BIN_DIR/$bin
  [[ -x $path ]] || { echo "error: $path is missing; build it first (cargo build$( [[ $PROFILE == release ]] && echo ' --release') --workspace --bins)" >&2; exit 2; }
  need=$(readelf --dyn-syms -W "$path" | grep -o 'GLIBC_2\.[0-9]*' | sed 's/GLIBC_2\.//' | sort -n | tail -1)
  (( ${need:-0} > glibc_minor )) && glibc_minor=$need
done
TAG=manylinux_2_${glibc_minor}
echo "binaries need glibc 2.${glibc_minor}: platform tag ${TAG}"

STAGE=$(mktemp -d "${TMPDIR:-/tmp}/elastic-rollout-wheel.XXXXXX")
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$OUT" "$STAGE/python" "$STAGE/ray_integration"
# Earlier builds' wheels for this architecture go, so `pip install dist/elastic_rollout-*_<arch>.whl`
# names one file (a wheel for the other architecture stays).
ARCH=${TRIPLE:-$(uname -m)}
ARCH=${ARCH%%-*}
rm -f "$OUT"/elastic_rollout-*_"$ARCH".whl "$OUT"/elastic_rollout_ray-*.whl

cp "$ROOT/python/pyproject.toml" "$STAGE/python/"
cp -r "$ROOT/python/elastic_rollout" "$STAGE/python/"
rm -rf "$STAGE/python/elastic_rollout/_bin" "$STAGE/python/elastic_rollout/__pycache__" \
  "$STAGE"/python/elastic_rollout/_native*.so
mkdir "$STAGE/python/elastic_rollout/_bin"
for bin in "${BINS[@]}"; do
  # Debug info is most of a binary's size (a debug rollout-manager: ~200 MB -> ~40 MB); symbols stay.
  if [[ -n $TARGET ]]; then
    cp "$BIN_DIR/$bin" "$STAGE/python/elastic_rollout/_bin/$bin"  # stripped by its build above
  else
    objcopy --strip-debug "$BIN_DIR/$bin" "$STAGE/python/elastic_rollout/_bin/$bin"
  fi
  chmod 0755 "$STAGE/python/elastic_rollout/_bin/$bin"
done
sed -i "s#^manifest-path = .*#manifest-path = \"$ROOT/rust/rollout-py/Cargo.toml\"#" "$STAGE/python/pyproject.toml"
# The console scripts belong to the wheel. They are declared here, not in python/pyproject.toml,
# so the development venv (rebuilt by make whenever that file changes) is left alone; once the
# file declares [project.scripts] itself, this is skipped.
if ! grep -q '^\[project\.scripts\]' "$STAGE/python/pyproject.toml"; then
  cat >>"$STAGE/python/pyproject.toml" <<'EOF'

[project.scripts]
rollout-manager = "elastic_rollout._bin_entry:rollout_manager"
sglang-sim = "elastic_rollout._bin_entry:sglang_sim"
EOF
fi

(cd "$STAGE/python" && "$PYTHON" -m maturin build "${MATURIN_PROFILE[@]}" "${MATURIN_TARGET[@]}" --strip \
  --compatibility "$TAG" --interpreter "$PYTHON" --out "$OUT")

cp "$ROOT/ray_integration/pyproject.toml" "$STAGE/ray_integration/"
cp -r "$ROOT/ray_integration/elastic_rollout_ray" "$STAGE/ray_integration/"
rm -rf "$STAGE/ray_integration/elastic_rollout_ray/__pycache__"
# pip's usual isolated build with the declared backend (setuptools>=68, fetched from the package
# index or pip's cache: a venv's bundled setuptools 65 cannot build wheels without `wheel`).
"$PYTHON" -m pip wheel -q --no-deps "$STAGE/ray_integration" -w "$OUT"
ls -l "$OUT"/*.whl
