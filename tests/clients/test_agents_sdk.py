"""The OpenAI Agents SDK (openai-agents, pinned in requirements.txt) running
an Agent with three function tools for STEPS turns through condense,
against a scripted mock Responses upstream that plays like a GPT model
(scripted_model.py): a sentence (a message item) before most calls,
condense_recall called first thing at one step and after a sentence at the
end, then a final answer that needs a fact from the first tool output,
long masked by then. condense's window for gpt models is set so masking
starts in the first half, and its summary trigger so checkpoints replace
the oldest turns in the second half.

What the Agents SDK 0.24.0 sends, with OpenAIResponsesModel on a client
whose base URL is not OpenAI's: POST /v1/responses only, the whole
conversation as `input` every turn (items it got back as output, with
their ids, then function_call_output items), `instructions`, `tools`
(strict function schemas), `include: []`, no `previous_response_id`, no
`prompt_cache_key` (it sets one only for OpenAI's own endpoint); stream
false with Runner.run / run_sync, true with Runner.run_streamed. Reasoning
items it got come back whole, with encrypted_content. Headers: user-agent
"Agents/Python <version>" and the OpenAI SDK's x-stainless-* ones. The
agent here sets `store: false` (ModelSettings), as a user who keeps
nothing on the server does: condense offers its tools only to requests
whose responses the server does not keep, and without `store` the API
keeps them.

With stream false condense reads the whole answer, so a recall after text
is answered like any other (the client gets the last round's answer);
with stream true the text has gone out first, and condense must continue
the same stream (see test_codex.py).

Tracing is off (set_tracing_disabled and OPENAI_AGENTS_DISABLE_TRACING), so
nothing goes to OpenAI's trace endpoint; the client has no other base URL.

Skipped when openai-agents is not installed, unless REQUIRE_CLIENT_AGENTS=1
(CI: tests/clients/run_agents.sh).
"""

import asyncio
import json
import os
import re
import time

import pytest

import client_tap
import mock_responses as m
import scripted_model
from conftest import Condense, scrape_metrics
from test_responses_sdk import assert_well_formed

if os.environ.get("REQUIRE_CLIENT_AGENTS") == "1":
    import agents
else:
    agents = pytest.importorskip("agents", reason="openai-agents is not installed (pip install -r requirements.txt)")
from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled  # noqa: E402
from agents.models.openai_responses import OpenAIResponsesModel  # noqa: E402
from openai import AsyncOpenAI  # noqa: E402

MODEL = "gpt-5"
API_KEY = "sk-agents-dummy"
TASK = ("CONDENSE-AGENTS-TASK: inspect the build, step by step, then report the release codename "
        "that build log 0 names.")
FINAL_MARKER = "FINAL-ANSWER-condense-agents"
SIDE_TEXT = "Side request answer."
STEPS = 24
CODENAME = "quiet-lynx-4410"
FACT_STEP = 0
FACT = r"release codename is ([a-z]+-[a-z]+-\d{4})"
RECALL_STEP = 16
QUIET = (4, 11, 19)
# Each tool output is 3-5 KB (~1k tokens by bytes / 4, more in o200k):
# the first request is ~1 KB, the last ~105 KB. A 16k window is passed
# around the 10th request; from the 18th or so a request holds more than
# 36 messages and the oldest turns are replaced by a checkpoint.
WINDOW = 16000
SUMMARY_AFTER_MESSAGES = 36
CONFIG = f"""
# Written by tests/clients/test_agents_sdk.py.
[upstream]
learn_windows = false

[[models]]
match = "gpt-*"
context_window = {WINDOW}

[summary]
trigger = {{ kind = "messages", value = {SUMMARY_AFTER_MESSAGES} }}
"""


# --- the tools (real Python functions the SDK runs) ---------------------------

def log_text(n):
    lines = [f"build {n:02d} line {k:03d}: compiled src/module_{k % 23}.rs into target/obj_{k}.o "
             f"({900 + 7 * k} bytes)" for k in range(50)]
    if n == FACT_STEP:
        # No path and no error word: a masked placeholder does not keep it.
        lines[12] = f"build {n:02d} line 012: the release codename is {CODENAME}"
    return "\n".join(lines)


def listing_text(folder):
    return "\n".join(f"{folder}/file_{k:03d}.txt\t{k * 211} bytes\t2026-01-{1 + k % 28:02d}" for k in range(90))


def check_text(name):
    return "\n".join(f"check {name}: case {k:03d} ok in {k % 9}.{k % 7}s" for k in range(110))


@function_tool
def read_log(n: int) -> str:
    """Read build log number n."""
    return log_text(n)


@function_tool
def list_files(folder: str) -> str:
    """List the files of a folder."""
    return listing_text(folder)


@function_tool
def run_check(name: str) -> str:
    """Run the named check and return its report."""
    return check_text(name)


def step_call(step):
    """The tool the script calls at a step, its arguments and its output."""
    kind = step % 3
    if kind == 0:
        return "read_log", {"n": step}, log_text(step)
    if kind == 1:
        return "list_files", {"folder": f"out/dir_{step:02d}"}, listing_text(f"out/dir_{step:02d}")
    return "run_check", {"name": f"suite_{step:02d}"}, check_text(f"suite_{step:02d}")


SENTENCES = ["Let me read build log {step}.", "Now I'll list out/dir_{step:02d}.",
             "I'll run check suite_{step:02d} next."]


# --- the scripted model -----------------------------------------------------------

def final(fact):
    return f"All checks done. {FINAL_MARKER}: the release codename is {fact}."


SCRIPT = scripted_model.Script(
    steps=STEPS, step_call=lambda step: (*step_call(step)[:2], SENTENCES[step % 3].format(step=step)),
    prefix="call_", fact=FACT, fact_step=FACT_STEP, recall_step=RECALL_STEP, final=final, quiet=QUIET,
    thinking=lambda step: scripted_model.think(f"Step {step}: the next tool."))


def is_main_loop(body):
    return any(t.get("name") == "read_log" for t in body.get("tools") or [])


def done_step(body):
    """The latest step whose function_call_output is in the input, or None."""
    return m.prompt_of(body).done_step()


def responder(request):
    body = request["body"]
    if not is_main_loop(body):
        return [m.message(SIDE_TEXT)]
    prompt = m.prompt_of(body)
    request["parts"] = SCRIPT.decide(prompt)
    return m.output_of(request["parts"], f"gAAAAB-agents-step-{SCRIPT.next_step(prompt):02d}==")


# --- the runs ------------------------------------------------------------------------

class Run:
    """One agent run through condense, and what each side saw."""


def _agent(base_url):
    client = AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=60)
    return Agent(name="build helper", instructions="You inspect builds with the tools you have.",
                 tools=[read_log, list_files, run_check], model=OpenAIResponsesModel(MODEL, client),
                 model_settings=ModelSettings(store=False))


def _run(tmp_path_factory, name, go):
    os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"
    set_tracing_disabled(True)
    tmp = tmp_path_factory.mktemp(name)
    (tmp / "condense.toml").write_text(CONFIG)
    server, recorder, url = m.start(responder)
    condense = Condense(url, args=("--config", str(tmp / "condense.toml")))
    tap, seen, tap_url = client_tap.start(condense.root_url)
    r = Run()
    start = time.monotonic()
    try:
        r.result = go(_agent(tap_url + "/v1"))
        r.seconds = time.monotonic() - start
        r.metrics = scrape_metrics(condense)
    finally:
        condense.stop()
        tap.shutdown()
        server.shutdown()
    r.requests = list(recorder.requests)
    r.seen = list(seen.requests)
    r.main = [q for q in r.requests if q["body"] and is_main_loop(q["body"])]
    scripted_model.dump(tmp / "requests.jsonl", r.requests)
    client_tap.dump(tmp / "client.jsonl", r.seen)
    print("\nAgents SDK (%s): %.1fs, %d requests (%d main loop); mock log: %s"
          % (name, r.seconds, len(r.requests), len(r.main), tmp / "requests.jsonl"))
    return r


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return _run(tmp_path_factory, "agents_sync", lambda agent: Runner.run_sync(agent, TASK, max_turns=STEPS + 5))


@pytest.fixture(scope="module")
def streamed_run(tmp_path_factory):
    async def go(agent):
        result = Runner.run_streamed(agent, TASK, max_turns=STEPS + 5)
        result.events = [ev.type async for ev in result.stream_events()]
        return result
    return _run(tmp_path_factory, "agents_streamed", lambda agent: asyncio.run(go(agent)))


def _paths(r):
    return "\n".join("%s %s %d" % (q["method"], q["path"], q["bytes"]) for q in r.requests)


def _is_recall_round(q):
    return bool(m.prompt_of(q["body"]).recall_results())


def _client_requests(r):
    return [q for q in r.main if not _is_recall_round(q)]


BOTH = pytest.mark.parametrize("which", ["run", "streamed_run"])


@BOTH
def test_the_agent_finishes_with_the_fact_from_the_first_output(which, request):
    r = request.getfixturevalue(which)
    # The model found the codename (in a recall of the first output, masked
    # and then summarized by this turn) and said it; a model that cannot
    # see it says UNKNOWN.
    assert FINAL_MARKER in r.result.final_output and CODENAME in r.result.final_output, r.result.final_output
    outputs = [i for i in r.result.new_items if i.type == "tool_call_output_item"]
    assert len(outputs) == STEPS
    # The tools really ran: their outputs are what the functions return.
    assert [o.output for o in outputs] == [step_call(k)[2] for k in range(STEPS)]
    # The sentences before the calls reached the agent as messages.
    said = [i for i in r.result.new_items if i.type == "message_output_item"]
    assert len(said) >= STEPS - len(QUIET)


@BOTH
def test_the_mock_drove_every_step(which, request):
    r = request.getfixturevalue(which)
    steps = [done_step(q["body"]) for q in _client_requests(r)]
    assert steps == [None, *range(STEPS)], _paths(r)
    stream = which == "streamed_run"
    for q in r.requests:
        if q.get("summary"):
            # condense's summarizer, with the client's key: Responses calls
            # (chat completions in condense before it asked the Responses API).
            assert q["method"] == "POST" and q["path"] in ("/v1/responses", "/v1/chat/completions")
            assert q["headers"]["authorization"] == "Bearer " + API_KEY
            continue
        assert (q["method"], q["path"]) == ("POST", "/v1/responses"), _paths(r)
        assert q["headers"]["authorization"] == "Bearer " + API_KEY
        assert q["headers"]["user-agent"].startswith("Agents/Python ")
        assert q["body"]["model"] == MODEL
        assert bool(q["body"].get("stream")) is stream
        assert q["body"]["store"] is False
        assert "previous_response_id" not in q["body"]


def test_streamed_run_events(streamed_run):
    assert "raw_response_event" in streamed_run.result.events
    assert streamed_run.result.events.count("run_item_stream_event") >= 2 * STEPS


@BOTH
def test_every_forwarded_request_is_well_formed(which, request):
    r = request.getfixturevalue(which)
    given = []
    for q in r.main:
        items = q["body"]["input"]
        assert_well_formed(items)
        # The task and the latest step reach the model whole.
        assert TASK in json.dumps(items[0])
        done = done_step(q["body"])
        if done is not None:
            last = [it for it in items if it.get("call_id") == f"call_step_{done:02d}"
                    and it["type"] == "function_call_output"][-1]
            assert last == {"call_id": f"call_step_{done:02d}", "output": step_call(done)[2],
                            "type": "function_call_output"}
        # Reasoning items go back as the model sent them (encrypted_content
        # included), each still right before the item that followed it.
        sent_items = {it["id"]: it for out in given for it in out}
        follows = {b["id"]: a for out in given for a, b in zip(out, out[1:]) if a["type"] == "reasoning"}
        for k, it in enumerate(items):
            if it.get("type") == "reasoning":
                assert it == sent_items[it["id"]]
            if it.get("id") in follows:
                assert items[k - 1] == follows[it["id"]], it["id"]
        given.append(q["response"]["output"])


@BOTH
def test_the_instructions_and_the_task_stay_byte_identical(which, request):
    r = request.getfixturevalue(which)
    # The task is the first input item; instructions a field of its own.
    head = scripted_model.raw_list(r.main[0]["raw"], "input")[:1]
    with_checkpoint = 0
    for q in _client_requests(r):
        assert scripted_model.raw_list(q["raw"], "input")[:1] == head
        assert q["body"]["instructions"] == r.main[0]["body"]["instructions"]
        with_checkpoint += b"checkpoint. The " in q["raw"]
    assert with_checkpoint >= 3, with_checkpoint


@BOTH
def test_condense_wrote_checkpoints_with_the_mock_summarizer(which, request):
    r = request.getfixturevalue(which)
    assert [q for q in r.requests if q.get("summary")], _paths(r)
    compactions = {dict(labels)["stage"]: v for (name, labels), v in r.metrics.items()
                   if name == "condense_compactions_total"}
    assert compactions.get("summarize", 0) > 0 and compactions.get("mask", 0) > 0, compactions


def _recall_rounds(r):
    out = []
    for q in r.main:
        for p in scripted_model.recall_calls(q.get("parts") or []):
            nxt = next((n for n in r.main if any(it.get("type") == "function_call_output"
                                                 and it.get("call_id") == p.call_id for it in n["body"]["input"])),
                       None)
            out.append((q, p, nxt))
    return out


@BOTH
def test_condense_recall_called_first_and_after_text_is_answered(which, request):
    r = request.getfixturevalue(which)
    rounds = _recall_rounds(r)
    first = [x for x in rounds if done_step(x[0]["body"]) == RECALL_STEP - 1]
    after = [x for x in rounds if scripted_model.text_before_recall(x[0]["parts"])]
    assert first and not scripted_model.text_before_recall(first[0][0]["parts"]), [
        (done_step(q["body"]), p.args) for q, p, _ in rounds]
    assert after and done_step(after[0][0]["body"]) == STEPS - 1
    for q, call, follow in (first[0], after[0]):
        assert follow is not None, "condense did not answer %s at step %s" % (call.args, done_step(q["body"]))
        got = [it for it in follow["body"]["input"] if it.get("call_id") == call.call_id
               and it["type"] == "function_call_output"][0]["output"]
        assert "nothing is stored" not in got, got[:300]
    recalls = {dict(labels)["outcome"]: v for (name, labels), v in r.metrics.items()
               if name == "condense_recalls_total"}
    assert recalls.get("answered", 0) >= 2 and not recalls.get("stripped"), recalls


def test_a_streamed_recall_after_text_continues_the_same_response(streamed_run):
    # One response.created, output indices going on from the message's,
    # one response.completed whose output holds every item the client saw,
    # never a condense_recall call.
    r = streamed_run
    q, call, follow = [x for x in _recall_rounds(r) if scripted_model.text_before_recall(x[0]["parts"])][0]
    said = next(p.text for p in q["parts"] if p.kind == "text")
    streams = [(json.loads(t["request"]), m.read_stream(t["body"])[1]) for t in r.seen
               if t["path"] == "/v1/responses" and t["status"] == 200]
    got = [g for body, g in streams if done_step(body) == STEPS - 1][-1]
    assert got["created"] == 1 and got["completed"] == 1, got
    assert got["indices"] == list(range(len(got["indices"]))), got["indices"]
    texts = [it["content"][0]["text"] for it in got["output"] if it["type"] == "message"]
    assert texts[0] == said and CODENAME in texts[-1], texts
    assert [it["id"] for it in got["response"]["output"]] == [it["id"] for it in got["output"]]
    for body, g in streams:
        assert scripted_model.RECALL_TOOL not in json.dumps(g["response"]["output"]), done_step(body)


def test_the_model_saw_older_tool_output_compacted(run):
    # The SDK resends every tool output in full; in the last request
    # condense forwarded, older ones must have been shortened or dropped.
    last = run.main[-1]["body"]["input"]
    outputs = {it["call_id"]: it["output"] for it in last
               if it.get("type") == "function_call_output" and re.search(r"step_\d+$", it["call_id"])}
    whole = [c for c, out in outputs.items() if out == step_call(int(c[-2:]))[2]]
    assert len(whole) < STEPS, (len(whole), len(outputs))
    assert run.main[-1]["bytes"] < sum(len(step_call(k)[2]) for k in range(STEPS))
