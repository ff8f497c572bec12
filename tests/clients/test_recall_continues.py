"""A recall after text, seen through the official SDKs' stream
accumulators: Anthropic's `messages.stream(...).get_final_message()` and
OpenAI's `responses.stream(...).get_final_response()`.

The mock model below (Messages and Responses, streamed as the providers
stream: pings, content parts, sequence numbers) writes a sentence, then
calls `condense_recall` with the first recall key in its prompt; given the
original back, it answers with the marker line the original holds. Through
condense the SDK must get one well-formed message: the sentence, then the
answer, the final stop reason, the usage of both rounds, and never the
call. The conversation holds twelve large tool outputs and the window is
8k tokens, so condense masks the early ones and offers the tool.
"""

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anthropic
import openai
import pytest

from conftest import Condense, scrape_metrics

LEAD = "Let me check the first file again."
KEY = re.compile(r"recall key: ([A-Za-z0-9_-]{6,64})(?![A-Za-z0-9_-])")
MARKER = re.compile(r"MARKER-[0-9a-f]{12}")
CONFIG = """
[[models]]
match = "agent-*"
context_window = 8192
"""


def output(t):
    """Tool output t: 60 lines, the first file's with a marker line."""
    lines = ["%4d let v%d_%d = parse(&input[%d..]);" % (n, t, n, n) for n in range(60)]
    if t == 0:
        lines.insert(30, "note: MARKER-0123456789ab is the build id")
    return "\n".join(lines) + "\n"


def words(text):
    out = [w + " " for w in text.split(" ")]
    out[-1] = out[-1][:-1]
    return out


class Model(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen = None  # set by the fixture: (path, body, prompt tokens) received

    def log_message(self, *args):
        pass

    def do_GET(self):
        self._send(200, "application/json", json.dumps({"object": "list", "data": []}).encode())

    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        body = json.loads(raw)
        self.seen.append((self.path, body, len(raw) // 4))
        text = raw.decode()
        names = [t.get("name") or (t.get("function") or {}).get("name") for t in body.get("tools") or []]
        recalled = "recall_1" in text
        key = KEY.search(text)
        if "condense_recall" in names and key and not recalled:
            reply = (LEAD, key.group(1))
        else:
            found = MARKER.search(text) if recalled else None
            reply = ("The build id is %s." % (found.group(0) if found else "UNKNOWN"), None)
        prompt = len(raw) // 4
        if self.path == "/v1/messages":
            events = messages_events(reply, prompt)
        else:
            events = responses_events(reply, prompt)
        out = "".join("event: %s\ndata: %s\n\n" % (e["type"], json.dumps(e)) for e in events)
        self._send(200, "text/event-stream", out.encode())

    def _send(self, status, kind, data):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def messages_events(reply, prompt):
    text, key = reply
    events = [{"type": "message_start", "message": {
        "id": "msg_%d" % prompt, "type": "message", "role": "assistant", "model": "agent-small",
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": prompt, "output_tokens": 1}}}, {"type": "ping"}]
    events.append({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
    events += [{"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": w}}
               for w in words(text)]
    events.append({"type": "content_block_stop", "index": 0})
    if key:
        args = json.dumps({"key": key})
        events.append({"type": "content_block_start", "index": 1, "content_block": {
            "type": "tool_use", "id": "recall_1", "name": "condense_recall", "input": {}}})
        events += [{"type": "content_block_delta", "index": 1,
                    "delta": {"type": "input_json_delta", "partial_json": p}}
                   for p in (args[:5], args[5:])]
        events.append({"type": "content_block_stop", "index": 1})
    events.append({"type": "message_delta", "delta": {
        "stop_reason": "tool_use" if key else "end_turn", "stop_sequence": None},
        "usage": {"output_tokens": 7}})
    events.append({"type": "message_stop"})
    return events


def responses_events(reply, prompt):
    text, key = reply
    rid = "resp_%d" % prompt
    usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 7,
             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + 7}
    base = {"id": rid, "object": "response", "created_at": 1, "model": "agent-small",
            "status": "in_progress", "output": [], "parallel_tool_calls": True, "tool_choice": "auto",
            "tools": []}
    msg_id = "msg_%d" % prompt
    message = {"type": "message", "id": msg_id, "status": "completed", "role": "assistant",
               "content": [{"type": "output_text", "text": text, "annotations": []}]}
    events = [{"type": "response.created", "response": base},
              {"type": "response.in_progress", "response": base},
              {"type": "response.output_item.added", "output_index": 0,
               "item": {**message, "status": "in_progress", "content": []}},
              {"type": "response.content_part.added", "output_index": 0, "item_id": msg_id,
               "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}}]
    events += [{"type": "response.output_text.delta", "output_index": 0, "item_id": msg_id,
                "content_index": 0, "delta": w} for w in words(text)]
    events += [{"type": "response.output_text.done", "output_index": 0, "item_id": msg_id,
                "content_index": 0, "text": text},
               {"type": "response.content_part.done", "output_index": 0, "item_id": msg_id,
                "content_index": 0, "part": message["content"][0]},
               {"type": "response.output_item.done", "output_index": 0, "item": message}]
    output = [message]
    if key:
        args = json.dumps({"key": key})
        call = {"type": "function_call", "id": "fc_%d" % prompt, "call_id": "recall_1",
                "name": "condense_recall", "arguments": args, "status": "completed"}
        events += [{"type": "response.output_item.added", "output_index": 1,
                    "item": {**call, "arguments": "", "status": "in_progress"}},
                   {"type": "response.function_call_arguments.delta", "output_index": 1,
                    "item_id": call["id"], "delta": args},
                   {"type": "response.function_call_arguments.done", "output_index": 1,
                    "item_id": call["id"], "arguments": args},
                   {"type": "response.output_item.done", "output_index": 1, "item": call}]
        output.append(call)
    events.append({"type": "response.completed",
                   "response": {**base, "status": "completed", "output": output, "usage": usage}})
    for n, e in enumerate(events):
        e["sequence_number"] = n
    return events


@pytest.fixture
def setup(tmp_path):
    seen = []
    handler = type("BoundModel", (Model,), {"seen": seen})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = "http://127.0.0.1:%d/v1" % server.server_address[1]
    (tmp_path / "condense.toml").write_text(CONFIG)
    condense = Condense(url, extra_env={"CONDENSE_UPSTREAM__ANTHROPIC_BASE_URL": url},
                        args=("--config", str(tmp_path / "condense.toml")))
    try:
        yield condense, seen
    finally:
        condense.stop()
        server.shutdown()


def test_the_anthropic_sdk_gets_one_message_that_goes_on_after_the_sentence(setup):
    condense, seen = setup
    messages = [{"role": "user", "content": "What is the build id? Read the files first."}]
    for t in range(12):
        messages.append({"role": "assistant", "content": [
            {"type": "text", "text": "Reading file %d." % t},
            {"type": "tool_use", "id": "toolu_%d" % t, "name": "run", "input": {"cmd": "cat f%d" % t}}]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_%d" % t, "content": output(t)}]})
    client = anthropic.Anthropic(base_url=condense.base_url.removesuffix("/v1"), api_key="sk-ant-test",
                                 max_retries=0)
    with client.messages.stream(model="agent-small", max_tokens=256, messages=messages, tools=[{
            "name": "run", "description": "Runs a command",
            "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["text", "text"]
    assert final.content[0].text == LEAD
    assert final.content[1].text == "The build id is MARKER-0123456789ab."
    assert final.stop_reason == "end_turn"
    assert kinds.count("message_start") == 1 and kinds.count("message_stop") == 1
    assert len(seen) == 2
    # Both rounds' prompts, as the mock counted them.
    assert final.usage.input_tokens == sum(p for *_, p in seen)
    assert final.usage.output_tokens == 14
    metrics = scrape_metrics(condense)
    assert metrics[("condense_recalls_total", frozenset({("outcome", "answered")}))] == 1
    assert metrics[("condense_recalls_total", frozenset({("outcome", "stripped")}))] == 0


def test_the_openai_sdk_gets_one_response_that_goes_on_after_the_sentence(setup):
    condense, seen = setup
    items = [{"role": "user", "content": "What is the build id? Read the files first."}]
    for t in range(12):
        items.append({"type": "function_call", "call_id": "call_%d" % t, "name": "run",
                      "arguments": json.dumps({"cmd": "cat f%d" % t})})
        items.append({"type": "function_call_output", "call_id": "call_%d" % t, "output": output(t)})
    client = openai.OpenAI(base_url=condense.base_url, api_key="sk-test", max_retries=0)
    with client.responses.stream(model="agent-small", input=items, store=False, tools=[{
            "type": "function", "name": "run", "description": "Runs a command",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert [i.type for i in final.output] == ["message", "message"]
    assert final.output_text == LEAD + "The build id is MARKER-0123456789ab."
    assert kinds.count("response.created") == 1 and kinds.count("response.completed") == 1
    assert len(seen) == 2
    assert final.usage.output_tokens == 14
    assert final.usage.input_tokens == sum(p for *_, p in seen)
    # The follow-up carried the sentence and the call, then the original.
    sent = seen[1][1]["input"]
    assert sent[-3]["content"][0]["text"] == LEAD
    assert sent[-2]["name"] == "condense_recall"
    assert sent[-1]["output"] == output(0)
