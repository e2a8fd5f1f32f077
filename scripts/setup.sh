#!/usr/bin/env bash
# Set up a cleanroom development machine (Debian 12): the host packages the qemu and gvisor
# drivers and the baseline builder need, and a .venv with cleanroom installed in editable mode
# with its dev extras.
# Idempotent and non-interactive: a second run checks and does nothing heavy.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export DEBIAN_FRONTEND=noninteractive

APT_PACKAGES=(
  qemu-system-x86 mmdebstrap erofs-utils busybox-static cpio lz4 util-linux python3-venv
  ca-certificates
  gcc libc6-dev  # the native guest agent (agent/native), built into baselines and for the fake driver
  clang libclang-rt-14-dev  # make fuzz-native: libFuzzer, ASan, UBSan over agent/native's reader
  runsc  # gVisor, for --driver gvisor (a user-space kernel sandbox: no VM, no KVM needed)
  skopeo  # container images as baselines: docker:// pulls and archive conversions
  buildah  # [base] dockerfile = ...: daemonless image builds (RUN isolated by chroot)
  musl-tools  # the musl-only and distroless test images (a program linked by musl-gcc)
  docker-registry  # a real registry on 127.0.0.1 for the image tests
  chromium  # headless, renders the HTML run report in tests/observe and for docs/*.png
  nodejs  # node + npm (this repack bundles npm): tests/server/test_js.py, E2B's JS SDK vs `cleanroom serve`
)
VENV="$ROOT/.venv"
STAMP="$VENV/.cleanroom-install-stamp"
PYTHON="${PYTHON:-python3}"

say() { printf 'setup: %s\n' "$*"; }
die() { printf 'setup: error: %s\n' "$*" >&2; exit 1; }

# --- apt packages -------------------------------------------------------------------------------
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  status="$(dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null || true)"
  [[ "$status" == "installed" ]] || missing+=("$pkg")
done
if ((${#missing[@]})); then
  if [[ "$(id -u)" -eq 0 ]]; then
    SUDO=()
  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO=(sudo -n)
  else
    die "missing apt packages (${missing[*]}): run as root, or as a user with passwordless sudo"
  fi
  say "installing apt packages: ${missing[*]}"
  "${SUDO[@]}" apt-get update -qq </dev/null
  "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" </dev/null >/dev/null
else
  say "apt packages present"
fi

# Debian's own nodejs comes without npm (nodesource's repack bundles it): the JS SDK test needs it
if ! command -v npm >/dev/null 2>&1; then
  say "installing npm"
  "${SUDO[@]+"${SUDO[@]}"}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    --no-install-recommends npm </dev/null >/dev/null || say "npm not installed: tests/server/test_js.py will fail"
fi

# --- python -------------------------------------------------------------------------------------
command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found on PATH (need Python >= 3.11)"
pyver="$("$PYTHON" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null || true)"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
  || die "$PYTHON is Python ${pyver:-of unknown version}: need Python >= 3.11"

if [[ ! -x "$VENV/bin/python" ]] || ! "$VENV/bin/python" -c 'import sys' 2>/dev/null; then
  say "creating $VENV"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV" </dev/null || die "python3 -m venv failed (is python3-venv installed?)"
  rm -f "$STAMP"
else
  say "venv present"
fi

want="$(sha256sum pyproject.toml | cut -d' ' -f1) $("$VENV/bin/python" -c 'import sys; print(sys.version.split()[0])')"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]] \
  && "$VENV/bin/python" -c 'import cleanroom' 2>/dev/null; then
  say "cleanroom[dev] install current"
else
  say "pip install -e '.[dev]' (quiet)"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-input \
    -e '.[dev]' </dev/null
  printf '%s\n' "$want" >"$STAMP"
fi
say "ready: $VENV"
