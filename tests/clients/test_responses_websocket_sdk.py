"""The official OpenAI Python SDK's Responses WebSocket mode
(`client.responses.connect()`, which needs the `websockets` package, pinned
in requirements.txt) against condense in front of a mock Responses upstream
(mock_responses.py) that condense talks to over HTTP.

The SDK upgrades `GET /v1/responses` and sends `response.create` messages:
the fields of a Responses request at the top level, `generate: false` for
a warm-up, and for a chained turn only the new input items with
`previous_response_id`. condense holds each socket's conversation, sends
every turn upstream as a whole stateless request (no previous_response_id,
store false unless the client asked, the whole conversation in `input`)
and streams the events back, which the SDK reads as its typed server
events. A previous_response_id the socket does not hold gets an error
event with OpenAI's code previous_response_not_found, and the socket goes
on.
"""

import asyncio
import contextlib
import json
import threading

import pytest
from openai import AsyncOpenAI, OpenAI
from openai.types.responses.responses_server_event import (
    ResponseFunctionCallArgumentsWsDone,
    ResponseOutputItemWsDone,
    ResponseTextWsDelta,
    ResponseWsCompleted,
    ResponseWsCreated,
    ResponseWsError,
)

import mock_responses
from conftest import Condense, scrape_metrics

MODEL = "gpt-5"
KEY = "sk-ws-client-key"
INSTRUCTIONS = {"type": "message", "role": "developer",
                "content": [{"type": "input_text", "text": "You are a terse assistant. Use tools when asked."}]}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False},
           "strict": True}
# Longest wait for one response's events (a watchdog closes the socket).
WAIT_SECONDS = 30


@pytest.fixture(scope="module")
def ws_upstream():
    server, recorder, url = mock_responses.start()
    yield recorder, url
    server.shutdown()


@pytest.fixture(scope="module")
def wcondense(ws_upstream):
    c = Condense(ws_upstream[1])
    yield c
    c.stop()


def client(base_url):
    return OpenAI(base_url=base_url, api_key=KEY, max_retries=0, timeout=30)


@contextlib.contextmanager
def watchdog(conn):
    """Closes the connection if the block takes longer than WAIT_SECONDS,
    so a response that never ends fails the test instead of hanging it."""
    timer = threading.Timer(WAIT_SECONDS, conn.close)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def events_of_one_response(conn):
    """The SDK's typed events up to the one that ends a response
    (response.completed, response.failed, response.incomplete) or an error
    event."""
    events = []
    with watchdog(conn):
        for event in conn:
            events.append(event)
            if event.type in ("response.completed", "response.failed", "response.incomplete", "error"):
                return events
    raise AssertionError("the socket closed after %s" % [e.type for e in events])


def _upstream_since(recorder, n):
    return [q for q in recorder.requests[n:] if q["path"] == "/v1/responses"]


def _outcomes(condense):
    return {dict(labels)["outcome"]: v for (name, labels), v in scrape_metrics(condense).items()
            if name == "condense_websocket_responses_total"}


def test_a_warm_up_and_chained_turns_reach_the_upstream_whole(wcondense, ws_upstream):
    recorder, _ = ws_upstream
    before = len(recorder.requests)
    outcomes = _outcomes(wcondense)
    conversation = [INSTRUCTIONS]
    with client(wcondense.base_url).responses.connect() as conn:
        # The warm-up: answered at once, no output, nothing sent upstream.
        conn.response.create(model=MODEL, input=[INSTRUCTIONS], tools=[WEATHER], generate=False, store=False)
        warm = events_of_one_response(conn)
        assert [type(e) for e in warm] == [ResponseWsCreated, ResponseWsCompleted], warm
        assert warm[0].response.id == warm[-1].response.id
        assert warm[-1].response.status == "completed" and warm[-1].response.output == []
        assert _upstream_since(recorder, before) == []
        previous = warm[-1].response.id

        # Turn 1, chained to the warm-up, with reasoning whose encrypted
        # content must come back to the model on the next turns.
        said = {"type": "message", "role": "user", "content": "Say hello."}
        conn.response.create(model=MODEL, previous_response_id=previous, input=[said], tools=[WEATHER],
                             reasoning={"effort": "low"}, include=["reasoning.encrypted_content"], store=False)
        events = events_of_one_response(conn)
        assert isinstance(events[0], ResponseWsCreated) and isinstance(events[-1], ResponseWsCompleted), events
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert "".join(e.delta for e in events if isinstance(e, ResponseTextWsDelta)) == "Hello from the mock."
        first = events[-1].response
        assert first.output_text == "Hello from the mock."
        assert [it.type for it in first.output] == ["reasoning", "message"]
        assert first.output[0].encrypted_content == "gAAAAB-mock-encrypted-reasoning=="
        assert first.usage.input_tokens > 0
        done = [e.item for e in events if isinstance(e, ResponseOutputItemWsDone)]
        assert [it.id for it in done] == [it.id for it in first.output]
        conversation += [said] + [it.model_dump(exclude_none=True) for it in first.output]

        # Turn 2: a function call.
        ask = {"type": "message", "role": "user", "content": "Please use the weather tool for Paris."}
        conn.response.create(model=MODEL, previous_response_id=first.id, input=[ask], tools=[WEATHER],
                             reasoning={"effort": "low"}, include=["reasoning.encrypted_content"], store=False)
        events = events_of_one_response(conn)
        second = events[-1].response
        args = [e.arguments for e in events if isinstance(e, ResponseFunctionCallArgumentsWsDone)]
        assert [json.loads(a) for a in args] == [{"city": "Paris"}]
        call = second.output[-1]
        assert (call.type, call.name, call.call_id) == ("function_call", "get_weather", "call_w1")
        conversation += [ask] + [it.model_dump(exclude_none=True) for it in second.output]

        # Turn 3: the tool's result; the model answers with it.
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
        conn.response.create(model=MODEL, previous_response_id=second.id, input=[result], tools=[WEATHER],
                             store=False)
        events = events_of_one_response(conn)
        third = events[-1].response
        assert third.status == "completed"
        assert third.output_text == "The tool said: Sunny, 21 C"
        conversation += [result]

    sent = _upstream_since(recorder, before)
    assert len(sent) == 3, [q["body"] for q in sent]
    for q in sent:
        body = q["body"]
        assert q["method"] == "POST" and q["headers"]["authorization"] == "Bearer " + KEY
        assert body["model"] == MODEL and body["stream"] is True and body["store"] is False
        assert body["tools"] == [WEATHER]
        for key in ("previous_response_id", "type", "generate"):
            assert key not in body, key
    # Each request holds the whole conversation: the warm-up's input, every
    # turn's new items and the outputs before them (the reasoning item
    # with its encrypted content), in order.
    ends = [1 + 1, 1 + 1 + 2 + 1, len(conversation)]
    for q, end in zip(sent, ends):
        assert q["body"]["input"] == conversation[:end], (end, q["body"]["input"])
    assert sent[1]["body"]["input"][2]["encrypted_content"] == "gAAAAB-mock-encrypted-reasoning=="
    after = _outcomes(wcondense)
    assert after["warmup"] - outcomes.get("warmup", 0) == 1
    assert after["completed"] - outcomes.get("completed", 0) == 3


def test_an_unknown_previous_response_id_is_an_error_event_and_the_socket_goes_on(wcondense, ws_upstream):
    recorder, _ = ws_upstream
    before = len(recorder.requests)
    refused = _outcomes(wcondense).get("refused", 0)
    with client(wcondense.base_url).responses.connect() as conn:
        conn.response.create(model=MODEL, previous_response_id="resp_this_socket_never_made",
                             input="Say hello.", store=False)
        events = events_of_one_response(conn)
        assert len(events) == 1 and isinstance(events[0], ResponseWsError), events
        error = events[0]
        assert error.status == 400
        assert error.error.code == "previous_response_not_found"
        assert error.error.param == "previous_response_id"
        assert error.error.type == "invalid_request_error"
        assert "resp_this_socket_never_made" in error.error.message
        assert _upstream_since(recorder, before) == []

        # An upstream error comes back as an error event with its status.
        conn.response.create(model=MODEL, input="RATE_LIMIT please", store=False)
        events = events_of_one_response(conn)
        assert len(events) == 1 and isinstance(events[0], ResponseWsError), events
        assert events[0].status == 429 and events[0].error.code == "rate_limit_exceeded"

        # The same socket answers the next turn.
        conn.response.create(model=MODEL, input="Say hello.", store=False)
        events = events_of_one_response(conn)
        assert isinstance(events[-1], ResponseWsCompleted), events
        assert events[-1].response.output_text == "Hello from the mock."
    sent = _upstream_since(recorder, before)
    assert [q["body"]["input"] for q in sent] == [
        [{"type": "message", "role": "user", "content": "RATE_LIMIT please"}],
        [{"type": "message", "role": "user", "content": "Say hello."}]]
    assert _outcomes(wcondense)["refused"] - refused == 1


def test_the_async_client_chains_turns_too(wcondense, ws_upstream):
    recorder, _ = ws_upstream
    before = len(recorder.requests)

    async def one(conn):
        events = []
        async for event in conn:
            events.append(event)
            if event.type in ("response.completed", "response.failed", "error"):
                return events
        raise AssertionError([e.type for e in events])

    async def session():
        c = AsyncOpenAI(base_url=wcondense.base_url, api_key=KEY, max_retries=0, timeout=30)
        async with c.responses.connect() as conn:
            # No store: condense sends store false, the history is its own.
            await conn.response.create(model=MODEL, input="Say hello.")
            first = (await asyncio.wait_for(one(conn), WAIT_SECONDS))[-1]
            await conn.response.create(model=MODEL, input="Please use the weather tool.", tools=[WEATHER],
                                       previous_response_id=first.response.id)
            return first, (await asyncio.wait_for(one(conn), WAIT_SECONDS))[-1]

    first, second = asyncio.run(session())
    assert isinstance(first, ResponseWsCompleted) and first.response.output_text == "Hello from the mock."
    assert isinstance(second, ResponseWsCompleted) and second.response.output[-1].type == "function_call"
    sent = _upstream_since(recorder, before)
    assert [it.get("content") for it in sent[-1]["body"]["input"] if it.get("role") == "user"] == [
        "Say hello.", "Please use the weather tool."]
    assert [it["type"] for it in sent[-1]["body"]["input"]] == ["message", "message", "message"]
    assert len(sent) == 2
    for q in sent:
        assert q["body"]["store"] is False and "previous_response_id" not in q["body"]
