"""The official Anthropic Python SDK against condense in front of a mock
Anthropic upstream: a user who changes only the base URL must notice no
difference, except that long conversations fit."""

import json
import socket

import anthropic
import pytest
from anthropic import Anthropic

import mock_anthropic
from conftest import anthropic_condense_for

MODEL = "claude-sonnet-5-5"
WEATHER = {"name": "get_weather", "description": "Weather for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def client(base_url, key="sk-ant-client-key"):
    # The SDK appends /v1/messages itself: its base URL has no /v1.
    return Anthropic(base_url=base_url, api_key=key, max_retries=0, timeout=30)


def say(text, **kw):
    return dict(model=MODEL, max_tokens=1024, messages=[{"role": "user", "content": text}], **kw)


def test_plain_message(anthropic_condense, anthropic_upstream):
    recorder, _ = anthropic_upstream
    c = client(anthropic_condense.root_url)
    resp = c.messages.with_raw_response.create(
        **say("Say hello."), system="Be brief.",
        extra_headers={"anthropic-beta": "context-management-2025-06-27"})
    message = resp.parse()
    assert message.content[0].text == "Hello from the mock."
    assert message.stop_reason == "end_turn"
    assert message.usage.input_tokens > 0
    # The upstream's request id reaches the SDK.
    assert resp.headers["request-id"] == mock_anthropic.MOCK_REQUEST_ID
    assert message._request_id == mock_anthropic.MOCK_REQUEST_ID
    sent = recorder.last()
    assert sent["path"] == "/v1/messages"
    # The key (this SDK sends it as a Bearer token; Claude Code as
    # x-api-key) and Anthropic's own headers cross the proxy unchanged.
    assert sent["headers"]["authorization"] == "Bearer sk-ant-client-key"
    assert sent["headers"]["anthropic-version"] == c.default_headers["anthropic-version"]
    assert sent["headers"]["anthropic-beta"] == "context-management-2025-06-27"
    assert sent["body"] == {"model": MODEL, "max_tokens": 1024, "system": "Be brief.",
                            "messages": [{"role": "user", "content": "Say hello."}]}


def test_streamed_message_events(anthropic_condense, anthropic_upstream):
    recorder, _ = anthropic_upstream
    c = client(anthropic_condense.root_url)
    with c.messages.stream(**say("Say hello.")) as stream:
        events = [ev.type for ev in stream if ev.type not in ("text", "input_json", "thinking", "signature")]
        final = stream.get_final_message()
    assert final.content[0].text == "Hello from the mock."
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens > 1  # the message_delta's count replaced message_start's placeholder
    assert events[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert recorder.last()["body"]["stream"] is True


def test_the_event_stream_reaches_the_client_unchanged(anthropic_condense, anthropic_upstream):
    recorder, _ = anthropic_upstream
    # Every SSE event, ping included, arrives with its name and data as the
    # upstream sent them (thinking and signature deltas too).
    c = client(anthropic_condense.root_url)
    with c.messages.with_streaming_response.create(
            **say("Say hello."), stream=True, thinking={"type": "enabled", "budget_tokens": 1024}) as resp:
        raw = resp.read().decode()
    got = [(f["event"], json.loads(f["data"])) for f in _sse_frames(raw)]
    sent = list(mock_anthropic.stream_events(recorder.last()["response"]))
    assert got == sent
    assert [e for e, _ in got].count("ping") == 1
    deltas = [d["delta"]["type"] for e, d in got if e == "content_block_delta"]
    assert "thinking_delta" in deltas and "signature_delta" in deltas and "text_delta" in deltas


def _sse_frames(raw):
    frames = []
    for chunk in raw.replace("\r\n", "\n").split("\n\n"):
        if chunk.strip():
            fields = dict(line.split(": ", 1) for line in chunk.split("\n"))
            frames.append(fields)
    return frames


def test_tool_use_round_trip(anthropic_condense, anthropic_upstream):
    recorder, _ = anthropic_upstream
    c = client(anthropic_condense.root_url)
    messages = [{"role": "user", "content": "Please use the weather tool for Paris."}]
    first = c.messages.create(model=MODEL, max_tokens=1024, messages=messages, tools=[WEATHER])
    assert first.stop_reason == "tool_use"
    call = next(b for b in first.content if b.type == "tool_use")
    assert (call.name, call.input) == ("get_weather", {"city": "Paris"})
    messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]})
    messages.append({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": call.id, "content": "18C and sunny"}]})
    second = c.messages.create(model=MODEL, max_tokens=1024, messages=messages, tools=[WEATHER])
    assert second.content[0].text == "The tool said: 18C and sunny"
    sent = recorder.last()["body"]
    assert sent["messages"] == messages
    assert sent["tools"] == [WEATHER]


def test_streamed_tool_use(anthropic_condense):
    c = client(anthropic_condense.root_url)
    with c.messages.stream(**say("use the weather tool"), tools=[WEATHER]) as stream:
        partial = [ev.partial_json for ev in stream if ev.type == "input_json"]
        final = stream.get_final_message()
    assert "".join(partial) == json.dumps({"city": "Paris"})
    call = final.content[-1]
    assert (call.type, call.name, call.input) == ("tool_use", "get_weather", {"city": "Paris"})
    assert final.stop_reason == "tool_use"


def test_count_tokens_is_forwarded(anthropic_condense, anthropic_upstream):
    recorder, _ = anthropic_upstream
    counted = client(anthropic_condense.root_url).messages.count_tokens(
        model=MODEL, messages=[{"role": "user", "content": "How many tokens is this?"}], tools=[WEATHER])
    sent = recorder.last()
    assert sent["path"] == "/v1/messages/count_tokens"
    assert sent["body"]["tools"] == [WEATHER]
    assert counted.input_tokens == mock_anthropic.input_tokens(b"x" * sent["bytes"]) > 0


def test_upstream_errors_surface_as_sdk_exceptions(anthropic_condense):
    c = client(anthropic_condense.root_url)
    with pytest.raises(anthropic.BadRequestError) as err:
        c.messages.create(**say("BAD_REQUEST"))
    assert err.value.status_code == 400
    assert err.value.type == "invalid_request_error"
    assert err.value.api_message == "max_tokens: Field required"
    assert err.value.request_id == mock_anthropic.MOCK_REQUEST_ID
    with pytest.raises(anthropic.RateLimitError) as err:
        c.messages.create(**say("RATE_LIMIT"))
    assert err.value.type == "rate_limit_error"
    assert err.value.response.headers["retry-after"] == "2"
    # A streamed request fails before its first event, with the same error.
    with pytest.raises(anthropic.OverloadedError) as err:
        with c.messages.stream(**say("OVERLOADED")) as stream:
            list(stream)
    assert err.value.status_code == 529
    assert err.value.type == "overloaded_error"
    assert err.value.body == {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"},
                              "request_id": mock_anthropic.MOCK_REQUEST_ID}


def _dead_url():
    """An http://127.0.0.1:PORT/v1 where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


def test_an_unreachable_upstream_is_an_anthropic_shaped_502(upstream):
    _, openai_url = upstream
    c = anthropic_condense_for(_dead_url(), openai_url)
    try:
        with pytest.raises(anthropic.InternalServerError) as err:
            client(c.root_url).messages.create(**say("hi"))
    finally:
        c.stop()
    assert err.value.status_code == 502
    body = err.value.body
    # Anthropic's error shape, so the SDK (and Claude Code) read it.
    assert body["type"] == "error", body
    assert body["error"]["type"] == "api_error"
    assert "condense" in body["error"]["message"]
    assert err.value.api_message == body["error"]["message"]


# --- compaction -------------------------------------------------------------

SMALL_WINDOW = """
# A small window for claude models, so a 30-turn conversation must be compacted.
[upstream]
learn_windows = false

[[models]]
match = "claude*"
context_window = 16000
"""

TURNS = 30


@pytest.fixture(scope="module")
def compacting_condense(anthropic_upstream, upstream, tmp_path_factory):
    c = anthropic_condense_for(anthropic_upstream[1], upstream[1], tmp_path_factory.mktemp("small"), SMALL_WINDOW)
    yield c
    c.stop()


def _tool_output(i):
    return "\n".join(f"turn {i:02d} row {n:03d}: /srv/app/module_{n % 17}.py compiled, 0 warnings, {n * 13} bytes"
                     for n in range(60))


def long_conversation():
    """A user task, then TURNS turns of an assistant tool call and its large
    result; ~4 KB (~1k tokens) a result, twice the 16k window in all."""
    messages = [{"role": "user", "content": "Look through the build logs and tell me what failed."}]
    for i in range(TURNS):
        messages.append({"role": "assistant", "content": [
            {"type": "text", "text": f"Reading log {i}."},
            {"type": "tool_use", "id": f"toolu_log_{i:02d}", "name": "read_log", "input": {"n": i}}]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_log_{i:02d}", "content": _tool_output(i)}]})
    return messages


READ_LOG = {"name": "read_log", "description": "Read build log n",
            "input_schema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}


def assert_well_formed(messages):
    """What the Messages API demands of a conversation: it starts with a
    user message, roles alternate, and every tool_use is answered by a
    tool_result in the next message (and every tool_result answers one)."""
    assert messages[0]["role"] == "user"
    for prev, msg in zip(messages, messages[1:]):
        assert prev["role"] != msg["role"], (prev["role"], msg["role"])
    for i, msg in enumerate(messages):
        blocks = msg["content"] if isinstance(msg["content"], list) else []
        if msg["role"] == "assistant":
            calls = {b["id"] for b in blocks if b["type"] == "tool_use"}
            answered = set()
            if i + 1 < len(messages) and isinstance(messages[i + 1]["content"], list):
                answered = {b["tool_use_id"] for b in messages[i + 1]["content"] if b["type"] == "tool_result"}
            assert calls <= answered, f"message {i}: tool_use {calls - answered} has no tool_result"
        else:
            results = {b["tool_use_id"] for b in blocks if b["type"] == "tool_result"}
            prev_calls = set()
            if i > 0 and isinstance(messages[i - 1]["content"], list):
                prev_calls = {b["id"] for b in messages[i - 1]["content"] if b["type"] == "tool_use"}
            assert results <= prev_calls, f"message {i}: tool_result {results - prev_calls} answers no tool_use"


def test_a_long_conversation_is_compacted(compacting_condense, anthropic_upstream):
    recorder, _ = anthropic_upstream
    messages = long_conversation()
    assert_well_formed(messages)
    resp = client(compacting_condense.root_url).messages.with_raw_response.create(
        model=MODEL, max_tokens=1024, system="You are a build assistant.", messages=messages, tools=[READ_LOG])
    message = resp.parse()
    assert message.content[0].text == "The tool said: " + _tool_output(TURNS - 1)
    sent = recorder.last()
    client_bytes = len(resp.http_request.content)
    assert sent["bytes"] < client_bytes, (sent["bytes"], client_bytes)
    forwarded = sent["body"]["messages"]
    assert_well_formed(forwarded)
    # The task, the system prompt, the tools and the latest result survive.
    assert forwarded[0] == messages[0]
    assert forwarded[-1] == messages[-1]
    assert sent["body"]["system"] == "You are a build assistant."
    # The client's tools come first, unchanged; condense offers its recall
    # tool after them (the compacted request holds recall keys).
    assert sent["body"]["tools"][0] == READ_LOG
    assert [t["name"] for t in sent["body"]["tools"][1:]] == ["condense_recall"]
    actions = resp.headers.get("x-condense-actions")
    assert actions not in (None, "", "none"), resp.headers


def test_a_short_conversation_is_forwarded_byte_identical(compacting_condense, anthropic_upstream):
    recorder, _ = anthropic_upstream
    messages = long_conversation()[:3]
    resp = client(compacting_condense.root_url).messages.with_raw_response.create(
        model=MODEL, max_tokens=1024, messages=messages, tools=[READ_LOG])
    assert resp.parse().stop_reason == "end_turn"
    assert recorder.last()["bytes"] == len(resp.http_request.content)
    assert recorder.last()["body"]["messages"] == messages
