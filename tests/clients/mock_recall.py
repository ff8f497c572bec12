"""A scripted mock model for the recall test (test_recall_sdk.py).

It answers POST /v1/chat/completions the way OpenAI does (JSON, or
Server-Sent Events when "stream" is true, with a final usage chunk when
stream_options.include_usage is set, then `data: [DONE]`) and GET
/v1/models (an empty listing, so condense takes the window from its
[[models]] profile). Every request is recorded (method, path, parsed body,
raw bytes, and the answer it got: the assistant message and the usage
reported), so the test sees both rounds of a request condense answered a
recall in.

The script, decided by the conversation alone (not by how many requests
came before, since condense may rewrite old turns):
- until the client has run its own tool `read_log` READS times, the next
  `read_log` call (id "call_read_<n>", arguments {"n": <n>});
- then, when the request offers `condense_recall`, a message holds
  `recall key: K` and no tool result answers a call with an id starting
  "recall_" yet, a call of `condense_recall` with the first such key
  (id "recall_<n>", finish_reason "tool_calls");
- otherwise the final text: "done: read <READS> logs", followed by
  "; recalled <K> (<chars> chars)" when a recall was answered, so the
  client's last answer tells what the model got back.

Started with lead=True, it writes a sentence before every call, as Claude
and GPT models mostly do (streamed word by word before the call's deltas):
"Reading log <n>." and, before the recall, LEAD_RECALL.
"""

import itertools
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from mock_upstream import Recorder

READS = 14
RECALL_TOOL = "condense_recall"
RECALL_PREFIX = "recall_"
KEY = re.compile(r"recall key: ([A-Za-z0-9_-]{6,64})(?![A-Za-z0-9_-])")
LEAD_RECALL = "Let me look at that earlier log again."
_ids = itertools.count(1)


def text_of(content):
    """A message's content as text (a string, or the text of its parts)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def reads_done(messages):
    """The highest n of the read_log results in the conversation (0: none)."""
    done = [int(m.group(1)) for msg in messages if msg.get("role") == "tool"
            for m in [re.match(r"call_read_(\d+)$", msg.get("tool_call_id", ""))] if m]
    return max(done, default=0)


def recall_key(body):
    """The key to recall: the first one the messages hold, when the tool is
    offered and nothing was recalled yet; else None."""
    messages = body["messages"]
    offered = any((t.get("function") or {}).get("name") == RECALL_TOOL for t in body.get("tools") or [])
    recalled = any(m.get("role") == "tool" and m.get("tool_call_id", "").startswith(RECALL_PREFIX)
                   for m in messages)
    if not offered or recalled:
        return None
    for m in messages:
        found = KEY.search(text_of(m.get("content")))
        if found:
            return found.group(1)
    return None


def tool_call(call_id, name, arguments):
    return {"role": "assistant", "content": None, "tool_calls": [{
        "id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def answer(body, lead=False):
    """The assistant message for a request and its finish_reason."""
    messages = body["messages"]
    done = reads_done(messages)
    if done < READS:
        call = tool_call("call_read_%d" % (done + 1), "read_log", {"n": done + 1})
        if lead:
            call["content"] = "Reading log %d." % (done + 1)
        return call, "tool_calls"
    key = recall_key(body)
    if key:
        call = tool_call("%s%d" % (RECALL_PREFIX, next(_ids)), RECALL_TOOL, {"key": key})
        if lead:
            call["content"] = LEAD_RECALL
        return call, "tool_calls"
    text = "done: read %d logs" % done
    # The recall this conversation had: the call and its result.
    calls = {c["id"]: json.loads(c["function"]["arguments"])["key"]
             for m in messages if m.get("role") == "assistant" for c in m.get("tool_calls") or []
             if c["function"]["name"] == RECALL_TOOL}
    for m in messages:
        if m.get("role") == "tool" and m.get("tool_call_id") in calls:
            text += "; recalled %s (%d chars)" % (calls[m["tool_call_id"]], len(text_of(m["content"])))
    return {"role": "assistant", "content": text}, "stop"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    recorder = None  # set by start()
    lead = False  # set by start()

    def log_message(self, *args):
        pass

    def _send_json(self, status, obj):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.recorder.add({"method": "GET", "path": self.path, "body": None, "bytes": 0})
        if self.path.startswith("/v1/models"):
            self._send_json(200, {"object": "list", "data": []})
        else:
            self._send_json(404, {"error": {"message": "not found", "type": "invalid_request_error",
                                            "param": None, "code": None}})

    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        body = json.loads(raw)
        entry = {"method": "POST", "path": self.path, "body": body, "bytes": len(raw)}
        self.recorder.add(entry)
        if self.path != "/v1/chat/completions":
            self._send_json(404, {"error": {"message": "not found", "type": "invalid_request_error",
                                            "param": None, "code": None}})
            return
        message, finish = answer(body, self.lead)
        prompt_tokens = len(raw) // 4
        completion_tokens = max(1, len(json.dumps(message)) // 4)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        entry["answer"] = {"message": message, "usage": usage}
        completion_id = "chatcmpl-recall-%d" % next(_ids)
        if body.get("stream"):
            self._stream(body, completion_id, message, finish, usage)
        else:
            self._send_json(200, {
                "id": completion_id, "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model"),
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": usage,
            })

    def _stream(self, body, completion_id, message, finish, usage):
        """The answer as OpenAI streams it: the role first (with the start of
        the tool call, whose arguments follow in pieces), the text word by
        word, the finish_reason, then the usage chunk when asked for."""
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def chunk(delta, finish_reason=None):
            c = {"id": completion_id, "object": "chat.completion.chunk", "created": int(time.time()),
                 "model": body.get("model"),
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}
            if include_usage:
                c["usage"] = None
            return c

        events = []
        if message.get("content"):
            events.append(chunk({"role": "assistant", "content": ""}))
            words = message["content"].split(" ")
            for i, word in enumerate(words):
                events.append(chunk({"content": word if i == len(words) - 1 else word + " "}))
        if message.get("tool_calls"):
            call = message["tool_calls"][0]
            arguments = call["function"]["arguments"]
            half = len(arguments) // 2
            start = {"tool_calls": [{
                "index": 0, "id": call["id"], "type": "function",
                "function": {"name": call["function"]["name"], "arguments": ""}}]}
            if not events:
                start = {"role": "assistant", "content": None, **start}
            events.append(chunk(start))
            for piece in (arguments[:half], arguments[half:]):
                events.append(chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}))
        events.append(chunk({}, finish))
        if include_usage:
            events.append({"id": completion_id, "object": "chat.completion.chunk", "created": int(time.time()),
                           "model": body.get("model"), "choices": [], "usage": usage})
        for ev in events:
            self._write_chunk(("data: " + json.dumps(ev) + "\n\n").encode())
        self._write_chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")

    def _write_chunk(self, data):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()


def start(lead=False):
    """Starts the mock on a free port; returns (server, recorder, base_url),
    base_url in condense's upstream shape http://127.0.0.1:PORT/v1. With
    lead, the model writes a sentence before every call."""
    recorder = Recorder()
    handler = type("BoundRecallHandler", (Handler,), {"recorder": recorder, "lead": lead})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, recorder, "http://127.0.0.1:%d/v1" % server.server_address[1]
