"""Claude Code, the real CLI pinned in claude_code/package.json, run
non-interactively through condense against a scripted mock Anthropic
upstream (claude_code/scripted_agent.py): 22 tool calls with large outputs,
then a final answer. condense's window for claude models is set so the
conversation must be compacted after about ten turns.

Skipped when node or the npm package is missing, unless
REQUIRE_CLIENT_AGENTS=1 (CI: tests/clients/run_agents.sh installs both).
Everything stays on 127.0.0.1: Claude Code's non-essential traffic is
switched off, and any other connection goes to a dead proxy.
"""

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

import mock_anthropic
from claude_code import scripted_agent as agent
from conftest import anthropic_condense_for, scrape_metrics

HERE = Path(__file__).resolve().parent
CLAUDE = HERE / "claude_code" / "node_modules" / ".bin" / "claude"
API_KEY = "sk-ant-e2e-dummy"
DEAD_PROXY = "http://127.0.0.1:9"
MAX_OUTPUT_TOKENS = 8192
# Claude Code's first request is ~49 KB (system prompt and 12 tool
# definitions: ~10k o200k tokens) and each turn adds ~17 KB (~6k tokens).
# With max_tokens 8192 and the 5% reserve, a 68k window leaves a 56k-token
# prompt budget: by o200k counts the 8th request is the first over it, the
# last (~143k tokens uncompacted) is 2.5 times it. The mock reports usage as
# bytes / 4, lower than o200k for this content, so calibration may move the
# first compaction a few turns later.
WINDOW = 68000
CONFIG = f"""
# Written by tests/clients/test_claude_code.py.
[upstream]
# The configured window must hold, not one learned from /v1/models.
learn_windows = false

[[models]]
match = "claude*"
context_window = {WINDOW}
"""


def _require(ok, why):
    if ok:
        return
    if os.environ.get("REQUIRE_CLIENT_AGENTS") == "1":
        pytest.fail(why + " (REQUIRE_CLIENT_AGENTS=1)")
    pytest.skip(why)


class Run:
    """One Claude Code session through condense, and what each side saw."""


@pytest.fixture(scope="module")
def run(tmp_path_factory, upstream):
    _require(shutil.which("node") is not None, "node is not installed")
    _require(CLAUDE.exists(), "Claude Code is not installed: run tests/clients/run_agents.sh "
                              "(npm ci in tests/clients/claude_code)")
    tmp = tmp_path_factory.mktemp("claude_code")
    work, home = tmp / "work", tmp / "home"
    work.mkdir()
    home.mkdir()
    agent.write_workdir(work)
    server, recorder, url = mock_anthropic.start(agent.responder(work))
    condense = anthropic_condense_for(url, upstream[1], tmp, CONFIG)
    r = Run()
    r.debug_log = tmp / "claude-debug.log"
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "SHELL": "/bin/bash",
        "TERM": "dumb",
        # No user config is read or written, and its temp files stay here.
        "HOME": str(home),
        "TMPDIR": str(tmp),
        # The Anthropic SDK inside Claude Code appends /v1/messages itself.
        "ANTHROPIC_BASE_URL": condense.root_url,
        "ANTHROPIC_API_KEY": API_KEY,
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(MAX_OUTPUT_TOKENS),
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_BUG_COMMAND": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        # Anything that is not for condense fails fast instead of leaving.
        "HTTPS_PROXY": DEAD_PROXY,
        "HTTP_PROXY": DEAD_PROXY,
        "https_proxy": DEAD_PROXY,
        "http_proxy": DEAD_PROXY,
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }
    # --dangerously-skip-permissions is refused under root (as CI runs), so
    # the two tools the script uses are allowed by name instead.
    cmd = [str(CLAUDE), "-p", agent.TASK_MARKER + ": run the numbered steps, then report.",
           "--output-format", "json", "--allowedTools", "Bash,Read",
           "--no-session-persistence", "--debug-file", str(r.debug_log)]
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
    (tmp / "paths.log").write_text("".join(
        "%s %s %s %d\n" % (q["method"], q["path"], (q["body"] or {}).get("model"), q["bytes"]) for q in r.requests))
    print("\nClaude Code: %.1fs, %d requests (%d main loop); mock log: %s"
          % (r.seconds, len(r.requests), len(r.main), tmp / "paths.log"))
    return r


def _paths(r):
    return "\n".join("%s %s %s" % (q["method"], q["path"], (q["body"] or {}).get("model")) for q in r.requests)


def test_claude_code_finishes_with_the_final_answer(run):
    assert run.proc.returncode == 0, run.proc.stderr + run.proc.stdout
    result = json.loads(run.proc.stdout)
    assert result["is_error"] is False, result
    assert result["result"] == agent.FINAL_TEXT
    assert result["num_turns"] == agent.STEPS + 1
    assert result["api_error_status"] is None  # the one 529 was retried


def test_the_mock_drove_every_step(run):
    # Steps are read off the tool_use ids in the requests, so a retried
    # request is not a new step.
    steps = [agent.done_step(q["body"]) for q in run.main]
    assert len(set(steps)) >= 15, _paths(run)
    assert set(steps) == {None, *range(agent.STEPS)}, _paths(run)
    # The 529 the mock answered once reached Claude Code, which retried.
    before = agent.OVERLOADED_STEP - 1
    assert steps.count(before) == 2, steps


def test_only_the_messages_api_was_called(run):
    # Claude Code 2.1.330 -p sends POST /v1/messages?beta=true, streamed, and
    # with non-essential traffic off nothing else; count_tokens would be
    # fine too. Every request carries its key and API version. (Requests
    # condense makes itself, e.g. for a summary, are not Claude Code's.)
    from_claude = [q for q in run.requests if q["headers"].get("user-agent", "").startswith("claude-cli/")]
    assert from_claude and all(q in from_claude for q in run.main), _paths(run)
    for q in from_claude:
        assert q["method"] == "POST" and q["path"].split("?")[0] in (
            "/v1/messages", "/v1/messages/count_tokens"), _paths(run)
        assert q["headers"].get("x-api-key") == API_KEY
        assert q["headers"].get("anthropic-version") == "2023-06-01"
        assert q["body"]["model"].startswith("claude")
    assert all(q["body"].get("stream") is True for q in run.main)


def test_nothing_tried_to_leave_the_machine(run):
    # A connection through the dead proxy would fail and be logged.
    log = run.debug_log.read_text(errors="replace")
    assert "[API REQUEST]" in log  # the debug log is the one we think
    assert not re.search(r"127\.0\.0\.1:9\b", log), [
        line for line in log.splitlines() if re.search(r"127\.0\.0\.1:9\b", line)][:5]
    assert not re.search(r"ENOTFOUND|EAI_AGAIN|ECONNREFUSED", log)


def _non_system(messages):
    # Claude Code puts its environment block in a role "system" message
    # after the first user message; the alternation rule is about the rest.
    return [m for m in messages if m["role"] != "system"]


def _blocks(msg):
    return msg["content"] if isinstance(msg["content"], list) else []


def _result_text(block):
    inner = block.get("content")
    if isinstance(inner, str):
        return inner
    return "\n".join(b.get("text", "") for b in inner or [] if b.get("type") == "text")


def _lines(text):
    # Read numbers its lines ("    12\t..." or "    12→..."); Bash does not.
    return {re.sub(r"^\s*\d+(\t|→)", "", line) for line in text.splitlines()}


def test_every_forwarded_request_is_well_formed(run):
    for q in run.main:
        messages = _non_system(q["body"]["messages"])
        assert messages[0]["role"] == "user"
        assert all(a["role"] != b["role"] for a, b in zip(messages, messages[1:])), [m["role"] for m in messages]
        for a, b in zip(messages, messages[1:]):
            calls = {x["id"] for x in _blocks(a) if x["type"] == "tool_use"}
            results = {x["tool_use_id"] for x in _blocks(b) if x["type"] == "tool_result"}
            if a["role"] == "assistant":
                assert calls == results, (calls, results)
        # Thinking blocks go back upstream with their signatures untouched.
        for m in messages:
            for x in _blocks(m):
                if x["type"] == "thinking":
                    assert x["signature"] == mock_anthropic.thinking("")["signature"]
        # The latest tool output reaches the model whole.
        done = agent.done_step(q["body"])
        if done is not None:
            last = [x for x in _blocks(messages[-1]) if x["type"] == "tool_result"][-1]
            missing = set(agent.step_output_lines(done, run.work)) - _lines(_result_text(last))
            assert not missing, (done, sorted(missing)[:3])


# The two tests below wait for condense's compaction of /v1/messages: until
# then the route is passed through untouched.

def test_condense_compacted_the_messages_route(run):
    compactions = {dict(labels)["stage"]: v for (name, labels), v in run.metrics.items()
                   if name == "condense_compactions_total"}
    assert any(v > 0 for v in compactions.values()), compactions
    messages_requests = sum(v for (name, labels), v in run.metrics.items()
                            if name == "condense_requests_total" and dict(labels).get("route") == "messages")
    assert messages_requests > 0, [(dict(labels), v) for (name, labels), v in run.metrics.items()
                                   if name == "condense_requests_total" and v > 0]


def test_the_model_saw_older_tool_output_compacted(run):
    # Claude Code resends every tool result in full; in the last request
    # condense forwarded, older ones must have been masked or dropped.
    last = run.main[-1]["body"]
    results = [x for m in last["messages"] for x in _blocks(m) if x["type"] == "tool_result"]
    whole = [x for x in results if not set(agent.step_output_lines(int(x["tool_use_id"][-2:]), run.work))
             - _lines(_result_text(x))]
    assert len(whole) < agent.STEPS, (len(whole), len(results))
