"""The official OpenAI Python SDK against condense in front of a mock
upstream: a user who changes only the base URL must notice no difference."""

import json

import openai
import pytest
from openai import OpenAI

MODEL = "gpt-4o"


def client(base_url, key="sk-client-key"):
    return OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=30)


def test_plain_completion(condense, upstream):
    recorder, _ = upstream
    c = client(condense.base_url)
    resp = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}])
    completion = resp.parse()
    assert completion.choices[0].message.content == "Hello from the mock."
    assert completion.usage.prompt_tokens > 0
    # The upstream's own request id reaches the SDK.
    assert resp.headers["x-request-id"] == "req_mock_123"
    sent = recorder.last()
    assert sent["headers"]["authorization"] == "Bearer sk-client-key"
    assert sent["body"]["messages"] == [{"role": "user", "content": "Say hello."}]


def test_streamed_completion_without_usage(condense, upstream):
    recorder, _ = upstream
    c = client(condense.base_url)
    chunks = list(c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text.strip() == "Hello from the mock."
    # condense asked the upstream for usage but the client, which did not,
    # sees no usage chunk and no usage field.
    assert recorder.last()["body"]["stream_options"] == {"include_usage": True}
    assert all(ch.choices for ch in chunks)
    assert all(ch.usage is None for ch in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_streamed_completion_with_usage(condense):
    c = client(condense.base_url)
    chunks = list(c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens > 0


def test_tool_call_round_trip(condense, upstream):
    recorder, _ = upstream
    c = client(condense.base_url)
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    messages = [{"role": "user", "content": "Please use the weather tool for Paris."}]
    first = c.chat.completions.create(model=MODEL, messages=messages, tools=tools)
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "18C and sunny"})
    second = c.chat.completions.create(model=MODEL, messages=messages, tools=tools)
    assert second.choices[0].message.content == "The tool said: 18C and sunny"
    sent = recorder.last()["body"]
    assert sent["messages"][-1] == {"role": "tool", "tool_call_id": "call_w1", "content": "18C and sunny"}
    assert sent["tools"] == tools


def test_streamed_tool_call(condense):
    c = client(condense.base_url)
    stream = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "use the weather tool"}],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
        stream=True)
    calls = [tc for ch in stream if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert calls and calls[0].function.name == "get_weather"


def test_upstream_errors_surface_as_sdk_exceptions(condense):
    c = client(condense.base_url)
    with pytest.raises(openai.RateLimitError) as err:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "RATE_LIMIT"}])
    assert err.value.status_code == 429
    assert err.value.code == "rate_limit_exceeded"
    assert err.value.response.headers["retry-after"] == "2"
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "BAD_REQUEST"}], stream=True)
    assert "temperature" in err.value.message


def test_a_stream_cut_off_upstream_raises_an_api_error(condense):
    # The upstream resets the connection after one event: condense ends the
    # stream with an error event, which the SDK raises.
    stream = client(condense.base_url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "CUT_STREAM"}], stream=True)
    got = []
    with pytest.raises(openai.APIError) as err:
        for chunk in stream:
            got.extend(ch.delta.content or "" for ch in chunk.choices)
    assert "".join(got) == "Hel"
    assert "mid-stream" in err.value.message


def test_models_listing(condense):
    models = client(condense.base_url).models.list()
    assert [m.id for m in models.data] == ["gpt-4o"]


def test_condense_own_errors_are_sdk_exceptions(gated_condense, upstream):
    recorder, _ = upstream
    with pytest.raises(openai.AuthenticationError) as err:
        client(gated_condense.base_url, key="ck-bad").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert err.value.code == "invalid_api_key"
    ok = client(gated_condense.base_url, key="ck-good").chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert ok.choices[0].message.content == "Hello from the mock."
    assert recorder.last()["headers"]["authorization"] == "Bearer sk-upstream"
