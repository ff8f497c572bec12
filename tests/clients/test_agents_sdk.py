"""The OpenAI Agents SDK (openai-agents, pinned in requirements.txt) running
an Agent with three function tools for STEPS turns through condense,
against a scripted mock Responses upstream, then finishing with the mock's
final text. condense's window for gpt models is set so the conversation
must be compacted in its second half.

What the Agents SDK 0.24.0 sends, with OpenAIResponsesModel on a client
whose base URL is not OpenAI's: POST /v1/responses only, the whole
conversation as `input` every turn (items it got back as output, with
their ids, then function_call_output items), `instructions`, `tools`
(strict function schemas), `include: []`, no `store` (the API's default,
true), no `previous_response_id`, no `prompt_cache_key` (it sets one only
for OpenAI's own endpoint); stream false with Runner.run / run_sync, true
with Runner.run_streamed. Reasoning items it got come back whole, with
encrypted_content. Headers: user-agent "Agents/Python <version>" and the
OpenAI SDK's x-stainless-* ones.

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

import mock_responses as m
from conftest import Condense, scrape_metrics
from test_responses_sdk import assert_well_formed

if os.environ.get("REQUIRE_CLIENT_AGENTS") == "1":
    import agents
else:
    agents = pytest.importorskip("agents", reason="openai-agents is not installed (pip install -r requirements.txt)")
from agents import Agent, Runner, function_tool, set_tracing_disabled  # noqa: E402
from agents.models.openai_responses import OpenAIResponsesModel  # noqa: E402
from openai import AsyncOpenAI  # noqa: E402

MODEL = "gpt-5"
API_KEY = "sk-agents-dummy"
TASK = "CONDENSE-AGENTS-TASK: inspect the build, step by step, then report."
FINAL_TEXT = "All checks done. FINAL-ANSWER-condense-agents"
SIDE_TEXT = "Side request answer."
STEPS = 20
# Each tool output is 3-5 KB (~1k tokens by bytes / 4, more in o200k):
# the first request is ~1 KB, the last ~85 KB. A 16k window is passed in
# the second half of the run.
WINDOW = 16000
CONFIG = f"""
# Written by tests/clients/test_agents_sdk.py.
[upstream]
learn_windows = false

[[models]]
match = "gpt-*"
context_window = {WINDOW}
"""


# --- the tools (real Python functions the SDK runs) ---------------------------

def log_text(n):
    return "\n".join(f"build {n:02d} line {k:03d}: compiled src/module_{k % 23}.rs into target/obj_{k}.o "
                     f"({900 + 7 * k} bytes)" for k in range(50))


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


# --- the scripted model -----------------------------------------------------------

def is_main_loop(body):
    return any(t.get("name") == "read_log" for t in body.get("tools") or [])


def done_step(body):
    """The latest step whose function_call_output is in the input, or None.
    Read off the call ids ("call_step_NN"), not off how many requests came
    before, nor how many outputs are left: condense may drop old turns."""
    steps = [int(mt.group(1)) for it in m.input_items(body) if it.get("type") == "function_call_output"
             for mt in [re.match(r"call_step_(\d+)$", it.get("call_id", ""))] if mt]
    return max(steps) if steps else None


def responder(request):
    body = request["body"]
    if not is_main_loop(body):
        return [m.message(SIDE_TEXT)]
    done = done_step(body)
    step = 0 if done is None else done + 1
    if step >= STEPS:
        return [m.message(FINAL_TEXT)]
    name, args, _ = step_call(step)
    return [m.reasoning(f"Step {step}: {name} next.", f"gAAAAB-agents-step-{step:02d}=="),
            m.function_call(f"call_step_{step:02d}", name, args)]


# --- the runs ------------------------------------------------------------------------

class Run:
    """One agent run through condense, and what each side saw."""


def _agent(base_url):
    client = AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=60)
    return Agent(name="build helper", instructions="You inspect builds with the tools you have.",
                 tools=[read_log, list_files, run_check], model=OpenAIResponsesModel(MODEL, client))


def _run(tmp_path_factory, name, go):
    os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"
    set_tracing_disabled(True)
    tmp = tmp_path_factory.mktemp(name)
    (tmp / "condense.toml").write_text(CONFIG)
    server, recorder, url = m.start(responder)
    condense = Condense(url, args=("--config", str(tmp / "condense.toml")))
    r = Run()
    start = time.monotonic()
    try:
        r.result = go(_agent(condense.base_url))
        r.seconds = time.monotonic() - start
        r.metrics = scrape_metrics(condense)
    finally:
        condense.stop()
        server.shutdown()
    r.requests = list(recorder.requests)
    r.main = [q for q in r.requests if q["body"] and is_main_loop(q["body"])]
    print("\nAgents SDK (%s): %.1fs, %d requests (%d main loop)" % (name, r.seconds, len(r.requests), len(r.main)))
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


@pytest.mark.parametrize("which", ["run", "streamed_run"])
def test_the_agent_finishes_with_the_final_text(which, request):
    r = request.getfixturevalue(which)
    assert r.result.final_output == FINAL_TEXT
    outputs = [i for i in r.result.new_items if i.type == "tool_call_output_item"]
    assert len(outputs) == STEPS
    # The tools really ran: their outputs are what the functions return.
    assert [o.output for o in outputs] == [step_call(k)[2] for k in range(STEPS)]


@pytest.mark.parametrize("which", ["run", "streamed_run"])
def test_the_mock_drove_every_step(which, request):
    r = request.getfixturevalue(which)
    steps = [done_step(q["body"]) for q in r.main]
    assert steps == [None, *range(STEPS)], _paths(r)
    stream = which == "streamed_run"
    for q in r.requests:
        assert (q["method"], q["path"]) == ("POST", "/v1/responses"), _paths(r)
        assert q["headers"]["authorization"] == "Bearer " + API_KEY
        assert q["headers"]["user-agent"].startswith("Agents/Python ")
        assert q["body"]["model"] == MODEL
        assert bool(q["body"].get("stream")) is stream
        assert "previous_response_id" not in q["body"]


def test_streamed_run_events(streamed_run):
    assert "raw_response_event" in streamed_run.result.events
    assert streamed_run.result.events.count("run_item_stream_event") >= 2 * STEPS


@pytest.mark.parametrize("which", ["run", "streamed_run"])
def test_every_forwarded_request_is_well_formed(which, request):
    r = request.getfixturevalue(which)
    for q in r.main:
        items = q["body"]["input"]
        assert_well_formed(items)
        # The task and the latest step reach the model whole.
        assert TASK in json.dumps(items[0])
        done = done_step(q["body"])
        if done is not None:
            assert items[-1] == {"call_id": f"call_step_{done:02d}", "output": step_call(done)[2],
                                 "type": "function_call_output"}
        # Reasoning items go back as the model sent them (encrypted_content
        # included), each still right before its function_call.
        given = [p["response"]["output"] for p in r.main[:r.main.index(q)]]
        sent_items = {it["id"]: it for out in given for it in out}
        reasoning_of = {b["call_id"]: a for out in given for a, b in zip(out, out[1:])
                        if a["type"] == "reasoning" and b["type"] == "function_call"}
        for k, it in enumerate(items):
            if it.get("type") == "reasoning":
                assert it == sent_items[it["id"]]
            if it.get("type") == "function_call":
                assert items[k - 1] == reasoning_of[it["call_id"]], it["call_id"]


# The two tests below wait for condense's compaction of /v1/responses:
# until then the route is passed through untouched.

@pytest.mark.parametrize("which", ["run", "streamed_run"])
def test_condense_compacted_the_responses_route(which, request):
    r = request.getfixturevalue(which)
    responses = sum(v for (name, labels), v in r.metrics.items()
                    if name == "condense_requests_total" and dict(labels).get("route") == "responses")
    assert responses >= len(r.requests), [(dict(labels), v) for (name, labels), v in r.metrics.items()
                                          if name == "condense_requests_total" and v > 0]
    compactions = {dict(labels)["stage"]: v for (name, labels), v in r.metrics.items()
                   if name == "condense_compactions_total"}
    assert any(v > 0 for v in compactions.values()), compactions


def test_the_model_saw_older_tool_output_compacted(run):
    # The SDK resends every tool output in full; in the last request
    # condense forwarded, older ones must have been shortened or dropped.
    last = run.main[-1]["body"]["input"]
    outputs = {it["call_id"]: it["output"] for it in last if it.get("type") == "function_call_output"}
    whole = [c for c, out in outputs.items() if out == step_call(int(c[-2:]))[2]]
    assert len(whole) < STEPS, (len(whole), len(outputs))
    assert run.main[-1]["bytes"] < sum(len(step_call(k)[2]) for k in range(STEPS))
