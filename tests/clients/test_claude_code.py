"""Claude Code, the real CLI pinned in claude_code/package.json, run
non-interactively through condense against a scripted mock Anthropic
upstream that plays like Claude (claude_code/scripted_agent.py, on
scripted_model.py): 24 tool calls with large outputs, a sentence before
most of them, condense_recall called first thing at one step and after a
sentence at the end, then a final answer that needs a fact from the first
tool output, long masked by then. condense's window for claude models is
set so masking starts after about ten turns, and its summary trigger so
checkpoints replace the oldest turns in the second half.

Between Claude Code and condense sits a tap (client_tap.py) that records
the streams condense sent, so the tests read what the client got, not only
what the mock upstream was asked.

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

import client_tap
import mock_anthropic
import scripted_model
from claude_code import scripted_agent as agent
from conftest import anthropic_condense_for, scrape_metrics

HERE = Path(__file__).resolve().parent
CLAUDE = HERE / "claude_code" / "node_modules" / ".bin" / "claude"
API_KEY = "sk-ant-e2e-dummy"
DEAD_PROXY = "http://127.0.0.1:9"
MAX_OUTPUT_TOKENS = 8192
# Claude Code's first request is ~50 KB (system prompt and 12 tool
# definitions: ~10k o200k tokens) and each turn adds ~17 KB (~6k tokens).
# With max_tokens 8192 and the 5% reserve, a 68k window leaves a 56k-token
# prompt budget: masking starts around the 11th request (the mock reports
# usage as bytes / 4, lower than o200k for this content, and calibration
# follows it), and condense_recall is offered from then on. From the 17th
# turn a request has more than 36 messages and the oldest turns are
# replaced by a checkpoint.
WINDOW = 68000
SUMMARY_AFTER_MESSAGES = 36
CONFIG = f"""
# Written by tests/clients/test_claude_code.py.
[upstream]
# The configured window must hold, not one learned from /v1/models.
learn_windows = false

[[models]]
match = "claude*"
context_window = {WINDOW}

[summary]
trigger = {{ kind = "messages", value = {SUMMARY_AFTER_MESSAGES} }}
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
    tap, seen, tap_url = client_tap.start(condense.root_url)
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
        "ANTHROPIC_BASE_URL": tap_url,
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
    # the two tools the script uses are allowed by name instead. stream-json
    # lists every message Claude Code got, then the result.
    cmd = [str(CLAUDE), "-p", agent.TASK, "--output-format", "stream-json", "--verbose",
           "--allowedTools", "Bash,Read", "--no-session-persistence", "--debug-file", str(r.debug_log)]
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
    r.result = next((e for e in reversed(r.events) if e.get("type") == "result"), None)
    scripted_model.dump(tmp / "requests.jsonl", r.requests)
    client_tap.dump(tmp / "client.jsonl", r.seen)
    (tmp / "claude-stdout.jsonl").write_text(r.proc.stdout)
    (tmp / "paths.log").write_text("".join(
        "%s %s %s %d\n" % (q["method"], q["path"], (q["body"] or {}).get("model"), q["bytes"]) for q in r.requests))
    print("\nClaude Code: %.1fs, %d requests (%d main loop); mock log: %s"
          % (r.seconds, len(r.requests), len(r.main), tmp / "paths.log"))
    return r


def _paths(r):
    return "\n".join("%s %s %s" % (q["method"], q["path"], (q["body"] or {}).get("model")) for q in r.requests)


def _answered(r):
    """The mock's main-loop requests with the parts it answered."""
    return [q for q in r.main if q.get("parts") is not None]


def _client_streams(r):
    """Each /v1/messages answer condense streamed to Claude Code for the
    main loop: (the step Claude Code asked for, the message it built)."""
    out = []
    for t in r.seen:
        if not t["path"].startswith("/v1/messages") or t["status"] != 200:
            continue
        body = json.loads(t["request"] or b"null")
        if not (body and agent.is_main_loop(body)):
            continue
        done = agent.done_step(body)
        out.append((0 if done is None else done + 1, mock_anthropic.read_stream(t["body"])[1]))
    return out


def test_claude_code_finishes_with_the_fact_from_the_first_output(run):
    assert run.proc.returncode == 0, run.proc.stderr + run.proc.stdout[-3000:]
    result = run.result
    assert result is not None and result["subtype"] == "success", run.proc.stdout[-3000:]
    assert result["is_error"] is False, result
    assert result["api_error_status"] is None  # the one 529 was retried
    # The model found the codename (in a recall of the first output, masked
    # and then summarized by this turn) and said it; a model that cannot
    # see it says UNKNOWN.
    assert agent.FINAL_MARKER in result["result"], result["result"]
    assert agent.CODENAME in result["result"], result["result"]
    assert result["num_turns"] == agent.STEPS + 1


def test_the_mock_drove_every_step(run):
    # Steps are read off the tool_use ids in the requests, so a retried
    # request, or a round condense sends with a recall's result, is not a
    # new step.
    steps = [agent.done_step(q["body"]) for q in run.main]
    assert set(steps) == {None, *range(agent.STEPS)}, _paths(run)
    # The 529 the mock answered once reached Claude Code, which retried.
    before = agent.OVERLOADED_STEP - 1
    assert steps.count(before) == 2, steps


def test_only_the_messages_api_was_called(run):
    # Claude Code 2.1.330 -p sends POST /v1/messages?beta=true, streamed, and
    # with non-essential traffic off nothing else; count_tokens would be
    # fine too. Every request carries its key and API version; so do the
    # rounds condense sends with a recall's result (the client's request
    # with a turn appended) and its summarizer calls.
    for q in run.requests:
        assert q["method"] == "POST" and q["path"].split("?")[0] in (
            "/v1/messages", "/v1/messages/count_tokens"), _paths(run)
        assert q["headers"].get("x-api-key") == API_KEY
        assert q["headers"].get("anthropic-version") == "2023-06-01"
        assert q["body"]["model"].startswith("claude")
        if not q.get("summary"):
            assert q["headers"].get("user-agent", "").startswith("claude-cli/"), q["headers"]
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


def _step_results(body):
    return [x for m in body["messages"] for x in _blocks(m)
            if x["type"] == "tool_result" and re.search(r"step_\d+$", x["tool_use_id"])]


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
        # The latest tool output reaches the model whole (in a round
        # condense sends with a recall's result too: it follows it).
        done = agent.done_step(q["body"])
        if done is not None:
            last = [x for x in _step_results(q["body"]) if x["tool_use_id"] == "toolu_step_%02d" % done][-1]
            missing = set(agent.step_output_lines(done, run.work)) - _lines(_result_text(last))
            assert not missing, (done, sorted(missing)[:3])


def _head(body):
    """The messages before the model's first turn: Claude Code's first user
    message (its <system-reminder> blocks and the task) and its system
    message with the environment."""
    messages = body["messages"]
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    return messages[:first]


def _compact(obj):
    # How Claude Code (JSON.stringify) and condense write JSON: no spaces,
    # non-ASCII as it is.
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def test_the_environment_blocks_stay_byte_identical(run):
    sent = [json.loads(t["request"]) for t in run.seen if t["path"].startswith("/v1/messages")
            and agent.is_main_loop(json.loads(t["request"] or b"null") or {})]
    # Claude Code writes its environment message as text blocks in its
    # first request and as one string in every later one; nothing else in
    # its head changes.
    first, later = _head(sent[0]), _head(sent[1])
    assert first[0] == later[0] and [m["role"] for m in first] == [m["role"] for m in later]
    assert all(_head(b) == later for b in sent[1:])
    reminders = [b["text"] for b in _blocks(first[0]) if b["text"].startswith("<system-reminder>")]
    # CLAUDE.md's contents and the attribution note, at least.
    assert len(reminders) >= 2 and any(agent.CLAUDE_MD.strip() in t for t in reminders), reminders
    assert any(m["role"] == "system" and "# Environment" in json.dumps(m) for m in first), first
    # Every client request the mock model got, those holding a checkpoint
    # included, has that head byte for byte, and the same system prompt.
    # (condense's recall rounds: the test below.)
    with_checkpoint = 0
    for k, q in enumerate(r for r in run.main if not _is_recall_round(r)):
        head = first if k == 0 else later
        assert _head(q["body"]) == head, agent.done_step(q["body"])
        for m in head:
            assert _compact(m) in q["raw"], agent.done_step(q["body"])
        assert q["body"]["system"] == run.main[0]["body"]["system"]
        with_checkpoint += b"checkpoint. The " in q["raw"]
    assert with_checkpoint >= 3, with_checkpoint


def _is_recall_round(q):
    return bool(mock_anthropic.prompt_of(q["body"]).recall_results())


def test_recall_rounds_keep_every_message_byte_identical(run):
    # A round condense sends with a recall's result is the request it
    # answers plus one turn: every message before it (the head above all)
    # goes up byte for byte, or the provider's prompt cache is lost for
    # that round.
    rounds = [(k, q) for k, q in enumerate(run.main) if _is_recall_round(q)]
    assert rounds
    for k, q in rounds:
        before = run.main[k - 1]["body"]["messages"]
        assert q["body"]["messages"][:len(before)] == before
        changed = [i for i, m in enumerate(before) if _compact(m) not in q["raw"]]
        assert not changed, "recall round at step %s rewrote the bytes of messages %s" % (
            agent.done_step(q["body"]), changed[:10])


def test_condense_wrote_checkpoints_with_the_mock_summarizer(run):
    summaries = [q for q in run.requests if q.get("summary")]
    assert summaries, _paths(run)
    assert all("tools" not in q["body"] for q in summaries)
    compactions = {dict(labels)["stage"]: v for (name, labels), v in run.metrics.items()
                   if name == "condense_compactions_total"}
    assert compactions.get("summarize", 0) > 0, compactions
    last = json.dumps(run.main[-1]["body"]["messages"])
    assert re.search(r"\[condense: recall key: \d+; checkpoint\. The \d+ messages", last), last[:2000]


def test_the_model_wrote_a_sentence_before_its_calls(run):
    # What Claude Code got: text blocks streamed in deltas of their own
    # before the tool_use block, as Claude writes them.
    with_text = 0
    calls = 0
    for step, msg in _client_streams(run):
        kinds = [b["type"] for b in msg["blocks"]]
        if "tool_use" not in kinds:
            continue
        calls += 1
        before = kinds[:kinds.index("tool_use")]
        if "text" in before:
            with_text += 1
            i = sorted(msg["content"])[kinds.index("text")]
            assert msg["deltas"][i] >= 2, msg
    assert calls >= agent.STEPS
    assert with_text >= agent.STEPS - len(agent.QUIET), (with_text, calls)


def _recall_rounds(r):
    """(the mock's request answered with a condense_recall call, the round
    condense sent next with its result) for each recall."""
    out = []
    for q in _answered(r):
        for p in scripted_model.recall_calls(q["parts"]):
            nxt = next((n for n in r.main if any(
                x["type"] == "tool_result" and x["tool_use_id"] == p.call_id for x in _blocks(n["body"]["messages"][-1]))),
                None)
            out.append((q, p, nxt))
    return out


def test_condense_recall_called_first_is_answered_inside_condense(run):
    first = [(q, p, n) for q, p, n in _recall_rounds(run)
             if agent.done_step(q["body"]) == agent.RECALL_STEP - 1]
    assert first, "no condense_recall at step %d; recall offered at steps %s" % (agent.RECALL_STEP, sorted(
        agent.done_step(q["body"]) for q in run.main
        if scripted_model.RECALL_TOOL in [t["name"] for t in q["body"]["tools"]]))
    q, call, follow = first[0]
    assert not scripted_model.text_before_recall(q["parts"])
    assert re.search(r"recall key: %s\b" % call.args["key"], json.dumps(q["body"]))
    # condense answered it with the original and asked again.
    assert follow is not None, _paths(run)
    got = _result_text(_blocks(follow["body"]["messages"][-1])[0])
    assert "nothing is stored" not in got and len(got.splitlines()) > 100, got[:500]
    # Claude Code got the next round's answer only: the step's tool call,
    # with a sentence first; never condense's call.
    msg = [m for s, m in _client_streams(run) if s == agent.RECALL_STEP][-1]
    assert msg["starts"] == 1 and msg["stops"] == 1
    kinds = [b["type"] for b in msg["blocks"]]
    assert "text" in kinds and kinds[-1] == "tool_use", kinds
    assert msg["blocks"][-1]["id"] == "toolu_step_%02d" % agent.RECALL_STEP


def test_condense_recall_after_text_continues_the_same_answer(run):
    # At the end the model says a sentence, then calls condense_recall for
    # the first output. condense answers the call and continues the SAME
    # streamed message with the next round: one message_start, block
    # indices going on from the text's, the final round's stop reason,
    # usage summed, one message_stop. (Before condense learned this, the
    # call was taken out and the turn ended after the sentence.)
    after = [(q, p, n) for q, p, n in _recall_rounds(run) if scripted_model.text_before_recall(q["parts"])]
    assert after, "the model never called condense_recall after text"
    q, call, follow = after[0]
    assert agent.done_step(q["body"]) == agent.STEPS - 1
    assert follow is not None, "condense did not send the recall's result upstream"
    said = [b for b in follow["body"]["messages"][-2]["content"] if b["type"] == "text"]
    assert said and said[0]["text"] == next(p.text for p in q["parts"] if p.kind == "text")
    assert agent.CODENAME in _result_text(_blocks(follow["body"]["messages"][-1])[0])
    msg = [m for s, m in _client_streams(run) if s == agent.STEPS][-1]
    assert msg["starts"] == 1 and msg["stops"] == 1, msg
    assert msg["indices"] == list(range(len(msg["indices"]))), msg["indices"]
    texts = [b["text"] for b in msg["blocks"] if b["type"] == "text"]
    assert texts[0] == said[0]["text"] and agent.CODENAME in texts[-1], texts
    assert msg["stop_reason"] == "end_turn"
    assert msg["usage"]["output_tokens"] == sum(x["response"]["usage"]["output_tokens"] for x in (q, follow))


def test_the_client_never_saw_condense_recall(run):
    for step, msg in _client_streams(run):
        assert all(b.get("name") != scripted_model.RECALL_TOOL for b in msg["blocks"]), step
    for e in run.events:
        if e.get("type") == "assistant":
            assert scripted_model.RECALL_TOOL not in json.dumps(e["message"]["content"]), e
    recalls = {dict(labels)["outcome"]: v for (name, labels), v in run.metrics.items()
               if name == "condense_recalls_total"}
    assert recalls.get("answered", 0) >= 2 and not recalls.get("stripped"), recalls


# The two tests below wait for condense's compaction of /v1/messages: until
# then the route is passed through untouched.

def test_condense_compacted_the_messages_route(run):
    compactions = {dict(labels)["stage"]: v for (name, labels), v in run.metrics.items()
                   if name == "condense_compactions_total"}
    assert compactions.get("mask", 0) > 0, compactions
    messages_requests = sum(v for (name, labels), v in run.metrics.items()
                            if name == "condense_requests_total" and dict(labels).get("route") == "messages")
    assert messages_requests > 0, [(dict(labels), v) for (name, labels), v in run.metrics.items()
                                   if name == "condense_requests_total" and v > 0]


def test_the_model_saw_older_tool_output_compacted(run):
    # Claude Code resends every tool result in full; in the last request
    # condense forwarded, older ones must have been masked or dropped.
    last = run.main[-1]["body"]
    results = _step_results(last)
    whole = [x for x in results if not set(agent.step_output_lines(int(x["tool_use_id"][-2:]), run.work))
             - _lines(_result_text(x))]
    assert len(whole) < agent.STEPS, (len(whole), len(results))
