"""Codex, the real CLI pinned in codex/package.json, on its Responses
WebSocket transport through condense: the session of test_codex.py (24
shell commands with large outputs, condense_recall first thing at one step
and after a sentence at the end, a final answer that needs a fact from the
first output) with the model provider's `supports_websockets = true`, its
base_url straight at condense (the HTTP tap of test_codex.py does not relay
WebSockets). condense talks HTTP to the same scripted mock Responses
upstream (codex/scripted_agent.py), with the same window and summary
trigger, so masking and checkpoints come as they do there.

What Codex 0.169.0 does on that transport (codex exec): it upgrades
`GET /v1/responses` (an OpenAI-Beta header asks for responses_websockets)
as the session starts and sends a warm-up, a `response.create` with
`generate: false` and its first developer message; then each turn is a
`response.create` with the top-level fields of a Responses request,
`previous_response_id` naming the response it continues and only the new
input items (its "incremental" requests). After an error event it drops
the socket, opens another and sends the whole input, no
previous_response_id. A socket it cannot open or keep shows as
"Reconnecting... n/5", then Codex falls back to HTTP. Codex's client
traces (RUST_LOG codex_core::client=trace) name each request that is not
incremental and why; the others went out chained.

condense answers the socket itself: it holds the conversation, sends every
`response.create` upstream as a whole stateless request through its
pipeline (compaction, recall, checkpoints) and streams the events back.

Skipped when node or the npm package is missing, unless
REQUIRE_CLIENT_AGENTS=1 (CI: tests/clients/run_agents.sh installs both).
"""

import json
import re
import shutil
import subprocess
import time

import pytest

import mock_responses
import scripted_model
import test_codex as base
from codex import scripted_agent as agent
from conftest import Condense, scrape_metrics

# Codex's traces of its WebSocket client: connections, and each request
# that is not chained to the previous one (with the reason).
RUST_LOG = "warn,codex_core::client=trace,codex_api::endpoint::responses_websocket=info"
NOT_CHAINED = re.compile(r'non-incremental request reason="([a-z_]+)"')
CONNECTED = "successfully connected to Responses WebSocket"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base._require(shutil.which("node") is not None, "node is not installed")
    base._require(base.CODEX.exists(), "Codex is not installed: run tests/clients/run_agents.sh "
                                       "(npm ci in tests/clients/codex)")
    tmp = tmp_path_factory.mktemp("codex_ws")
    work, home = tmp / "work", tmp / "home"
    codex_home = home / ".codex"
    work.mkdir()
    codex_home.mkdir(parents=True)
    agent.write_workdir(work)
    (tmp / "condense.toml").write_text(base.CONDENSE_CONFIG)
    server, recorder, url = mock_responses.start(agent.responder())
    condense = Condense(url, args=("--config", str(tmp / "condense.toml")))
    (codex_home / "config.toml").write_text(base.codex_config(condense.base_url, websockets=True))
    r = base.Run()
    r.last_message = tmp / "last-message.txt"
    start = time.monotonic()
    try:
        r.proc = subprocess.run(base.codex_command(r.last_message), env=base.codex_env(home, codex_home, RUST_LOG),
                                cwd=work, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
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
    scripted_model.dump(tmp / "requests.jsonl", r.requests)
    (tmp / "paths.log").write_text("".join(
        "%s %s %s %d\n" % (q["method"], q["path"], (q["body"] or {}).get("model"), q["bytes"]) for q in r.requests))
    (tmp / "codex-stderr.log").write_text(r.proc.stderr)
    (tmp / "condense.log").write_text(r.condense_log)
    print("\nCodex over a WebSocket: %.1fs, %d upstream requests (%d main loop); logs in %s"
          % (r.seconds, len(r.requests), len(r.main), tmp))
    return r


def _outcomes(r):
    return {dict(labels)["outcome"]: v for (name, labels), v in r.metrics.items()
            if name == "condense_websocket_responses_total"}


def _client_requests(r):
    """The main-loop requests that stand for a response.create of Codex's
    (not a round condense sent with a recall's result)."""
    return [q for q in r.main if not base._is_recall_round(q)]


def test_codex_finishes_with_the_fact_from_the_first_output(run):
    base.test_codex_finishes_with_the_fact_from_the_first_output(run)


def test_codex_stayed_on_the_websocket(run):
    # A socket Codex cannot use shows as "Reconnecting... n/5" (an error
    # event on stdout, a warning on stderr), then "falling back to HTTP"
    # and "Falling back from WebSockets to HTTPS transport.".
    out = run.proc.stdout + run.proc.stderr
    assert not re.search(r"(?i)reconnecting|falling back", out), run.proc.stderr[-3000:]
    # Every request Codex made was an upgrade of GET /v1/responses: no
    # POST reached condense over HTTP.
    requests = re.findall(r'request method=(\w+) path="([^"]*)" status=(\d+)', run.condense_log)
    assert requests and all(q == ("GET", "/v1/responses", "101") for q in requests), requests
    # One socket for the session, and one more after the error event of
    # the 500 the mock answers once (Codex drops a socket that carried one).
    assert run.proc.stderr.count(CONNECTED) == len(requests) == 2, requests
    outcomes = _outcomes(run)
    # The warm-up (generate: false) was answered by condense, never sent
    # upstream; every turn of Codex's completed, and condense's recall
    # rounds went on inside the response they answer (a response.create
    # each for the first request and each step's result: STEPS + 1).
    assert outcomes.get("warmup") == 1, outcomes
    assert outcomes.get("completed") == agent.STEPS + 1 >= 20, outcomes
    assert outcomes.get("failed") == 1 and not outcomes.get("refused"), outcomes


def test_codex_chained_its_turns_with_previous_response_id(run):
    # Codex's trace names each response.create sent whole (no
    # previous_response_id): the warm-up, the first on a socket, and the
    # one after the reconnect. Every other one continued the response
    # before it with only its new items, and condense made the whole
    # conversation of it. Codex compares what it would send with the last
    # request and its output: "input_mismatch" and the like would mean the
    # output condense streamed differs from what it remembered.
    reasons = NOT_CHAINED.findall(run.proc.stderr)
    assert reasons.count("no_previous_request") == 1, reasons
    assert set(reasons) <= {"no_previous_request", "connection_closed"}, reasons
    creates = sum(_outcomes(run).values())
    assert creates - len(reasons) >= 20, (creates, reasons)


def test_the_mock_drove_every_step(run):
    base.test_the_mock_drove_every_step(run)


def test_every_upstream_request_is_whole_and_stateless(run):
    # condense sent each response.create as the Responses request it stands
    # for: over HTTP, streamed, store false as Codex asked, the whole
    # conversation in `input` and none of the socket's own fields. The
    # upgrade's headers (Codex's key, originator, user agent) went with
    # every request, less the beta that asks for sockets.
    for q in run.requests:
        assert (q["method"], q["path"]) == ("POST", "/v1/responses"), base._paths(run)
        assert q["headers"].get("authorization") == "Bearer " + base.API_KEY
        if q.get("summary"):
            continue
        assert q["headers"].get("originator") == "codex_exec"
        assert q["headers"].get("user-agent", "").startswith("codex_exec/")
        assert "responses_websockets" not in q["headers"].get("openai-beta", "")
        body = q["body"]
        assert body["model"] == base.MODEL
        assert body["stream"] is True
        assert body["store"] is False
        assert body["include"] == ["reasoning.encrypted_content"]
        for key in ("previous_response_id", "type", "generate", "client_metadata"):
            assert key not in body, key
    assert len({q["body"]["prompt_cache_key"] for q in run.main}) == 1


def test_every_request_starts_with_codex_head_byte_identical(run):
    # Codex sent its first developer message in the warm-up and the rest of
    # its head in the first turn, chained to it; the upstream got them
    # together, and the same bytes in every request after: those holding
    # a checkpoint and condense's recall rounds included.
    head = base._head(run.main[0]["body"]["input"])
    parts = [p["text"] for it in head for p in it["content"]]
    assert [it["role"] for it in head][:2] == ["developer", "developer"], head
    assert any(t.startswith("<environment_context>") for t in parts), parts
    agents_md = [t for t in parts if t.startswith("# AGENTS.md instructions")]
    assert agents_md and agent.AGENTS_MD.strip() in agents_md[0], parts
    assert any(agent.TASK in t for t in parts), parts
    raw_head = scripted_model.raw_list(run.main[0]["raw"], "input")[:len(head)]
    with_checkpoint = 0
    for q in run.main:
        assert scripted_model.raw_list(q["raw"], "input")[:len(head)] == raw_head, agent.done_step(q["body"])
        with_checkpoint += b"checkpoint. The " in q["raw"]
    assert with_checkpoint >= 3, with_checkpoint


def test_later_requests_are_compacted(run):
    # The first requests fit the window and go up as they are; from about
    # the tenth on, older outputs are masked ([condense: ... recall key])
    # and the oldest turns end up in a checkpoint.
    marked = ["[condense:" in json.dumps(q["body"]["input"]) for q in run.main]
    assert not any(marked[:5]), marked
    assert all(marked[-10:]), marked
    base.test_condense_compacted_the_responses_route(run)
    base.test_the_model_saw_older_tool_output_compacted(run)


def test_nothing_tried_to_leave_the_machine(run):
    base.test_nothing_tried_to_leave_the_machine(run)


def test_every_forwarded_request_is_well_formed(run):
    base.test_every_forwarded_request_is_well_formed(run)


def test_recall_rounds_keep_every_item_byte_identical(run):
    base.test_recall_rounds_keep_every_item_byte_identical(run)


def test_condense_wrote_checkpoints_with_the_mock_summarizer(run):
    base.test_condense_wrote_checkpoints_with_the_mock_summarizer(run)


def test_condense_recall_called_first_is_answered_inside_condense(run):
    first = [(q, p, n) for q, p, n in base._recall_rounds(run)
             if agent.done_step(q["body"]) == agent.RECALL_STEP - 1]
    assert first, "no condense_recall at step %d" % agent.RECALL_STEP
    q, call, follow = first[0]
    assert not scripted_model.text_before_recall(q["parts"])
    assert re.search(r"recall key: %s\b" % call.args["key"], json.dumps(q["body"]))
    assert follow is not None, base._paths(run)
    got = [it for it in follow["body"]["input"] if it.get("call_id") == call.call_id
           and it["type"] == "function_call_output"][0]["output"]
    assert "nothing is stored" not in got and len(got.splitlines()) > 100, got[:500]
    # Codex got the next round's answer: its next response.create carries
    # that round's sentence and the step's call, and no condense_recall.
    said = next(p.text for p in follow["parts"] if p.kind == "text")
    nxt = next(n for n in _client_requests(run) if agent.done_step(n["body"]) == agent.RECALL_STEP)
    items = nxt["body"]["input"]
    assert said in [mock_responses.item_text(it) for it in items if it.get("role") == "assistant"]
    assert "call_step_%02d" % agent.RECALL_STEP in [it.get("call_id") for it in items
                                                    if it.get("type") == "function_call"]


def test_condense_recall_after_text_continues_the_same_answer(run):
    # At the end the model writes a sentence, then calls condense_recall.
    # condense answers the call and goes on with the same response on the
    # socket: Codex shows the sentence and then the final answer, and sends
    # nothing more (the round with the recall's result is the last request
    # upstream; the completed count above holds no extra response).
    after = [(q, p, n) for q, p, n in base._recall_rounds(run) if scripted_model.text_before_recall(q["parts"])]
    assert after, "the model never called condense_recall after text"
    q, call, follow = after[0]
    assert agent.done_step(q["body"]) == agent.STEPS - 1
    assert follow is not None, "condense did not send the recall's result upstream"
    assert follow is run.main[-1] and run.requests[-1] is follow, base._paths(run)
    said = next(p.text for p in q["parts"] if p.kind == "text")
    assert said in [mock_responses.item_text(it) for it in follow["body"]["input"] if it.get("role") == "assistant"]
    messages = [it["text"] for it in base._items(run, "agent_message")]
    assert messages[-2] == said and agent.CODENAME in messages[-1], messages[-3:]


def test_the_client_never_saw_condense_recall(run):
    # What Codex sent back holds the output it was streamed: a
    # condense_recall call there would have reached it.
    for q in _client_requests(run):
        calls = [it.get("name") for it in q["body"]["input"] if it.get("type") == "function_call"]
        assert scripted_model.RECALL_TOOL not in calls, agent.done_step(q["body"])
    assert scripted_model.RECALL_TOOL not in json.dumps(run.events)
    recalls = {dict(labels)["outcome"]: v for (name, labels), v in run.metrics.items()
               if name == "condense_recalls_total"}
    assert recalls.get("answered", 0) >= 2 and not recalls.get("stripped"), recalls
