#!/usr/bin/env bash
# Regenerates requirements_lock.txt (read by MODULE.bazel's pip.parse) from
# setup.py: install_requires plus the [test] and [examples] extras, every
# package pinned with its hashes, resolved for this machine's python3
# (the lock is for CPython 3.11 on Linux, the version MODULE.bazel's
# hermetic toolchain uses). Needs the package index; pip-tools is installed
# into a throwaway venv, not into the project's.
#
#   bazel/update_requirements_lock.sh          # from any directory
set -euo pipefail
cd "$(dirname "$0")/.."
tools=$(mktemp -d)
trap 'rm -rf "$tools"' EXIT
python3 -m venv "$tools/venv"
"$tools/venv/bin/pip" install -q "pip-tools>=7.4"
# This machine's pip configuration (extra indexes, local wheel folders) must
# not leak into a lock meant for every user: resolve against the index alone.
PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= PIP_EXTRA_INDEX_URL= \
  CUSTOM_COMPILE_COMMAND="bazel/update_requirements_lock.sh" \
  "$tools/venv/bin/pip-compile" --quiet --no-emit-index-url \
  --no-emit-find-links --generate-hashes \
  --allow-unsafe --strip-extras --extra=test --extra=examples \
  --output-file=requirements_lock.txt setup.py
