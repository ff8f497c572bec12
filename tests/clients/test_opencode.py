"""opencode, the real CLI pinned in opencode/package.json (npm package
opencode-ai), run non-interactively (`opencode run`) through condense
against a scripted mock chat-completions upstream that plays like a GPT
model (opencode/scripted_agent.py, on scripted_model.py): 24 bash and read
calls with large outputs, a sentence before most of them, condense_recall
called first thing at one step and after a sentence at the end, then a
final answer that needs a fact from the first tool output, long masked by
then. condense's window is set so masking starts after about ten turns,
and its summary trigger so checkpoints replace the oldest turns in the
second half.

opencode is pointed at condense with a custom provider in its global
config ($HOME/.config/opencode/opencode.json: the AI SDK's
openai-compatible provider, which opencode bundles, with baseURL and
apiKey), HOME in a temp dir. Its own context management (pruning old tool
outputs, auto-compaction) is switched off, so what the model sees is
condense's doing. Between opencode and condense sits a tap
(client_tap.py) that records the streams condense sent.

Everything stays on 127.0.0.1: the models.dev catalogue fetch, the
autoupdate check, sharing, default plugins (installed from npm), LSP
downloads and Claude Code's and external skills are off, and any other
connection goes to a dead proxy.

What opencode 1.18.33 sends (run, custom openai-compatible provider): POST
/v1/chat/completions only, streamed, with stream_options.include_usage,
max_tokens, tool_choice "auto" and its tools (bash, read, edit, glob,
grep, ...); its system prompt (with the environment and AGENTS.md) as the
first message, then the task as a user message; every turn resends the
whole conversation (assistant messages with content and tool_calls, tool
messages). User-agent "opencode/<version> ai-sdk/...".

Skipped when node or the npm package is missing, unless
REQUIRE_CLIENT_AGENTS=1 (CI: tests/clients/run_agents.sh installs it).
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
import mock_chat
import scripted_model
from conftest import Condense, scrape_metrics
from opencode import scripted_agent as agent

HERE = Path(__file__).resolve().parent
OPENCODE = HERE / "opencode" / "node_modules" / ".bin" / "opencode"
API_KEY = "sk-opencode-e2e-dummy"
MODEL = "mock-model"
DEAD_PROXY = "http://127.0.0.1:9"
# opencode's first request is ~33 KB (system prompt with the environment
# and AGENTS.md, 10 tools) and each turn adds ~15 KB. A 60k window is
# passed around the 10th request; from the 17th turn or so a request holds
# more than 36 messages and the oldest turns are replaced by a checkpoint.
WINDOW = 60000
SUMMARY_AFTER_MESSAGES = 36
CONDENSE_CONFIG = f"""
# Written by tests/clients/test_opencode.py.
[upstream]
learn_windows = false

[[models]]
match = "mock-*"
context_window = {WINDOW}

[summary]
trigger = {{ kind = "messages", value = {SUMMARY_AFTER_MESSAGES} }}
"""


def opencode_config(base_url):
    return {
        "$schema": "https://opencode.ai/config.json",
        "autoupdate": False,
        "share": "disabled",
        "permission": {"bash": "allow", "read": "allow", "edit": "deny", "webfetch": "deny"},
        "provider": {"condense": {
            "npm": "@ai-sdk/openai-compatible",
            "name": "condense",
            "options": {"baseURL": base_url, "apiKey": API_KEY},
            # opencode's own window: large, so it never compacts itself.
            "models": {MODEL: {"name": "Mock model", "limit": {"context": 1000000, "output": 8192}}},
        }},
        "model": "condense/" + MODEL,
        "small_model": "condense/" + MODEL,
    }


def _require(ok, why):
    if ok:
        return
    if os.environ.get("REQUIRE_CLIENT_AGENTS") == "1":
        pytest.fail(why + " (REQUIRE_CLIENT_AGENTS=1)")
    pytest.skip(why)


class Run:
    """One opencode session through condense, and what each side saw."""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    _require(shutil.which("node") is not None, "node is not installed")
    _require(OPENCODE.exists(), "opencode is not installed: run tests/clients/run_agents.sh "
                                "(npm ci in tests/clients/opencode)")
    tmp = tmp_path_factory.mktemp("opencode")
    work, home = tmp / "work", tmp / "home"
    work.mkdir()
    (home / ".config" / "opencode").mkdir(parents=True)
    agent.write_workdir(work)
    (tmp / "condense.toml").write_text(CONDENSE_CONFIG)
    server, recorder, url = mock_chat.start(agent.responder(work), models=(MODEL,))
    condense = Condense(url, args=("--config", str(tmp / "condense.toml")))
    tap, seen, tap_url = client_tap.start(condense.root_url)
    (home / ".config" / "opencode" / "opencode.json").write_text(json.dumps(opencode_config(tap_url + "/v1")))
    r = Run()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "SHELL": "/bin/bash",
        "TERM": "dumb",
        "NO_COLOR": "1",
        "HOME": str(home),
        "TMPDIR": str(tmp),
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_SHARE": "1",
        "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        "OPENCODE_DISABLE_CLAUDE_CODE": "1",
        "OPENCODE_DISABLE_EXTERNAL_SKILLS": "1",
        # condense manages the context, not opencode.
        "OPENCODE_DISABLE_AUTOCOMPACT": "1",
        "OPENCODE_DISABLE_PRUNE": "1",
        # Anything that is not for condense fails fast instead of leaving.
        **{k: DEAD_PROXY for k in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy",
                                   "all_proxy")},
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }
    cmd = [str(OPENCODE), "run", "--format", "json", "--pure", "--title", "condense e2e",
           "--print-logs", "--log-level", "INFO", agent.TASK]
    start = time.monotonic()
    try:
        r.proc = subprocess.run(cmd, env=env, cwd=work, stdin=subprocess.DEVNULL,
                                capture_output=True, text=True, timeout=600)
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
    (tmp / "opencode-stdout.jsonl").write_text(r.proc.stdout)
    (tmp / "opencode-stderr.log").write_text(r.proc.stderr)
    print("\nopencode: %.1fs, %d requests (%d main loop); mock log: %s"
          % (r.seconds, len(r.requests), len(r.main), tmp / "requests.jsonl"))
    return r


def _paths(r):
    return "\n".join("%s %s %d" % (q["method"], q["path"], q["bytes"]) for q in r.requests)


def _answered(r):
    return [q for q in r.main if q.get("parts") is not None]


def _is_recall_round(q):
    return bool(mock_chat.prompt_of(q["body"]).recall_results())


def _client_streams(r):
    """Each answer condense streamed to opencode for the main loop: (the
    step opencode asked for, what the stream held)."""
    out = []
    for t in r.seen:
        if t["path"].split("?")[0] != "/v1/chat/completions" or t["status"] != 200:
            continue
        body = json.loads(t["request"] or b"null")
        if not (body and agent.is_main_loop(body)):
            continue
        done = agent.done_step(body)
        out.append((0 if done is None else done + 1, mock_chat.read_stream(t["body"])[1]))
    return out


def _events(r, kind):
    return [e["part"] for e in r.events if e.get("type") == kind]


def _lines(text):
    # read numbers its lines ("12: ..."), inside <content>; bash does not.
    return {re.sub(r"^\d+: ", "", line) for line in text.splitlines()}


def test_opencode_finishes_with_the_fact_from_the_first_output(run):
    assert run.proc.returncode == 0, run.proc.stderr[-3000:]
    # The model found the codename (in a recall of the first output, masked
    # and then summarized by this turn) and said it; a model that cannot
    # see it says UNKNOWN.
    texts = [p["text"] for p in _events(run, "text")]
    assert agent.FINAL_MARKER in texts[-1] and agent.CODENAME in texts[-1], texts[-3:]
    # opencode ran every tool itself, each to completion.
    tools = _events(run, "tool_use")
    assert [t["callID"] for t in tools] == ["call_step_%02d" % k for k in range(agent.STEPS)], tools[-1:]
    assert all(t["state"]["status"] == "completed" for t in tools), [t["state"] for t in tools][:3]
    # Nothing went wrong on opencode's side.
    assert not [e for e in run.events if e.get("type") == "error"], run.events[-3:]
    assert not re.search(r"level=ERROR", run.proc.stderr), [
        line for line in run.proc.stderr.splitlines() if "level=ERROR" in line][:5]


def test_the_mock_drove_every_step(run):
    steps = [agent.done_step(q["body"]) for q in run.main]
    assert set(steps) == {None, *range(agent.STEPS)}, steps


def test_only_chat_completions_were_called(run):
    # opencode 1.18.33 `run` with an openai-compatible provider sends POST
    # /v1/chat/completions only, streamed with usage, tool_choice auto; so
    # do the rounds condense sends with a recall's result. condense's own
    # summarizer calls are chat completions too, with opencode's key.
    for q in run.requests:
        assert (q["method"], q["path"]) == ("POST", "/v1/chat/completions"), _paths(run)
        assert q["headers"].get("authorization") == "Bearer " + API_KEY
        assert q["body"]["model"] == MODEL
        if q.get("summary"):
            continue
        assert q["headers"].get("user-agent", "").startswith("opencode/"), q["headers"]
        assert q["body"]["stream"] is True
        assert q["body"]["stream_options"] == {"include_usage": True}
    assert all(q["body"]["tool_choice"] == "auto" for q in run.main)


def test_nothing_tried_to_leave_the_machine(run):
    # A connection through the dead proxy, or a lookup of a name, would fail
    # and be logged; opencode's caches hold no download.
    log = run.proc.stderr
    assert "creating instance" in log  # the log is the one we think
    assert not re.search(r"127\.0\.0\.1:9\b|ECONNREFUSED|ENOTFOUND|EAI_AGAIN|ConnectionRefused|Unable to connect",
                         log), log[-3000:]
    assert not re.search(r"models\.dev|registry\.npmjs|opencode\.ai/", log), log[-3000:]


def test_every_forwarded_request_is_well_formed(run):
    for q in run.main:
        messages = q["body"]["messages"]
        pending = []
        for msg in messages:
            if msg["role"] == "tool":
                assert msg["tool_call_id"] in pending, (msg["tool_call_id"], pending)
                pending.remove(msg["tool_call_id"])
            else:
                assert not pending, pending
                pending = [c["id"] for c in msg.get("tool_calls") or []]
        assert not pending, pending
        # The latest tool output reaches the model whole.
        done = agent.done_step(q["body"])
        if done is not None:
            last = [msg for msg in messages if msg["role"] == "tool"
                    and msg["tool_call_id"] == "call_step_%02d" % done][-1]
            missing = set(agent.step_output_lines(done, run.work)) - _lines(mock_chat.text_of(last["content"]))
            assert not missing, (done, sorted(missing)[:3])


def test_the_system_prompt_and_the_task_stay_byte_identical(run):
    # opencode's environment and AGENTS.md are in its system prompt; the
    # task follows. Both go up byte for byte in every request the mock got,
    # those holding a checkpoint included. (condense's recall rounds: the
    # test below.)
    first = run.main[0]["body"]["messages"]
    assert [m["role"] for m in first] == ["system", "user"]
    assert "<env>" in first[0]["content"] and agent.AGENTS_MD.strip() in first[0]["content"]
    head = scripted_model.raw_list(run.main[0]["raw"], "messages")[:2]
    sent = [t for t in run.seen if t["path"] == "/v1/chat/completions"]
    assert scripted_model.raw_list(sent[0]["request"], "messages")[:2] == head
    with_checkpoint = 0
    for q in run.main:
        if _is_recall_round(q):
            continue
        assert scripted_model.raw_list(q["raw"], "messages")[:2] == head, agent.done_step(q["body"])
        with_checkpoint += b"checkpoint. The " in q["raw"]
    assert with_checkpoint >= 3, with_checkpoint


def test_recall_rounds_keep_every_message_byte_identical(run):
    # A round condense sends with a recall's result is the request it
    # answers plus the model's turn and the result: every message before
    # them goes up byte for byte, or the provider's prompt cache is lost
    # for that round.
    rounds = [(k, q) for k, q in enumerate(run.main) if _is_recall_round(q)]
    assert rounds
    for k, q in rounds:
        before = scripted_model.raw_list(run.main[k - 1]["raw"], "messages")
        got = scripted_model.raw_list(q["raw"], "messages")
        changed = [i for i, (a, b) in enumerate(zip(before, got)) if a != b]
        assert not changed, "recall round at step %s rewrote the bytes of messages %s" % (
            agent.done_step(q["body"]), changed[:10])


def test_condense_wrote_checkpoints_with_the_mock_summarizer(run):
    assert [q for q in run.requests if q.get("summary")], _paths(run)
    compactions = {dict(labels)["stage"]: v for (name, labels), v in run.metrics.items()
                   if name == "condense_compactions_total"}
    assert compactions.get("summarize", 0) > 0 and compactions.get("mask", 0) > 0, compactions
    last = json.dumps(run.main[-1]["body"]["messages"])
    assert re.search(r"\[condense: recall key: \d+; checkpoint\. The \d+ messages", last), last[:2000]


def test_the_model_wrote_a_sentence_before_its_calls(run):
    # What opencode got: content deltas, then the tool call; and opencode
    # showed each sentence as text.
    with_text = calls = 0
    for step, got in _client_streams(run):
        if not got["tool_calls"]:
            continue
        calls += 1
        if got["content"].strip():
            with_text += 1
            assert got["content_deltas"] >= 2, got
    assert calls >= agent.STEPS
    assert with_text >= agent.STEPS - len(agent.QUIET), (with_text, calls)
    assert len(_events(run, "text")) >= agent.STEPS - len(agent.QUIET)


def _recall_rounds(r):
    out = []
    for q in _answered(r):
        for p in scripted_model.recall_calls(q["parts"]):
            nxt = next((n for n in r.main if any(msg.get("role") == "tool" and msg.get("tool_call_id") == p.call_id
                                                 for msg in n["body"]["messages"])), None)
            out.append((q, p, nxt))
    return out


def test_condense_recall_called_first_is_answered_inside_condense(run):
    first = [(q, p, n) for q, p, n in _recall_rounds(run)
             if agent.done_step(q["body"]) == agent.RECALL_STEP - 1]
    assert first, "no condense_recall at step %d; recall offered at steps %s" % (agent.RECALL_STEP, sorted(
        agent.done_step(q["body"]) for q in run.main
        if scripted_model.RECALL_TOOL in [(t.get("function") or {}).get("name") for t in q["body"]["tools"]]))
    q, call, follow = first[0]
    assert not scripted_model.text_before_recall(q["parts"])
    assert re.search(r"recall key: %s\b" % call.args["key"], json.dumps(q["body"]))
    assert follow is not None, _paths(run)
    got = [mock_chat.text_of(msg["content"]) for msg in follow["body"]["messages"]
           if msg.get("tool_call_id") == call.call_id][0]
    assert "nothing is stored" not in got and len(got.splitlines()) > 100, got[:500]
    # opencode got the next round's answer only: a sentence and the step's
    # call; never condense's call.
    got = [g for s, g in _client_streams(run) if s == agent.RECALL_STEP][-1]
    assert got["done"] == 1 and got["finish"] == ["tool_calls"], got
    assert got["content"].strip() and [c["id"] for c in got["tool_calls"]] == ["call_step_%02d" % agent.RECALL_STEP]


def test_condense_recall_after_text_continues_the_same_answer(run):
    # At the end the model writes a sentence, then calls condense_recall for
    # the first output. condense answers the call and continues the SAME
    # stream with the next round: one stream, one [DONE], the final
    # round's finish_reason, usage summed. (Before condense learned this,
    # the call was taken out and the turn ended after the sentence.)
    after = [(q, p, n) for q, p, n in _recall_rounds(run) if scripted_model.text_before_recall(q["parts"])]
    assert after, "the model never called condense_recall after text"
    q, call, follow = after[0]
    assert agent.done_step(q["body"]) == agent.STEPS - 1
    assert follow is not None, "condense did not send the recall's result upstream"
    said = next(p.text for p in q["parts"] if p.kind == "text")
    assert said in [msg.get("content") for msg in follow["body"]["messages"] if msg["role"] == "assistant"]
    got = [g for s, g in _client_streams(run) if s == agent.STEPS][-1]
    assert got["done"] == 1 and got["finish"] == ["stop"], got
    assert got["content"].startswith(said) and agent.CODENAME in got["content"], got["content"]
    assert not got["tool_calls"], got["tool_calls"]
    assert got["usage"]["completion_tokens"] == sum(
        x["response"]["usage"]["completion_tokens"] for x in (q, follow)), got["usage"]


def test_the_client_never_saw_condense_recall(run):
    for step, got in _client_streams(run):
        assert all(c["name"] != scripted_model.RECALL_TOOL for c in got["tool_calls"]), step
    assert all(t["tool"] != scripted_model.RECALL_TOOL for t in _events(run, "tool_use"))
    recalls = {dict(labels)["outcome"]: v for (name, labels), v in run.metrics.items()
               if name == "condense_recalls_total"}
    assert recalls.get("answered", 0) >= 2 and not recalls.get("stripped"), recalls


def test_the_model_saw_older_tool_output_compacted(run):
    # opencode resends every tool output in full (its own pruning is off);
    # in the last request condense forwarded, older ones must have been
    # shortened or dropped.
    last = run.main[-1]["body"]["messages"]
    outputs = [msg for msg in last if msg["role"] == "tool" and re.search(r"step_\d+$", msg["tool_call_id"])]
    whole = [msg for msg in outputs if not set(agent.step_output_lines(int(msg["tool_call_id"][-2:]), run.work))
             - _lines(mock_chat.text_of(msg["content"]))]
    assert len(whole) < agent.STEPS, (len(whole), len(outputs))
