#!/usr/bin/env bash
# A Python for Harbor (PyPI `harbor` needs Python >= 3.12; Debian 12 ships 3.11), built the way
# pyenv builds from source, and a venv with harbor==0.25.* and this checkout (`cleanroom[harbor]`).
#
# 1. CPython 3.13 from Debian's source package for the current stable suite: a private deb-src
#    entry made from this machine's own Debian archive URIs (nothing in /etc/apt is changed),
#    `apt-get source python3.13`, `./configure --prefix=$PREFIX && make && make install`.
#    About 5 minutes on 2 cores, once: a second call finds it built and does nothing.
# 2. $VENV with `pip install -e '.[harbor]'`, refreshed when pyproject.toml (or the checkout) changes.
#
# Called by the Harbor test fixture and by `make test`; never by plain `make setup`.
# Prints the venv's python path as its last line of stdout. Progress goes to stderr.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${CLEANROOM_HARBOR_CACHE:-$HOME/.cache/cleanroom}"
PREFIX="$CACHE/python3.13"
VENV="$CACHE/harbor-venv"
SRC_PACKAGE=python3.13
SUITE=stable
DEV_PACKAGES=(
  build-essential dpkg-dev libssl-dev libsqlite3-dev liblzma-dev zlib1g-dev libffi-dev
  libbz2-dev libreadline-dev libncurses-dev uuid-dev
)
export DEBIAN_FRONTEND=noninteractive

say() { printf 'harbor-python: %s\n' "$*" >&2; }
die() { printf 'harbor-python: error: %s\n' "$*" >&2; exit 1; }

python_ok() {
  [[ -x "$PREFIX/bin/python3.13" ]] &&
    "$PREFIX/bin/python3.13" -c 'import ssl, sqlite3, lzma, bz2, zlib, ctypes, venv' 2>/dev/null
}

# The machine's Debian archive URIs (deb822 .sources and one-line sources.list), security excluded.
debian_uris() {
  {
    cat /etc/apt/sources.list.d/*.sources 2>/dev/null | sed -n 's/^URIs:[[:space:]]*//p' | tr ' ' '\n' || true
    cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null |
      sed -n 's/^deb\(-src\)\?[[:space:]]\+\(\[[^]]*\][[:space:]]\+\)\?\([^[:space:]]\+\).*/\3/p'
  } | grep -v -e '-security' -e '^$' | grep -i debian | sort -u || true
}

install_dev_packages() {
  local missing=() pkg status
  for pkg in "${DEV_PACKAGES[@]}"; do
    status="$(dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null || true)"
    [[ "$status" == "installed" ]] || missing+=("$pkg")
  done
  ((${#missing[@]})) || return 0
  [[ "$(id -u)" -eq 0 ]] || die "missing build packages (${missing[*]}): run as root"
  say "installing build packages: ${missing[*]}"
  apt-get update -qq </dev/null
  apt-get install -y -qq --no-install-recommends "${missing[@]}" </dev/null >/dev/null
}

build_python() {
  install_dev_packages
  local uris work apt_dir
  uris="$(debian_uris | tr '\n' ' ')"
  [[ -n "${uris// /}" ]] || die "no Debian archive URI in /etc/apt/sources.list*: cannot fetch $SRC_PACKAGE"
  mkdir -p "$CACHE"
  work="$(mktemp -d "$CACHE/python-build.XXXXXX")"
  trap 'rm -rf "$work"' EXIT
  apt_dir="$work/apt"
  mkdir -p "$apt_dir/sources.list.d" "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial"
  cat >"$apt_dir/sources.list.d/deb-src.sources" <<EOF
Types: deb-src
URIs: $uris
Suites: $SUITE
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  # A private apt state: the system's sources, lists and cache stay as they are.
  local apt_opts=(
    -o "Dir::Etc::SourceList=/dev/null" -o "Dir::Etc::SourceParts=$apt_dir/sources.list.d"
    -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache"
    -o "APT::Sandbox::User=root"
  )
  say "[1/4] apt-get update (deb-src $SUITE from the machine's Debian archive)"
  apt-get "${apt_opts[@]}" update -qq </dev/null >&2
  say "[2/4] apt-get source $SRC_PACKAGE"
  (cd "$work" && apt-get "${apt_opts[@]}" source -qq "$SRC_PACKAGE" </dev/null >&2)
  local srcdir
  srcdir="$(find "$work" -mindepth 1 -maxdepth 1 -type d -name "$SRC_PACKAGE-*" | head -n1)"
  [[ -n "$srcdir" && -x "$srcdir/configure" ]] || die "apt-get source $SRC_PACKAGE left no source tree"
  say "[3/4] ./configure --prefix=$PREFIX ($(basename "$srcdir"))"
  # Debian's ensurepip refuses the base install (ensurepip-disabled.diff); venvs still get pip.
  (cd "$srcdir" && nice ./configure --prefix="$PREFIX" --with-ensurepip=no \
    >"$work/configure.log" 2>&1) || { tail -n 30 "$work/configure.log" >&2; die "configure failed"; }
  say "[4/4] make -j$(nproc) && make install (about 5 minutes on 2 cores)"
  rm -rf "$PREFIX"
  (cd "$srcdir" && nice make -j"$(nproc)" >"$work/make.log" 2>&1 && make install \
    >"$work/install.log" 2>&1) || { tail -n 30 "$work/make.log" "$work/install.log" >&2; die "build failed"; }
  python_ok || die "the built $PREFIX/bin/python3.13 lacks ssl/sqlite3/lzma/bz2/zlib/ctypes"
  rm -rf "$work"
  trap - EXIT
}

if python_ok; then
  say "python present: $("$PREFIX/bin/python3.13" -V 2>&1) at $PREFIX"
else
  say "building CPython 3.13 into $PREFIX"
  build_python
  say "built $("$PREFIX/bin/python3.13" -V 2>&1)"
fi

STAMP="$VENV/.cleanroom-install-stamp"
if [[ ! -x "$VENV/bin/python" ]] || ! "$VENV/bin/python" -c 'import sys' 2>/dev/null; then
  say "creating $VENV"
  rm -rf "$VENV"
  "$PREFIX/bin/python3.13" -m venv "$VENV" </dev/null
  rm -f "$STAMP"
fi
want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1) $ROOT"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]] &&
  "$VENV/bin/python" -c 'import harbor, cleanroom' 2>/dev/null; then
  say "harbor venv current: $VENV"
else
  say "pip install -e '$ROOT[harbor]' into $VENV (quiet)"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-input \
    -e "$ROOT[harbor]" </dev/null >&2
  printf '%s\n' "$want" >"$STAMP"
fi
printf '%s\n' "$VENV/bin/python"
