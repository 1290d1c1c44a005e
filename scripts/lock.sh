#!/usr/bin/env bash
# Refresh constraints.txt, the lock of everything the README's test command (and so .ci/run) installs.
#
# It resolves afresh: a new virtual environment, torch's pinned CPU wheel, then the package with its
# test and ray extras at the newest versions pyproject.toml's ranges allow today, and freezes the
# result (every package, transitive ones included, at its exact version). Commit the new file only
# after the README's test command passes with it.
#
#   bash scripts/lock.sh           # everything at today's newest versions
#   bash scripts/lock.sh --keep    # a dependency added: the locked versions stay, only new packages resolve
set -euo pipefail
cd "$(dirname "$0")/.."
keep=()
if [ "${1:-}" = --keep ]; then keep=(-c constraints.txt); fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
pip="$work/venv/bin/pip"
"$pip" install -q torch==2.13.0 uv
"$pip" install -q -e '.[test,ray]' "${keep[@]}"
{
    echo "# The lock of the README's test command: pip and uv install the test toolchain with -c constraints.txt."
    echo "# Made by 'bash scripts/lock.sh' ($("$work/venv/bin/python" -c 'import sys; print("Python %d.%d" % sys.version_info[:2])'), $(uname -m)); do not edit by hand."
    "$pip" freeze --exclude-editable --all | grep -v -E '^(pip|setuptools|wheel)==' | LC_ALL=C sort -f
} > constraints.txt.new
mv constraints.txt.new constraints.txt
echo "constraints.txt: $(grep -c '==' constraints.txt) packages"
