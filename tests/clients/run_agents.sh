#!/usr/bin/env bash
# Runs the real-client agent tests through condense on a fresh machine:
# installs the pinned agents from their lockfiles (Claude Code in
# claude_code/, Codex CLI in codex/, opencode in opencode/), then runs
# test_claude_code.py, test_codex.py, test_codex_websocket.py (Codex on its
# Responses WebSocket transport), test_opencode.py and test_agents_sdk.py
# (the OpenAI Agents SDK, pinned in requirements.txt) with
# REQUIRE_CLIENT_AGENTS=1, so a missing piece fails instead of skipping.
# Arguments go to pytest.
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

# Claude Code's postinstall links its native binary for this platform over
# bin/claude.exe (package.json's allowScripts lets npm run it). Codex is a
# small launcher whose native binary comes in the platform's optional
# dependency (@openai/codex-linux-x64 and the like), which npm ci installs
# from the lockfile with no install script.
for agent in claude_code:claude codex:codex; do
  dir="${agent%%:*}" bin="${agent##*:}"
  (cd "$here/$dir" && npm ci --no-audit --no-fund --loglevel=error)
  "$here/$dir/node_modules/.bin/$bin" --version
done
# opencode-ai is a launcher too: its postinstall links the platform's binary
# (opencode-linux-x64 and the like, optional dependencies) over
# bin/opencode.exe. The registry this project reaches lacks most of those
# platform packages (no darwin, no arm64 at this version), so the lockfile
# holds only the ones it has, and npm ci refuses a lockfile without every
# optional dependency: npm install --no-save installs the locked versions
# (integrity checked) and skips the rest, leaving the lockfile as it is.
(cd "$here/opencode" && npm install --no-save --no-audit --no-fund --loglevel=error)
"$here/opencode/node_modules/.bin/opencode" --version

python="${PYTHON:-}"
if [ -z "$python" ]; then
  venv="$root/target/ci-venv"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$here/requirements.txt"
  python="$venv/bin/python"
fi

export CONDENSE_BIN="${CONDENSE_BIN:-$root/target/debug/condense}"
cd "$here"
REQUIRE_CLIENT_AGENTS=1 "$python" -m pytest -q -p no:cacheprovider \
  test_claude_code.py test_codex.py test_codex_websocket.py test_opencode.py test_agents_sdk.py "$@"
