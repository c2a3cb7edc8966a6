#!/usr/bin/env bash
# A fresh virtual environment installs `kafka-llm-worker[gateway]` from this checkout and runs what a gateway
# user runs first: `llm-worker gateway --help`, and imports of the client and the gateway. Packages come from
# the wheelhouse that `make compose-check` fills when it is there (torch alone is gigabytes), else from PyPI.
# Not part of `make test`: an install from PyPI takes minutes. Safe to run twice; it leaves nothing behind.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
work=$(mktemp -d -t packaging-check-XXXXXX)
trap 'rm -rf "$work"' EXIT
wheelhouse="${WHEELHOUSE:-$HOME/.cache/kafka-llm-worker/wheelhouse}"
start=$(date +%s)
echo "1. a fresh venv in $work (python: $(python3 --version))"
python3 -m venv "$work/venv"
pip=("$work/venv/bin/pip" install -q --disable-pip-version-check)
if [ -d "$wheelhouse" ] && "${pip[@]}" --no-index --find-links "$wheelhouse" ".[gateway]" 2>"$work/pip.err"; then
  echo "2. installed .[gateway] from the wheelhouse $wheelhouse alone"
else
  [ -d "$wheelhouse" ] && echo "2. the wheelhouse lacks something ($(tail -1 "$work/pip.err")); installing from PyPI"
  "${pip[@]}" ".[gateway]"
  echo "2. installed .[gateway] from PyPI"
fi
"$work/venv/bin/llm-worker" gateway --help >/dev/null
echo "3. llm-worker gateway --help: ok"
"$work/venv/bin/llm-worker" gateway keys --help >/dev/null
echo "4. llm-worker gateway keys --help: ok"
"$work/venv/bin/python" -c "import llm_client, gateway.app, gateway.cli"
echo "5. import llm_client, gateway.app, gateway.cli: ok"
echo "packaging check passed in $(( $(date +%s) - start )) s"
