"""Codex, the real CLI pinned in codex/package.json, run non-interactively
(`codex exec`) through condense against a scripted mock Responses upstream
that plays like a GPT model (codex/scripted_agent.py, on
scripted_model.py): 24 shell commands with large outputs, a sentence (a
message item) before most of them, condense_recall called first thing at
one step and after a sentence at the end, then a final answer that needs
a fact from the first command output, long masked by then. condense's
window for gpt models is set so masking starts after about ten turns, and
its summary trigger so checkpoints replace the oldest turns in the second
half (condense's summarizer asks the same mock, which answers it).

Codex is pointed at condense with a custom model provider in
$CODEX_HOME/config.toml (wire_api "responses", the key from an environment
variable); HOME and CODEX_HOME are in a temp dir. Between Codex and
condense sits a tap (client_tap.py) that records the streams condense
sent. Everything stays on 127.0.0.1: update checks, analytics, feedback
and the plugin and app features (which sync from GitHub and chatgpt.com)
are off, web search is disabled, and any other connection goes to a dead
proxy.

What Codex 0.169.0 sends (codex exec, custom provider, wire_api
"responses"): POST /v1/responses only, nothing else (no /v1/models), with
stream true, store false, include ["reasoning.encrypted_content"],
reasoning {"effort": ...}, text {"verbosity": ...}, parallel_tool_calls,
prompt_cache_key (the session id, the same all run), client_metadata, and
no previous_response_id and no `instructions`: its system prompt is a
developer message at the head of `input`, followed by a second developer
message (skills), a user message with the AGENTS.md instructions of the
working directory and the environment context (two parts), and the task. Every
turn resends the whole conversation: reasoning items (with
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

import client_tap
import mock_responses
import scripted_model
from codex import scripted_agent as agent
from conftest import Condense, scrape_metrics
from test_responses_sdk import assert_well_formed

HERE = Path(__file__).resolve().parent
CODEX = HERE / "codex" / "node_modules" / ".bin" / "codex"
API_KEY = "sk-codex-e2e-dummy"
MODEL = "gpt-5.5"  # in Codex's model catalog (272k window): its own tools and settings
DEAD_PROXY = "http://127.0.0.1:9"
# Codex's first request is ~40 KB (its instructions as developer messages,
# the environment, 9 tools: ~9k o200k tokens) and each turn adds ~13-14 KB
# (~5k tokens). A 60k window is passed around the 10th request; the last
# (~130k tokens uncompacted) is over twice it. From the 17th turn or so a
# request holds more than 36 messages (as condense counts them: a message
# with its function calls is one) and the oldest turns are replaced by a
# checkpoint.
WINDOW = 60000
SUMMARY_AFTER_MESSAGES = 36
CONDENSE_CONFIG = f"""
# Written by tests/clients/test_codex.py.
[upstream]
learn_windows = false

[[models]]
match = "gpt-*"
context_window = {WINDOW}

[summary]
trigger = {{ kind = "messages", value = {SUMMARY_AFTER_MESSAGES} }}
"""


def codex_config(base_url, websockets=False):
    """$CODEX_HOME/config.toml for Codex 0.169.0 (checked with
    --strict-config, which rejects unknown keys). With websockets, the
    provider says it serves the Responses WebSocket mode, and Codex talks
    to it over a socket (test_codex_websocket.py)."""
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
""" + ("supports_websockets = true\n" if websockets else "")


def codex_env(home, codex_home, rust_log="warn"):
    """The environment Codex runs in: HOME and CODEX_HOME in the test's
    temp dir, the key in CONDENSE_E2E_API_KEY, and every proxy variable at
    a dead proxy, so anything that is not for 127.0.0.1 fails fast instead
    of leaving. rust_log is Codex's RUST_LOG: warnings and up go to stderr,
    where a failed connection is logged."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "SHELL": "/bin/bash",
        "TERM": "dumb",
        "HOME": str(home),
        "CODEX_HOME": str(codex_home),
        "CONDENSE_E2E_API_KEY": API_KEY,
        "RUST_LOG": rust_log,
        "NO_COLOR": "1",
        **{k: DEAD_PROXY for k in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy",
                                   "all_proxy")},
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }


def codex_command(last_message):
    """`codex exec` on the task, events as JSON lines on stdout, the last
    message written to last_message."""
    return [str(CODEX), "exec", "--strict-config", "--skip-git-repo-check", "--ephemeral", "--json",
            "--output-last-message", str(last_message), agent.TASK]


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
    tap, seen, tap_url = client_tap.start(condense.root_url)
    (codex_home / "config.toml").write_text(codex_config(tap_url + "/v1"))
    r = Run()
    r.last_message = tmp / "last-message.txt"
    start = time.monotonic()
    try:
        r.proc = subprocess.run(codex_command(r.last_message), env=codex_env(home, codex_home), cwd=work,
                                stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
        r.seconds = time.monotonic() - start
        r.metrics = scrape_metrics(condense)
    finally:
        condense.stop()
        tap.shutdown()
        server.shutdown()
    r.requests = list(recorder.requests)
    r.seen = list(seen.requests)
    r.work = work
    r.condense_log = "".join(condense.log)
    r.main = [q for q in r.requests if q["body"] and agent.is_main_loop(q["body"])]
    r.events = [json.loads(line) for line in r.proc.stdout.splitlines() if line.startswith("{")]
    scripted_model.dump(tmp / "requests.jsonl", r.requests)
    client_tap.dump(tmp / "client.jsonl", r.seen)
    (tmp / "paths.log").write_text("".join(
        "%s %s %s %d\n" % (q["method"], q["path"], (q["body"] or {}).get("model"), q["bytes"]) for q in r.requests))
    (tmp / "codex-stderr.log").write_text(r.proc.stderr)
    print("\nCodex: %.1fs, %d requests (%d main loop); mock log: %s"
          % (r.seconds, len(r.requests), len(r.main), tmp / "paths.log"))
    return r


def _paths(r):
    return "\n".join("%s %s %d" % (q["method"], q["path"], q["bytes"]) for q in r.requests)


def _lines(text):
    return set(text.splitlines())


def _answered(r):
    return [q for q in r.main if q.get("parts") is not None]


def _is_recall_round(q):
    return bool(mock_responses.prompt_of(q["body"]).recall_results())


def _client_streams(r):
    """Each /v1/responses answer condense streamed to Codex for the main
    loop: (the step Codex asked for, what the stream held)."""
    out = []
    for t in r.seen:
        if t["path"].split("?")[0] != "/v1/responses" or t["status"] != 200:
            continue
        body = json.loads(t["request"] or b"null")
        if not (body and agent.is_main_loop(body)):
            continue
        done = agent.done_step(body)
        out.append((0 if done is None else done + 1, mock_responses.read_stream(t["body"])[1]))
    return out


def _items(r, kind):
    return [e["item"] for e in r.events if e.get("type") == "item.completed" and e["item"].get("type") == kind]


def test_codex_finishes_with_the_fact_from_the_first_output(run):
    assert run.proc.returncode == 0, run.proc.stderr[-3000:] + run.proc.stdout[-3000:]
    # The model found the codename (in a recall of the first output, masked
    # and then summarized by this turn) and said it; a model that cannot
    # see it says UNKNOWN.
    last = run.last_message.read_text().strip()
    assert agent.FINAL_MARKER in last and agent.CODENAME in last, last
    messages = [it["text"] for it in _items(run, "agent_message")]
    assert agent.CODENAME in messages[-1], messages[-3:]
    # Codex ran every command itself: its events list them, each exited 0.
    commands = _items(run, "command_execution")
    assert len(commands) == agent.STEPS, [c.get("command") for c in commands]
    assert all(c.get("exit_code") == 0 for c in commands), commands
    # Nothing went wrong on Codex's side (the one 500 was retried quietly).
    assert not [e for e in run.events if e.get("type") in ("error", "turn.failed")], run.events[-3:]


def test_the_mock_drove_every_step(run):
    steps = [agent.done_step(q["body"]) for q in run.main]
    assert set(steps) == {None, *range(agent.STEPS)}, steps
    # The 500 the mock answered once reached Codex, which retried.
    assert steps.count(agent.SERVER_ERROR_STEP - 1) == 2, steps


def test_only_the_responses_api_was_called(run):
    # Codex 0.169.0 `exec` with a custom responses provider sends POST
    # /v1/responses only, streamed, store false, reasoning.encrypted_content
    # included, one prompt_cache_key (the session id) for the whole run, no
    # previous_response_id: the whole conversation goes up every turn. So do
    # the rounds condense sends with a recall's result. condense's own
    # summarizer calls go to the same upstream with Codex's key (Responses
    # calls; chat completions in condense before it asked the Responses API).
    for q in run.requests:
        assert q["headers"].get("authorization") == "Bearer " + API_KEY
        if q.get("summary"):
            assert q["method"] == "POST" and q["path"] in ("/v1/responses", "/v1/chat/completions"), _paths(run)
            continue
        assert (q["method"], q["path"]) == ("POST", "/v1/responses"), _paths(run)
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
            last = [it for it in items if it.get("type") == "function_call_output"
                    and it["call_id"] == "call_step_%02d" % done][-1]
            missing = set(agent.step_output_lines(done, run.work)) - _lines(last["output"])
            assert not missing, (done, sorted(missing)[:3])
        out = q.get("response", {}).get("output", [])
        produced.update({it["id"]: it for it in out})
        # A scripted turn is reasoning, maybe a message, then the call.
        calls = [it for it in out if it["type"] == "function_call"]
        if calls and out[0]["type"] == "reasoning":
            reasoning_of[calls[0]["call_id"]] = out[0]["id"]


def _head(items):
    """The items before the model's first turn: Codex's developer messages,
    <environment_context>, the AGENTS.md instructions and the task."""
    first = next((k for k, it in enumerate(items) if it.get("type") != "message" or it.get("role") == "assistant"),
                 len(items))
    return items[:first]


def test_the_environment_and_instructions_stay_byte_identical(run):
    head = _head(run.main[0]["body"]["input"])
    # Codex 0.169.0: a user message with the AGENTS.md instructions and the
    # <environment_context> as two parts.
    parts = [p["text"] for it in head for p in it["content"]]
    assert [it["role"] for it in head][:2] == ["developer", "developer"], head
    assert any(t.startswith("<environment_context>") for t in parts), parts
    agents_md = [t for t in parts if t.startswith("# AGENTS.md instructions")]
    assert agents_md and agent.AGENTS_MD.strip() in agents_md[0], parts
    raw_head = scripted_model.raw_list(run.main[0]["raw"], "input")[:len(head)]
    # What Codex sent is what the mock got, and the same in every request:
    # those holding a checkpoint included. (condense's recall rounds: the
    # test below.)
    sent = [t for t in run.seen if t["path"].split("?")[0] == "/v1/responses"]
    assert scripted_model.raw_list(sent[0]["request"], "input")[:len(head)] == raw_head
    with_checkpoint = 0
    for q in run.main:
        if _is_recall_round(q):
            continue
        assert scripted_model.raw_list(q["raw"], "input")[:len(head)] == raw_head, agent.done_step(q["body"])
        with_checkpoint += b"checkpoint. The " in q["raw"]
    assert with_checkpoint >= 3, with_checkpoint


def test_recall_rounds_keep_every_item_byte_identical(run):
    # A round condense sends with a recall's result is the request it
    # answers plus the model's turn and the result: every item before them
    # (the head above all) goes up byte for byte, or the provider's prompt
    # cache is lost for that round.
    rounds = [(k, q) for k, q in enumerate(run.main) if _is_recall_round(q)]
    assert rounds
    for k, q in rounds:
        before = scripted_model.raw_list(run.main[k - 1]["raw"], "input")
        got = scripted_model.raw_list(q["raw"], "input")
        changed = [i for i, (a, b) in enumerate(zip(before, got)) if a != b]
        assert not changed, "recall round at step %s rewrote the bytes of items %s" % (
            agent.done_step(q["body"]), changed[:10])


def test_condense_wrote_checkpoints_with_the_mock_summarizer(run):
    summaries = [q for q in run.requests if q.get("summary")]
    assert summaries, _paths(run)
    compactions = {dict(labels)["stage"]: v for (name, labels), v in run.metrics.items()
                   if name == "condense_compactions_total"}
    assert compactions.get("summarize", 0) > 0, compactions
    last = json.dumps(run.main[-1]["body"]["input"])
    assert re.search(r"\[condense: recall key: \d+; checkpoint\. The \d+ messages", last), last[:2000]


def test_the_model_wrote_a_sentence_before_its_calls(run):
    # What Codex got: a message item, its text in deltas of its own, before
    # the function_call; and Codex showed each as an agent message.
    with_text = calls = 0
    for step, got in _client_streams(run):
        kinds = [it["type"] for it in got["output"]]
        if "function_call" not in kinds:
            continue
        calls += 1
        k = kinds.index("function_call")
        if "message" in kinds[:k]:
            with_text += 1
            assert got["deltas"].get(kinds.index("message"), 0) >= 2, got
    assert calls >= agent.STEPS
    assert with_text >= agent.STEPS - len(agent.QUIET), (with_text, calls)
    assert len(_items(run, "agent_message")) >= agent.STEPS - len(agent.QUIET)


def _recall_rounds(r):
    """(the mock's request answered with a condense_recall call, the call,
    the round condense sent next with its result) for each recall."""
    out = []
    for q in _answered(r):
        for p in scripted_model.recall_calls(q["parts"]):
            nxt = next((n for n in r.main if any(it.get("type") == "function_call_output"
                                                 and it.get("call_id") == p.call_id for it in n["body"]["input"])),
                       None)
            out.append((q, p, nxt))
    return out


def test_condense_recall_called_first_is_answered_inside_condense(run):
    first = [(q, p, n) for q, p, n in _recall_rounds(run)
             if agent.done_step(q["body"]) == agent.RECALL_STEP - 1]
    assert first, "no condense_recall at step %d; recall offered at steps %s" % (agent.RECALL_STEP, sorted(
        agent.done_step(q["body"]) for q in run.main
        if scripted_model.RECALL_TOOL in [t.get("name") for t in q["body"]["tools"]]))
    q, call, follow = first[0]
    assert not scripted_model.text_before_recall(q["parts"])
    assert re.search(r"recall key: %s\b" % call.args["key"], json.dumps(q["body"]))
    assert follow is not None, _paths(run)
    got = [it for it in follow["body"]["input"] if it.get("call_id") == call.call_id
           and it["type"] == "function_call_output"][0]["output"]
    assert "nothing is stored" not in got and len(got.splitlines()) > 100, got[:500]
    # Codex got the next round's answer only: a sentence and the step's
    # command; never condense's call.
    got = [g for s, g in _client_streams(run) if s == agent.RECALL_STEP][-1]
    assert got["created"] == 1 and got["completed"] == 1
    kinds = [it["type"] for it in got["output"]]
    assert "message" in kinds and kinds[-1] == "function_call", kinds
    assert got["output"][-1]["call_id"] == "call_step_%02d" % agent.RECALL_STEP


def test_condense_recall_after_text_continues_the_same_answer(run):
    # At the end the model writes a message, then calls condense_recall for
    # the first output. condense answers the call and continues the SAME
    # streamed response with the next round: one response.created, output
    # indices going on from the message's, one response.completed whose
    # output holds every item the client saw. (Before condense learned
    # this, the call was taken out and the turn ended after the message.)
    after = [(q, p, n) for q, p, n in _recall_rounds(run) if scripted_model.text_before_recall(q["parts"])]
    assert after, "the model never called condense_recall after text"
    q, call, follow = after[0]
    assert agent.done_step(q["body"]) == agent.STEPS - 1
    assert follow is not None, "condense did not send the recall's result upstream"
    said = next(p.text for p in q["parts"] if p.kind == "text")
    assert said in [mock_responses.item_text(it) for it in follow["body"]["input"] if it.get("role") == "assistant"]
    got = [g for s, g in _client_streams(run) if s == agent.STEPS][-1]
    assert got["created"] == 1 and got["completed"] == 1, got
    assert got["indices"] == list(range(len(got["indices"]))), got["indices"]
    texts = [it["content"][0]["text"] for it in got["output"] if it["type"] == "message"]
    assert texts[0] == said and agent.CODENAME in texts[-1], texts
    assert [it["id"] for it in got["response"]["output"]] == [it["id"] for it in got["output"]]
    assert got["response"]["status"] == "completed"
    usage = got["response"]["usage"]
    assert usage["output_tokens"] == sum(x["response"]["usage"]["output_tokens"] for x in (q, follow)), usage


def test_the_client_never_saw_condense_recall(run):
    for step, got in _client_streams(run):
        assert scripted_model.RECALL_TOOL not in json.dumps(got["output"]), step
        assert scripted_model.RECALL_TOOL not in json.dumps(got["response"]["output"]), step
    recalls = {dict(labels)["outcome"]: v for (name, labels), v in run.metrics.items()
               if name == "condense_recalls_total"}
    assert recalls.get("answered", 0) >= 2 and not recalls.get("stripped"), recalls


# The two tests below wait for condense's compaction of /v1/responses: until
# then the route is passed through untouched.

def test_condense_compacted_the_responses_route(run):
    responses = sum(v for (name, labels), v in run.metrics.items()
                    if name == "condense_requests_total" and dict(labels).get("route") == "responses")
    assert responses > 0, [(dict(labels), v) for (name, labels), v in run.metrics.items()
                           if name == "condense_requests_total" and v > 0]
    compactions = {dict(labels)["stage"]: v for (name, labels), v in run.metrics.items()
                   if name == "condense_compactions_total"}
    assert compactions.get("mask", 0) > 0, compactions


def test_the_model_saw_older_tool_output_compacted(run):
    # Codex resends every command output in full; in the last request
    # condense forwarded, older ones must have been shortened or dropped.
    last = run.main[-1]["body"]["input"]
    outputs = [it for it in last if it.get("type") == "function_call_output" and "step_" in it["call_id"]]
    whole = [it for it in outputs
             if not set(agent.step_output_lines(int(it["call_id"][-2:]), run.work)) - _lines(it["output"])]
    assert len(whole) < agent.STEPS, (len(whole), len(outputs))
