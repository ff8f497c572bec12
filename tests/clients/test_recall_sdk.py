"""Reversible compaction seen from the official OpenAI Python SDK: a tool
loop through condense, against the scripted mock model of mock_recall.py,
with a window small enough that the loop's large tool outputs are masked.

The mock has the client run `read_log` mock_recall.READS times, then,
offered `condense_recall`, recalls the first key it finds in the prompt,
then gives its final text. condense must answer that recall itself, inside
the client's request: the SDK only ever sees `read_log` calls and the final
text, the upstream gets the original output back verbatim, and the usage
the client gets covers both upstream calls. Run once with stream=False,
once with stream=True (accumulated by the SDK's stream helper, with
stream_options.include_usage), and both again with a model that writes a
sentence before every call: the sentence before condense_recall reaches
the client, and the answer goes on after it in the same message.
"""

import json
import secrets
import time

import pytest
from openai import OpenAI

import mock_recall
from conftest import Condense, scrape_metrics

MODEL = "agent-small"
API_KEY = "sk-test"
TASK = "Read the logs one by one with read_log, then report."
# A window of 8192 tokens leaves a prompt budget of about 5k tokens: the
# ~2.5 KB outputs pass it after about eight calls, and from then on older
# ones are masked, each placeholder carrying its recall key.
CONFIG = """
# Written by tests/clients/test_recall_sdk.py: a small window for the
# loop's model, so its read_log outputs must be masked.
[[models]]
match = "agent-*"
context_window = 8192
"""
READ_LOG = {"type": "function", "function": {
    "name": "read_log", "description": "Read log number n.",
    "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}


def log_text(n):
    """Log n as read_log returns it: 60 lines, ~2.5 KB, with a marker no
    other call's output has."""
    marker = "MARKER-%d-%s" % (n, secrets.token_hex(6))
    return "\n".join("%s %02d seg %05d w%d ok" % (marker, k, n * 100 + k, k % 7) for k in range(60))


class Run:
    """One tool loop through condense, and what each side saw."""


def _complete(client, messages, stream):
    """One turn: the completion the SDK returned and the tool calls the
    client received (from every chunk too, when streamed)."""
    if not stream:
        completion = client.chat.completions.create(model=MODEL, messages=messages, tools=[READ_LOG])
        return completion, [], list(completion.choices[0].message.tool_calls or [])
    with client.chat.completions.stream(model=MODEL, messages=messages, tools=[READ_LOG],
                                        stream_options={"include_usage": True}) as s:
        chunks = [ev.chunk for ev in s if ev.type == "chunk"]
        completion = s.get_final_completion()
    deltas = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    return completion, chunks, deltas + list(completion.choices[0].message.tool_calls or [])


def _run(tmp_path, stream, lead=False):
    (tmp_path / "condense.toml").write_text(CONFIG)
    server, recorder, url = mock_recall.start(lead)
    condense = Condense(url, args=("--config", str(tmp_path / "condense.toml")))
    client = OpenAI(base_url=condense.base_url, api_key=API_KEY, max_retries=0, timeout=60)
    r = Run()
    r.outputs = {}  # tool_call_id -> what read_log returned
    r.calls = []  # every tool call the client received (chunk deltas included)
    r.last_chunks = []  # the chunks of the last turn, when streamed
    messages = [{"role": "user", "content": TASK}]
    start = time.monotonic()
    try:
        for _ in range(mock_recall.READS + 5):
            completion, r.last_chunks, calls = _complete(client, messages, stream)
            r.calls += calls
            message = completion.choices[0].message
            if not message.tool_calls:
                break
            messages.append({"role": "assistant", "content": message.content, "tool_calls": [
                {"id": tc.id, "type": "function",
                 "function": {"name": tc.function.name, "arguments": tc.function.arguments}}
                for tc in message.tool_calls]})
            for tc in message.tool_calls:
                r.outputs[tc.id] = log_text(json.loads(tc.function.arguments)["n"])
                messages.append({"role": "tool", "tool_call_id": tc.id, "content": r.outputs[tc.id]})
        r.final = completion
        r.seconds = time.monotonic() - start
        r.metrics = scrape_metrics(condense)
    finally:
        condense.stop()
        server.shutdown()
    r.posts = [q for q in recorder.requests if q["method"] == "POST"]
    r.lead = lead
    print("\nrecall via the OpenAI SDK (stream=%s, lead=%s): %.1fs, %d upstream requests"
          % (stream, lead, r.seconds, len(r.posts)))
    return r


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("recall_json"), stream=False)


@pytest.fixture(scope="module")
def streamed_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("recall_stream"), stream=True)


@pytest.fixture(scope="module")
def lead_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("recall_lead_json"), stream=False, lead=True)


@pytest.fixture(scope="module")
def lead_streamed_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("recall_lead_stream"), stream=True, lead=True)


RUNS = ["run", "streamed_run", "lead_run", "lead_streamed_run"]


def recalled(r):
    """The recall: the index in r.posts of the request the mock answered
    with its condense_recall call, that call, the key it asked for, and the
    tool_call_id of the read_log output whose placeholder carries the key."""
    rounds = [(i, call) for i, q in enumerate(r.posts)
              for call in q["answer"]["message"].get("tool_calls") or []
              if call["function"]["name"] == mock_recall.RECALL_TOOL]
    assert len(rounds) == 1, rounds
    i, call = rounds[0]
    key = json.loads(call["function"]["arguments"])["key"]
    holders = [m["tool_call_id"] for m in r.posts[i]["body"]["messages"]
               if m["role"] == "tool" and f"recall key: {key}" in m["content"]]
    assert len(holders) == 1, holders
    return i, call, key, holders[0]


@pytest.mark.parametrize("which", RUNS)
def test_the_loop_ends_with_the_final_text(which, request):
    r = request.getfixturevalue(which)
    _, _, key, holder = recalled(r)
    # The mock's final text names what it got back from the recall; the
    # sentence it wrote before the recall comes first, in the same message.
    final = "done: read %d logs; recalled %s (%d chars)" % (mock_recall.READS, key, len(r.outputs[holder]))
    if r.lead:
        final = mock_recall.LEAD_RECALL + "\n\n" + final
    assert r.final.choices[0].message.content == final
    assert r.final.choices[0].finish_reason == "stop"
    assert len(r.outputs) == mock_recall.READS
    # One upstream request per client request, one more for the recall: no
    # summarizer call, nothing retried.
    assert len(r.posts) == mock_recall.READS + 2
    assert all(q["path"] == "/v1/chat/completions" for q in r.posts)


@pytest.mark.parametrize("which", RUNS)
def test_the_client_never_sees_condense_recall(which, request):
    r = request.getfixturevalue(which)
    # Streamed, the name comes in the call's first delta (None after it).
    names = [tc.function.name for tc in r.calls if tc.function and tc.function.name is not None]
    assert names and set(names) == {"read_log"}, names
    # The condense_recall turn went upstream once, in the request condense
    # sent itself; the client never had it to send back.
    holding = [i for i, q in enumerate(r.posts) for m in q["body"]["messages"]
               if m["role"] == "assistant"
               and any(c["function"]["name"] == mock_recall.RECALL_TOOL for c in m.get("tool_calls") or [])]
    assert holding == [len(r.posts) - 1]


@pytest.mark.parametrize("which", RUNS)
def test_the_recalled_output_goes_upstream_verbatim(which, request):
    r = request.getfixturevalue(which)
    i, call, key, holder = recalled(r)
    asked, again = r.posts[i]["body"], r.posts[i + 1]["body"]
    # condense_recall was offered after the client's own tool.
    assert [t["function"]["name"] for t in asked["tools"]] == ["read_log", mock_recall.RECALL_TOOL]
    recall = asked["tools"][1]
    assert recall["type"] == "function"
    assert recall["function"]["parameters"]["required"] == ["key"]
    assert recall["function"]["parameters"]["properties"]["key"]["type"] == "string"
    # The output the key stands for was masked in the prompt the mock saw.
    placeholder = next(m["content"] for m in asked["messages"] if m.get("tool_call_id") == holder)
    assert placeholder.startswith(f"[condense: recall key: {key};"), placeholder
    assert len(placeholder) < len(r.outputs[holder])
    # The request condense sent after the call: the same request, then the
    # model's turn and the original, byte for byte.
    assert {k: v for k, v in again.items() if k != "messages"} == {k: v for k, v in asked.items() if k != "messages"}
    assert again["messages"][:-2] == asked["messages"]
    turn, result = again["messages"][-2:]
    assert turn["role"] == "assistant" and turn["tool_calls"] == [call]
    assert turn["content"] == (mock_recall.LEAD_RECALL if r.lead else None)
    assert set(result) == {"role", "tool_call_id", "content"}
    assert (result["role"], result["tool_call_id"]) == ("tool", call["id"])
    assert [cid for cid, text in r.outputs.items() if text == result["content"]] == [holder]


@pytest.mark.parametrize("which", RUNS)
def test_metrics_count_the_masking_and_the_recall(which, request):
    r = request.getfixturevalue(which)
    *_, holder = recalled(r)

    def sample(name, **labels):
        return r.metrics[(name, frozenset(labels.items()))]

    assert sample("condense_compactions_total", stage="mask") > 0
    assert sample("condense_recalls_total", outcome="answered") == 1
    for outcome in ("unknown_key", "limit_reached", "stripped", "failed"):
        assert sample("condense_recalls_total", outcome=outcome) == 0, outcome
    assert sample("condense_recalled_bytes_total") == len(r.outputs[holder])


@pytest.mark.parametrize("which", RUNS)
def test_the_usage_covers_both_upstream_calls(which, request):
    r = request.getfixturevalue(which)
    i = recalled(r)[0]
    first, second = (r.posts[k]["answer"]["usage"] for k in (i, i + 1))
    usage = r.final.usage
    if which.endswith("streamed_run"):
        # The stream's last chunk is the usage chunk (choices empty).
        assert r.last_chunks[-1].choices == []
        usage = r.last_chunks[-1].usage
        assert r.final.usage == usage
    assert usage.prompt_tokens > second["prompt_tokens"]
    for field in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert getattr(usage, field) == first[field] + second[field], field
