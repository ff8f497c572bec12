"""Codex, the real CLI pinned in codex/package.json, run non-interactively
(`codex exec`) through condense against a scripted mock Responses upstream
(codex/scripted_agent.py): 20 shell commands with large outputs, then a
final answer. condense's window for gpt models is set so the conversation
must be compacted after about ten turns.

Codex is pointed at condense with a custom model provider in
$CODEX_HOME/config.toml (wire_api "responses", the key from an environment
variable); HOME and CODEX_HOME are in a temp dir. Everything stays on
127.0.0.1: update checks, analytics, feedback and the plugin and app
features (which sync from GitHub and chatgpt.com) are off, web search is
disabled, and any other connection goes to a dead proxy.

What Codex 0.169.0 sends (codex exec, custom provider, wire_api
"responses"): POST /v1/responses only, nothing else (no /v1/models), with
stream true, store false, include ["reasoning.encrypted_content"],
reasoning {"effort": ...}, text {"verbosity": ...}, parallel_tool_calls,
prompt_cache_key (the session id, the same all run), client_metadata, and
no previous_response_id and no `instructions`: its system prompt is a
developer message at the head of `input`, followed by a second developer
message (skills), a user message with the environment context and the
task. Every turn resends the whole conversation: reasoning items (with
encrypted_content, plus "content": null), assistant messages, function_call
(exec_command) and function_call_output items, all with ids. Tools:
function tools (exec_command, write_stdin, ...), a custom tool
(apply_patch) and tool_search. Headers: authorization Bearer <env_key's
value>, originator codex_exec, user-agent codex_exec/<version>, session-id,
thread-id, x-client-request-id, x-codex-window-id, x-codex-turn-metadata,
x-codex-beta-features, accept text/event-stream.

Skipped when node or the npm package is missing, unless
REQUIRE_CLIENT_AGENTS=1 (CI: tests/clients/run_agents.sh
installs both).
"""

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

import mock_responses
from codex import scripted_agent as agent
from conftest import Condense, scrape_metrics
from test_responses_sdk import assert_well_formed

HERE = Path(__file__).resolve().parent
CODEX = HERE / "codex" / "node_modules" / ".bin" / "codex"
API_KEY = "sk-codex-e2e-dummy"
MODEL = "gpt-5.5"  # in Codex's model catalog (272k window): its own tools and settings
DEAD_PROXY = "http://127.0.0.1:9"
# Codex's first request is ~39 KB (its instructions as developer messages,
# the environment, 8 tools: ~9k o200k tokens) and each turn adds ~13-14 KB
# (~5k tokens). A 60k window is passed around the 9th request; the last
# (~110k tokens uncompacted) is nearly twice it.
WINDOW = 60000
CONDENSE_CONFIG = f"""
# Written by tests/clients/test_codex.py.
[upstream]
learn_windows = false

[[models]]
match = "gpt-*"
context_window = {WINDOW}
"""


def codex_config(base_url):
    """$CODEX_HOME/config.toml for Codex 0.169.0 (checked with
    --strict-config, which rejects unknown keys)."""
    return f"""
model = "{MODEL}"
model_provider = "condense"
# Run commands without asking and without a sandbox: the test runs as root
# in a container, where Codex's bubblewrap sandbox may not start.
approval_policy = "never"
sandbox_mode = "danger-full-access"
# Whole command outputs (the default limit cuts `seq 1 3000` in the middle).
tool_output_token_limit = 50000
check_for_update_on_startup = false
web_search = "disabled"

[analytics]
enabled = false

[feedback]
enabled = false

[history]
persistence = "none"

[features]
# Both sync a plugin catalog from GitHub and chatgpt.com at start-up.
plugins = false
remote_plugin = false
apps = false

[model_providers.condense]
name = "condense"
base_url = "{base_url}"
wire_api = "responses"
env_key = "CONDENSE_E2E_API_KEY"
"""


def _require(ok, why):
    if ok:
        return
    if os.environ.get("REQUIRE_CLIENT_AGENTS") == "1":
        pytest.fail(why + " (REQUIRE_CLIENT_AGENTS=1)")
    pytest.skip(why)


class Run:
    """One Codex session through condense, and what each side saw."""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    _require(shutil.which("node") is not None, "node is not installed")
    _require(CODEX.exists(), "Codex is not installed: run tests/clients/run_agents.sh "
                             "(npm ci in tests/clients/codex)")
    tmp = tmp_path_factory.mktemp("codex")
    work, home = tmp / "work", tmp / "home"
    codex_home = home / ".codex"
    work.mkdir()
    codex_home.mkdir(parents=True)
    agent.write_workdir(work)
    (tmp / "condense.toml").write_text(CONDENSE_CONFIG)
    server, recorder, url = mock_responses.start(agent.responder())
    condense = Condense(url, args=("--config", str(tmp / "condense.toml")))
    (codex_home / "config.toml").write_text(codex_config(condense.base_url))
    r = Run()
    r.last_message = tmp / "last-message.txt"
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "SHELL": "/bin/bash",
        "TERM": "dumb",
        "HOME": str(home),
        "CODEX_HOME": str(codex_home),
        "CONDENSE_E2E_API_KEY": API_KEY,
        # Warnings and up go to stderr: a failed connection is logged there.
        "RUST_LOG": "warn",
        "NO_COLOR": "1",
        # Anything that is not for condense fails fast instead of leaving.
        **{k: DEAD_PROXY for k in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy",
                                   "all_proxy")},
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }
    cmd = [str(CODEX), "exec", "--strict-config", "--skip-git-repo-check", "--ephemeral", "--json",
           "--output-last-message", str(r.last_message),
           agent.TASK_MARKER + ": run the numbered steps, then report."]
    start = time.monotonic()
    try:
        r.proc = subprocess.run(cmd, env=env, cwd=work, stdin=subprocess.DEVNULL,
                                capture_output=True, text=True, timeout=600)
        r.seconds = time.monotonic() - start
        r.metrics = scrape_metrics(condense)
    finally:
        condense.stop()
        server.shutdown()
    r.requests = list(recorder.requests)
    r.work = work
    r.condense_log = "".join(condense.log)
    r.main = [q for q in r.requests if q["body"] and agent.is_main_loop(q["body"])]
    r.events = [json.loads(line) for line in r.proc.stdout.splitlines() if line.startswith("{")]
    (tmp / "paths.log").write_text("".join(
        "%s %s %s %d\n" % (q["method"], q["path"], (q["body"] or {}).get("model"), q["bytes"]) for q in r.requests))
    (tmp / "codex-stderr.log").write_text(r.proc.stderr)
    print("\nCodex: %.1fs, %d requests (%d main loop); mock log: %s"
          % (r.seconds, len(r.requests), len(r.main), tmp / "paths.log"))
    return r


def _paths(r):
    return "\n".join("%s %s %d" % (q["method"], q["path"], q["bytes"]) for q in r.requests)


def test_codex_finishes_with_the_final_text(run):
    assert run.proc.returncode == 0, run.proc.stderr[-3000:] + run.proc.stdout[-3000:]
    assert run.last_message.read_text().strip() == agent.FINAL_TEXT
    messages = [e["item"]["text"] for e in run.events
                if e.get("type") == "item.completed" and e["item"].get("type") == "agent_message"]
    assert messages[-1] == agent.FINAL_TEXT
    # Codex ran every command itself: its events list them, each exited 0.
    commands = [e["item"] for e in run.events
                if e.get("type") == "item.completed" and e["item"].get("type") == "command_execution"]
    assert len(commands) == agent.STEPS, [c.get("command") for c in commands]
    assert all(c.get("exit_code") == 0 for c in commands), commands


def test_the_mock_drove_every_step(run):
    steps = [agent.done_step(q["body"]) for q in run.main]
    assert len(steps) >= 15, _paths(run)
    assert set(steps) == {None, *range(agent.STEPS)}, steps
    # The 500 the mock answered once reached Codex, which retried.
    assert steps.count(agent.SERVER_ERROR_STEP - 1) == 2, steps


def test_only_the_responses_api_was_called(run):
    # Codex 0.169.0 `exec` with a custom responses provider sends POST
    # /v1/responses only, streamed, store false, reasoning.encrypted_content
    # included, one prompt_cache_key (the session id) for the whole run, no
    # previous_response_id: the whole conversation goes up every turn.
    for q in run.requests:
        assert (q["method"], q["path"]) == ("POST", "/v1/responses"), _paths(run)
        assert q["headers"].get("authorization") == "Bearer " + API_KEY
        assert q["headers"].get("originator") == "codex_exec"
        assert q["headers"].get("user-agent", "").startswith("codex_exec/")
        body = q["body"]
        assert body["model"] == MODEL
        assert body["stream"] is True
        assert body["store"] is False
        assert body["include"] == ["reasoning.encrypted_content"]
        assert "previous_response_id" not in body
    assert len({q["body"]["prompt_cache_key"] for q in run.main}) == 1


def test_nothing_tried_to_leave_the_machine(run):
    # A connection through the dead proxy, or a lookup of a name, would fail
    # and be logged as a warning.
    log = run.proc.stderr
    assert not re.search(r"127\.0\.0\.1:9\b|127\.0\.0\.1 port 9\b", log), log[-3000:]
    assert not re.search(r"error sending request|dns error|Couldn't connect|Connection refused", log), log[-3000:]


def _lines(text):
    return set(text.splitlines())


def test_every_forwarded_request_is_well_formed(run):
    produced = {}
    reasoning_of = {}
    for q in run.main:
        items = q["body"]["input"]
        assert_well_formed(items)
        # Reasoning items go back as the model sent them (Codex adds
        # "content": null), and a function_call kept keeps its reasoning item
        # before it (the API rejects a function_call without it).
        for k, it in enumerate(items):
            if it.get("type") == "reasoning":
                sent = produced[it["id"]]
                assert {key: v for key, v in it.items() if key != "content"} == sent
                assert it["encrypted_content"] == sent["encrypted_content"]
            if it.get("type") == "function_call" and it["call_id"] in reasoning_of:
                assert reasoning_of[it["call_id"]] in {x.get("id") for x in items[:k]}, it["call_id"]
        # The latest command output reaches the model whole.
        done = agent.done_step(q["body"])
        if done is not None:
            last = [it for it in items if it.get("type") == "function_call_output"][-1]
            assert last["call_id"] == "call_step_%02d" % done
            missing = set(agent.step_output_lines(done, run.work)) - _lines(last["output"])
            assert not missing, (done, sorted(missing)[:3])
        for out in [q.get("response", {}).get("output", [])]:
            produced.update({it["id"]: it for it in out})
            # Each scripted turn is reasoning, a message, then the call.
            if len(out) == 3 and out[2]["type"] == "function_call":
                reasoning_of[out[2]["call_id"]] = out[0]["id"]


# The two tests below wait for condense's compaction of /v1/responses: until
# then the route is passed through untouched.

def test_condense_compacted_the_responses_route(run):
    responses = sum(v for (name, labels), v in run.metrics.items()
                    if name == "condense_requests_total" and dict(labels).get("route") == "responses")
    assert responses > 0, [(dict(labels), v) for (name, labels), v in run.metrics.items()
                           if name == "condense_requests_total" and v > 0]
    compactions = {dict(labels)["stage"]: v for (name, labels), v in run.metrics.items()
                   if name == "condense_compactions_total"}
    assert any(v > 0 for v in compactions.values()), compactions


def test_the_model_saw_older_tool_output_compacted(run):
    # Codex resends every command output in full; in the last request
    # condense forwarded, older ones must have been shortened or dropped.
    last = run.main[-1]["body"]["input"]
    outputs = [it for it in last if it.get("type") == "function_call_output"]
    whole = [it for it in outputs
             if not set(agent.step_output_lines(int(it["call_id"][-2:]), run.work)) - _lines(it["output"])]
    assert len(whole) < agent.STEPS, (len(whole), len(outputs))
