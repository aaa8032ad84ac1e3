#!/usr/bin/env bash
# Install kvbus into a prefix: the image's install steps (the Dockerfile runs this script; the
# packaging tests run it into a temporary prefix, since the machines that test kvbus have no
# container daemon).
#
#   deploy/image/install.sh SOURCE PREFIX [EXTRAS]
#
# SOURCE  the repository's root (a wheel is built from a clean copy of it) or a built kvbus wheel
# PREFIX  where kvbus goes: a new virtual environment (PREFIX/bin/kvbus); must not exist yet
# EXTRAS  comma-separated role extras of pyproject.toml; default bridge,streams,sink,top,serve: every
#         long-running stage (kvbus bridge, worker, sink, serve) plus kvbus top and kvbus lookup.
#         `all` adds kvbus report (analytics: polars, matplotlib).
# PYTHON  the interpreter the environment is made from (default python3; 3.11 or later)
# pip's own settings apply (PIP_NO_CACHE_DIR, PIP_INDEX_URL, ...).
set -euo pipefail

DEFAULT_EXTRAS=bridge,streams,sink,top,serve
if [ $# -lt 2 ] || [ $# -gt 3 ]; then
  sed -n '2,/^set /{/^#/p}' "$0" >&2
  exit 2
fi
SOURCE=$1 PREFIX=$2 EXTRAS=${3:-$DEFAULT_EXTRAS}
PYTHON=${PYTHON:-python3}
log() { printf '[install] %s\n' "$*" >&2; }

if [ -e "$PREFIX" ]; then
  log "$PREFIX exists: give a new directory"
  exit 2
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

log "creating the environment $PREFIX with $("$PYTHON" --version 2>&1)"
"$PYTHON" -m venv "$PREFIX"
pip=("$PREFIX/bin/python" -m pip --disable-pip-version-check -q)

if [ -d "$SOURCE" ]; then
  # A clean copy: setuptools would carry a stale build/ of the source tree into the wheel.
  log "building the wheel from $SOURCE"
  mkdir "$work/src"
  tar -C "$SOURCE" --exclude=./.git --exclude=./.venv --exclude=./.infra --exclude=./build --exclude=./dist \
      --exclude='*.egg-info' --exclude=__pycache__ -cf - . | tar -C "$work/src" -xf -
  "${pip[@]}" wheel --no-deps -w "$work/wheel" "$work/src"
  wheel=$(ls "$work"/wheel/kvbus-*.whl)
else
  wheel=$SOURCE
fi

log "installing $(basename "$wheel") [$EXTRAS]"
"${pip[@]}" install "$wheel[$EXTRAS]"
"${pip[@]}" check
log "installed: $("$PREFIX/bin/kvbus" --version)"
