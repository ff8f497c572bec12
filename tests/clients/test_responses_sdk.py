"""The official OpenAI Python SDK's `responses` resource against condense in
front of a mock Responses upstream (mock_responses.py): a user who changes
only the base URL must notice no difference, except that long stateless
conversations fit.

The tests under "compaction" wait for condense's compaction of
/v1/responses: until it lands the route is passed through untouched, the
long conversation overflows the mock's window and no x-condense-actions
header is sent.
"""

import json
import socket

import openai
import pytest
from openai import OpenAI

import mock_responses
from conftest import Condense

MODEL = "gpt-5"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False},
           "strict": True}


def responses_condense(upstream_url, tmp_dir=None, config_toml=None):
    """condense with upstream.base_url at a mock Responses upstream; with
    config_toml, started with --config on that text (written into tmp_dir)."""
    args = ()
    if config_toml is not None:
        path = tmp_dir / "condense.toml"
        path.write_text(config_toml)
        args = ("--config", str(path))
    return Condense(upstream_url, args=args)


@pytest.fixture(scope="module")
def responses_upstream():
    server, recorder, url = mock_responses.start()
    yield recorder, url
    server.shutdown()


@pytest.fixture(scope="module")
def rcondense(responses_upstream):
    c = responses_condense(responses_upstream[1])
    yield c
    c.stop()


def client(base_url, key="sk-client-key"):
    return OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=30)


def test_plain_response(rcondense, responses_upstream):
    recorder, _ = responses_upstream
    resp = client(rcondense.base_url).responses.with_raw_response.create(
        model=MODEL, instructions="Be brief.", input="Say hello.", store=False)
    response = resp.parse()
    assert response.output_text == "Hello from the mock."
    assert response.status == "completed"
    assert response.usage.input_tokens > 0 and response.usage.output_tokens > 0
    assert response.usage.input_tokens_details.cached_tokens == 0
    # The upstream's request id reaches the SDK.
    assert resp.headers["x-request-id"] == mock_responses.MOCK_REQUEST_ID
    assert response._request_id == mock_responses.MOCK_REQUEST_ID
    sent = recorder.last()
    assert (sent["method"], sent["path"]) == ("POST", "/v1/responses")
    assert sent["headers"]["authorization"] == "Bearer sk-client-key"
    assert sent["body"] == {"model": MODEL, "instructions": "Be brief.", "input": "Say hello.", "store": False}
    # A short request crosses condense byte for byte.
    assert sent["raw"] == resp.http_request.content


def _sse_frames(raw):
    frames = []
    for chunk in raw.replace("\r\n", "\n").split("\n\n"):
        if chunk.strip():
            fields = dict(line.split(": ", 1) for line in chunk.split("\n"))
            frames.append(fields)
    return frames


def test_streamed_response_events(rcondense, responses_upstream):
    recorder, _ = responses_upstream
    stream = client(rcondense.base_url).responses.create(model=MODEL, input="Say hello.", stream=True)
    events = list(stream)
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "Hello from the mock."
    final = events[-1].response
    assert final.output_text == "Hello from the mock."
    assert final.usage.input_tokens > 0
    assert recorder.last()["body"]["stream"] is True


def test_the_event_stream_reaches_the_client_unchanged(rcondense, responses_upstream):
    recorder, _ = responses_upstream
    # Every SSE event arrives with its name and data as the upstream sent
    # them: reasoning summary events, encrypted_content and usage included.
    c = client(rcondense.base_url)
    with c.responses.with_streaming_response.create(
            model=MODEL, input="Say hello.", stream=True, reasoning={"effort": "low", "summary": "auto"},
            include=["reasoning.encrypted_content"], store=False) as resp:
        raw = resp.read().decode()
    got = [(f["event"], json.loads(f["data"])) for f in _sse_frames(raw)]
    sent = list(mock_responses.stream_events(recorder.last()["response"]))
    assert got == sent
    names = [e for e, _ in got]
    assert "response.reasoning_summary_text.delta" in names and "response.output_text.delta" in names
    assert all(d["type"] == e for e, d in got)


def test_stream_helper_accumulates_the_final_response(rcondense):
    c = client(rcondense.base_url)
    with c.responses.stream(model=MODEL, input="Say hello.") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == "Hello from the mock."


def test_function_tool_round_trip(rcondense, responses_upstream):
    recorder, _ = responses_upstream
    c = client(rcondense.base_url)
    items = [{"role": "user", "content": "Please use the weather tool for Paris."}]
    first = c.responses.create(model=MODEL, input=items, tools=[WEATHER], store=False)
    call = first.output[0]
    assert (call.type, call.name, call.call_id) == ("function_call", "get_weather", "call_w1")
    assert json.loads(call.arguments) == {"city": "Paris"}
    items += [item.model_dump(exclude_none=True) for item in first.output]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "18C and sunny"})
    second = c.responses.create(model=MODEL, input=items, tools=[WEATHER], store=False)
    assert second.output_text == "The tool said: 18C and sunny"
    sent = recorder.last()["body"]
    assert sent["input"] == items
    assert sent["tools"] == [WEATHER]


def test_streamed_function_call(rcondense):
    stream = client(rcondense.base_url).responses.create(
        model=MODEL, input="use the weather tool", tools=[WEATHER], stream=True)
    events = list(stream)
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(pieces) == done[0].arguments == json.dumps({"city": "Paris"})
    call = [e.item for e in events if e.type == "response.output_item.done"][0]
    assert (call.type, call.name, call.arguments) == ("function_call", "get_weather", done[0].arguments)


def test_reasoning_items_go_back_unchanged(rcondense, responses_upstream):
    recorder, _ = responses_upstream
    c = client(rcondense.base_url)
    kw = dict(model=MODEL, tools=[WEATHER], store=False, reasoning={"effort": "medium"},
              include=["reasoning.encrypted_content"])
    items = [{"role": "user", "content": "use the weather tool"}]
    first = c.responses.create(input=items, **kw)
    assert [i.type for i in first.output] == ["reasoning", "function_call"]
    assert first.output[0].encrypted_content == "gAAAAB-mock-encrypted-reasoning=="
    items += [i.model_dump(exclude_none=True) for i in first.output]
    items.append({"type": "function_call_output", "call_id": first.output[1].call_id, "output": "rain"})
    resp = c.responses.with_raw_response.create(input=items, **kw)
    assert resp.parse().output_text == "The tool said: rain"
    sent = recorder.last()
    assert sent["body"]["input"] == items
    assert sent["raw"] == resp.http_request.content


def test_previous_response_id_chains_through(rcondense, responses_upstream):
    recorder, _ = responses_upstream
    c = client(rcondense.base_url)
    first = c.responses.create(model=MODEL, input="use the weather tool", tools=[WEATHER])
    resp = c.responses.with_raw_response.create(
        model=MODEL, previous_response_id=first.id, tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": "call_w1", "output": "fog"}])
    assert resp.parse().output_text == "The tool said: fog"
    assert recorder.last()["raw"] == resp.http_request.content
    # An id the upstream does not know: its 400 reaches the SDK.
    with pytest.raises(openai.BadRequestError) as err:
        c.responses.create(model=MODEL, previous_response_id="resp_unknown", input="hi")
    assert err.value.code == "previous_response_not_found"
    assert err.value.param == "previous_response_id"


def test_upstream_errors_surface_as_sdk_exceptions(rcondense):
    c = client(rcondense.base_url)
    with pytest.raises(openai.RateLimitError) as err:
        c.responses.create(model=MODEL, input="RATE_LIMIT")
    assert err.value.status_code == 429
    assert err.value.code == "rate_limit_exceeded"
    assert err.value.response.headers["retry-after"] == "2"
    assert err.value.request_id == mock_responses.MOCK_REQUEST_ID
    # A streamed request fails before its first event, with the same error.
    with pytest.raises(openai.BadRequestError) as err:
        list(c.responses.create(model=MODEL, input="BAD_REQUEST", stream=True))
    assert err.value.status_code == 400
    assert (err.value.code, err.value.param) == ("invalid_value", "truncation")
    assert err.value.type == "invalid_request_error"


def test_an_overflow_condense_cannot_fix_reaches_the_client(tmp_path):
    # One user message larger than the upstream's window: nothing to
    # compact, so the API's overflow error must reach the client as it was.
    server, recorder, url = mock_responses.start(window_tokens=200)
    c = responses_condense(url)
    try:
        with pytest.raises(openai.BadRequestError) as err:
            client(c.base_url).responses.create(model=MODEL, input="x" * 4000)
    finally:
        c.stop()
        server.shutdown()
    assert err.value.code == "context_length_exceeded"
    assert err.value.param == "input"
    assert err.value.body == mock_responses.overflow().body()["error"]
    assert recorder.requests and all(q["path"] == "/v1/responses" for q in recorder.requests)


def _dead_url():
    """An http://127.0.0.1:PORT/v1 where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


def test_an_unreachable_upstream_is_an_openai_shaped_502():
    c = responses_condense(_dead_url())
    try:
        with pytest.raises(openai.InternalServerError) as err:
            client(c.base_url).responses.create(model=MODEL, input="hi")
    finally:
        c.stop()
    assert err.value.status_code == 502
    body = err.value.body
    # OpenAI's error shape (the SDK hands over the "error" object).
    assert set(body) >= {"message", "type", "code"}, body
    assert "condense" in body["message"]
    assert err.value.message.endswith(body["message"]) or body["message"] in err.value.message


def test_models_listing(rcondense, responses_upstream):
    recorder, _ = responses_upstream
    models = client(rcondense.base_url).models.list()
    assert [m.id for m in models.data] == ["gpt-5", "gpt-5-codex"]
    assert recorder.last()["path"] == "/v1/models"


# --- compaction -------------------------------------------------------------

WINDOW = 16000
SMALL_WINDOW = f"""
# A small window for gpt models, so a 30-turn conversation must be compacted.
[upstream]
learn_windows = false

[[models]]
match = "gpt-*"
context_window = {WINDOW}
"""
# The mock's own window is a little larger than condense's: an uncompacted
# long conversation (~40k tokens by bytes / 4) overflows it, a compacted
# one fits.
UPSTREAM_WINDOW = 20000
TURNS = 30
READ_LOG = {"type": "function", "name": "read_log", "description": "Read build log n",
            "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
            "strict": False}
TASK = {"type": "message", "role": "user",
        "content": [{"type": "input_text", "text": "Look through the build logs and tell me what failed."}]}


@pytest.fixture(scope="module")
def small_upstream():
    server, recorder, url = mock_responses.start(window_tokens=UPSTREAM_WINDOW)
    yield recorder, url
    server.shutdown()


@pytest.fixture(scope="module")
def compacting_condense(small_upstream, tmp_path_factory):
    c = responses_condense(small_upstream[1], tmp_path_factory.mktemp("small"), SMALL_WINDOW)
    yield c
    c.stop()


def _tool_output(i):
    return "\n".join(f"turn {i:02d} row {n:03d}: /srv/app/module_{n % 17}.py compiled, 0 warnings, {n * 13} bytes"
                     for n in range(60))


def long_input(turns=TURNS):
    """The task, then `turns` turns of a reasoning item (with
    encrypted_content, as a store=false client keeps it), a function_call
    and its large output; ~4.5 KB a turn."""
    items = [TASK]
    for i in range(turns):
        items.append({"type": "reasoning", "id": f"rs_log_{i:02d}",
                      "summary": [{"type": "summary_text", "text": f"Log {i} is next."}],
                      "encrypted_content": f"gAAAAB-enc-{i:02d}-" + "Zm9v" * 40})
        items.append({"type": "function_call", "id": f"fc_log_{i:02d}", "call_id": f"call_log_{i:02d}",
                      "name": "read_log", "arguments": json.dumps({"n": i}), "status": "completed"})
        items.append({"type": "function_call_output", "call_id": f"call_log_{i:02d}", "output": _tool_output(i)})
    return items


def raw_input_items(raw):
    """The exact JSON text of each element of a request body's top-level
    "input" array, to compare items byte for byte across the proxy."""
    s = raw.decode()
    dec = json.JSONDecoder()

    def ws(i):
        while s[i] in " \t\r\n":
            i += 1
        return i

    i = ws(0)
    assert s[i] == "{"
    i += 1
    while True:
        i = ws(i)
        if s[i] == "}":
            return None
        key, i = dec.raw_decode(s, i)
        i = ws(i)
        assert s[i] == ":"
        i = ws(i + 1)
        if key == "input":
            assert s[i] == "["
            items, i = [], i + 1
            while True:
                i = ws(i)
                if s[i] == "]":
                    return items
                _, j = dec.raw_decode(s, i)
                items.append(s[i:j])
                i = ws(j)
                if s[i] == ",":
                    i += 1
        _, i = dec.raw_decode(s, i)
        i = ws(i)
        if s[i] == ",":
            i += 1


def assert_well_formed(items):
    """What the Responses API demands of a stateless input: every
    function_call_output answers a function_call earlier in the input, and
    every function_call is answered."""
    calls = [it["call_id"] for it in items if it.get("type") == "function_call"]
    assert len(calls) == len(set(calls)), calls
    seen = set()
    for it in items:
        if it.get("type") == "function_call":
            seen.add(it["call_id"])
        elif it.get("type") == "function_call_output":
            assert it["call_id"] in seen, f"function_call_output {it['call_id']} before (or without) its call"
    answered = {it["call_id"] for it in items if it.get("type") == "function_call_output"}
    assert set(calls) <= answered, f"function_call {set(calls) - answered} has no output"


def assert_reasoning_kept_whole(client_raw, forwarded_raw):
    """Reasoning items are the model's own, encrypted: each one forwarded is
    byte-identical to one the client sent, and a function_call forwarded
    keeps the reasoning item that came right before it (the API rejects a
    function_call whose reasoning item is missing)."""
    sent, got = raw_input_items(client_raw), raw_input_items(forwarded_raw)
    sent_items, got_items = [json.loads(x) for x in sent], [json.loads(x) for x in got]
    for text, item in zip(got, got_items):
        if item.get("type") == "reasoning":
            assert text in sent, "reasoning item changed: " + text[:200]
    before = {it["call_id"]: sent[k - 1] for k, it in enumerate(sent_items)
              if it.get("type") == "function_call" and k and sent_items[k - 1].get("type") == "reasoning"}
    for k, it in enumerate(got_items):
        if it.get("type") == "function_call" and it["call_id"] in before:
            assert k and got[k - 1] == before[it["call_id"]], f"{it['call_id']} lost its reasoning item"


def test_a_long_stateless_conversation_is_compacted(compacting_condense, small_upstream):
    recorder, _ = small_upstream
    items = long_input()
    assert_well_formed(items)
    resp = client(compacting_condense.base_url).responses.with_raw_response.create(
        model=MODEL, instructions="You are a build assistant.", input=items, tools=[READ_LOG],
        store=False, include=["reasoning.encrypted_content"], reasoning={"effort": "medium"})
    response = resp.parse()
    assert response.output_text == "The tool said: " + _tool_output(TURNS - 1)
    sent = recorder.last()
    client_raw = resp.http_request.content
    assert mock_responses.input_tokens(client_raw) > UPSTREAM_WINDOW  # the premise: it would overflow
    assert sent["bytes"] < len(client_raw), (sent["bytes"], len(client_raw))
    forwarded = sent["body"]["input"]
    assert_well_formed(forwarded)
    assert_reasoning_kept_whole(client_raw, sent["raw"])
    # The task, the instructions, the tools and the latest turn survive.
    assert forwarded[0] == TASK
    assert forwarded[-3:] == items[-3:]
    assert sent["body"]["instructions"] == "You are a build assistant."
    # The client's tools come first, unchanged; condense offers its recall
    # tool after them (the compacted request holds recall keys).
    assert sent["body"]["tools"][0] == READ_LOG
    assert [t["name"] for t in sent["body"]["tools"][1:]] == ["condense_recall"]
    assert sent["body"]["include"] == ["reasoning.encrypted_content"]
    assert sent["body"]["store"] is False
    actions = resp.headers.get("x-condense-actions")
    assert actions not in (None, "", "none"), resp.headers


def test_a_long_streamed_conversation_is_compacted(compacting_condense, small_upstream):
    recorder, _ = small_upstream
    items = long_input()
    c = client(compacting_condense.base_url)
    with c.responses.with_streaming_response.create(
            model=MODEL, input=items, tools=[READ_LOG], stream=True, store=False) as resp:
        assert resp.headers.get("x-condense-actions") not in (None, "", "none"), resp.headers
        frames = _sse_frames(resp.read().decode())
    assert frames[-1]["event"] == "response.completed"
    assert_well_formed(recorder.last()["body"]["input"])
    assert recorder.last()["bytes"] < len(json.dumps({"input": items}))


# A conversation between condense's budget and the mock's window: condense
# must compact it on its own (the test just below shows it does), except
# when previous_response_id says part of the conversation is kept upstream.
MID_TURNS = 16


def test_a_mid_size_conversation_is_compacted(compacting_condense, small_upstream):
    recorder, _ = small_upstream
    resp = client(compacting_condense.base_url).responses.with_raw_response.create(
        model=MODEL, input=long_input(MID_TURNS), tools=[READ_LOG], store=False)
    client_raw = resp.http_request.content
    assert WINDOW < mock_responses.input_tokens(client_raw) < UPSTREAM_WINDOW
    assert resp.headers.get("x-condense-actions") not in (None, "", "none"), resp.headers
    assert recorder.last()["bytes"] < len(client_raw)


def test_a_request_with_previous_response_id_is_forwarded_byte_identical(compacting_condense, small_upstream):
    recorder, _ = small_upstream
    c = client(compacting_condense.base_url)
    first = c.responses.create(model=MODEL, input="Say hello.", store=True)
    resp = c.responses.with_raw_response.create(
        model=MODEL, previous_response_id=first.id, input=long_input(MID_TURNS), tools=[READ_LOG])
    assert resp.parse().output_text.startswith("The tool said: ")
    assert recorder.last()["raw"] == resp.http_request.content
    assert resp.headers.get("x-condense-actions") == "none", resp.headers


def test_a_short_conversation_is_forwarded_byte_identical(compacting_condense, small_upstream):
    recorder, _ = small_upstream
    items = long_input(2)
    resp = client(compacting_condense.base_url).responses.with_raw_response.create(
        model=MODEL, input=items, tools=[READ_LOG], store=False)
    assert resp.parse().output_text.startswith("The tool said: ")
    assert recorder.last()["raw"] == resp.http_request.content
    assert recorder.last()["body"]["input"] == items
