#!/usr/bin/env bash
# Runs the real-client agent tests of the Responses API through condense on
# a fresh machine: installs the pinned Codex CLI from codex/package-lock.json
# with npm ci, then runs test_codex.py and test_agents_sdk.py (the OpenAI
# Agents SDK, pinned in requirements.txt) with REQUIRE_CLIENT_AGENTS=1, so a
# missing piece fails instead of skipping.
#
# Needs node and npm on PATH, and a built condense (CONDENSE_BIN, default
# target/debug/condense). PYTHON is a Python with the packages of
# requirements.txt (default: the CI venv target/ci-venv, made if missing).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"

command -v node >/dev/null || { echo "node is required (20 or later)"; exit 1; }
command -v npm >/dev/null || { echo "npm is required"; exit 1; }
echo "node $(node --version), npm $(npm --version)"

# @openai/codex is a small launcher; its native binary comes in the
# platform's optional dependency (@openai/codex-linux-x64 and the like,
# aliases of @openai/codex@<version>-<platform>), which npm ci installs
# from the lockfile with no install script.
(cd "$here/codex" && npm ci --no-audit --no-fund --loglevel=error)
"$here/codex/node_modules/.bin/codex" --version

python="${PYTHON:-}"
if [ -z "$python" ]; then
  venv="$root/target/ci-venv"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$here/requirements.txt"
  python="$venv/bin/python"
fi

export CONDENSE_BIN="${CONDENSE_BIN:-$root/target/debug/condense}"
cd "$here"
REQUIRE_CLIENT_AGENTS=1 "$python" -m pytest -q -p no:cacheprovider test_codex.py test_agents_sdk.py "$@"
