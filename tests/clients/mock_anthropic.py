"""A mock Anthropic Messages upstream for the client-compatibility suites.

It speaks the Messages API wire format: POST /v1/messages answered with a
JSON message, or with Server-Sent Events when "stream" is true;
POST /v1/messages/count_tokens; GET /v1/models; errors in Anthropic's shape
`{"type":"error","error":{"type":...,"message":...},"request_id":...}`.
Every request it receives is recorded (method, path with query string,
headers, parsed body, raw bytes and their length, and the message it
answered) so tests can check what condense forwarded.

condense's summarizer calls (one user message quoting a <conversation>,
no tools) are answered with a checkpoint holding every section it asks
for (scripted_model.checkpoint), whatever the responder.

What to answer to a /v1/messages request is decided by a responder, a
function of the recorded request returning a message (`reply(...)`) or an
error (`Error(...)`); `keyword_responder` serves the Python SDK suite and
the Claude Code test brings its own scripted agent.
"""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import scripted_model
from mock_upstream import Recorder

MOCK_REQUEST_ID = "req_mock_anthropic_1"


class Error:
    """An upstream error: HTTP status, Anthropic error type, message."""

    def __init__(self, status, type_, message, headers=None):
        self.status, self.type, self.message = status, type_, message
        self.headers = headers or {}

    def body(self):
        return {"type": "error", "error": {"type": self.type, "message": self.message},
                "request_id": MOCK_REQUEST_ID}


def text(s):
    return {"type": "text", "text": s}


def tool_use(id_, name, input_):
    return {"type": "tool_use", "id": id_, "name": name, "input": input_}


def thinking(s):
    # The signature is opaque to clients; they must send it back unchanged
    # with the block on the next turn.
    return {"type": "thinking", "thinking": s, "signature": "c2lnbmF0dXJlLW9mLW1vY2s="}


def reply(content, stop_reason=None):
    """A response message; stop_reason defaults to tool_use when the content
    has a tool_use block, end_turn otherwise."""
    if stop_reason is None:
        stop_reason = "tool_use" if any(b["type"] == "tool_use" for b in content) else "end_turn"
    return {"content": content, "stop_reason": stop_reason}


def input_tokens(raw):
    """A stand-in for the real tokenizer: about four bytes a token."""
    return max(1, len(raw) // 4)


def output_tokens(content):
    return max(1, len(json.dumps(content)) // 4)


def request_text(msg):
    """All text of a message: its string content, its text blocks and the
    text inside its tool_result blocks."""
    content = msg.get("content")
    if isinstance(content, str):
        return content
    parts = []
    for block in content or []:
        if block.get("type") == "text":
            parts.append(block["text"])
        elif block.get("type") == "tool_result":
            inner = block.get("content")
            if isinstance(inner, str):
                parts.append(inner)
            else:
                parts.extend(b.get("text", "") for b in inner or [] if b.get("type") == "text")
    return "\n".join(parts)


def prompt_of(body):
    """The request as a scripted model reads it (scripted_model.Prompt):
    text blocks (and string contents), tool_use blocks and tool_result
    blocks in order; thinking is the model's own and not read back."""
    entries = []
    for msg in body.get("messages") or []:
        content = msg.get("content")
        if isinstance(content, str):
            entries.append(scripted_model.Entry("text", content))
            continue
        for block in content or []:
            kind = block.get("type")
            if kind == "text":
                entries.append(scripted_model.Entry("text", block.get("text", "")))
            elif kind == "tool_use":
                entries.append(scripted_model.Entry("call", call_id=block.get("id", ""), name=block.get("name", ""),
                                                    args=block.get("input") or {}))
            elif kind == "tool_result":
                entries.append(scripted_model.Entry("result", request_text({"content": [block]}),
                                                    call_id=block.get("tool_use_id", "")))
    tools = [t.get("name") for t in body.get("tools") or []]
    return scripted_model.Prompt(tools, entries)


def content_of(parts):
    """A scripted model's parts as content blocks: think as a thinking
    block, text as a text block, a call as a tool_use block."""
    blocks = []
    for p in parts:
        if p.kind == "think":
            blocks.append(thinking(p.text))
        elif p.kind == "text":
            blocks.append(text(p.text))
        else:
            blocks.append(tool_use(p.call_id, p.name, p.args))
    return blocks


def keyword_responder(request):
    """The Python SDK suite's behaviour, chosen by the last user message:
    - "RATE_LIMIT" / "BAD_REQUEST" / "OVERLOADED": Anthropic's 429 / 400 / 529;
    - "use the weather tool": a tool_use block for get_weather(city=Paris);
    - a tool_result block: an answer that quotes it;
    - otherwise "Hello from the mock.", after a thinking block when the
      request enables extended thinking.
    """
    body = request["body"]
    last = body["messages"][-1]
    said = request_text(last)
    if "RATE_LIMIT" in said:
        return Error(429, "rate_limit_error",
                     "This request would exceed the rate limit for your organization of 30,000 input tokens per minute.",
                     {"retry-after": "2"})
    if "BAD_REQUEST" in said:
        return Error(400, "invalid_request_error", "max_tokens: Field required")
    if "OVERLOADED" in said:
        return Error(529, "overloaded_error", "Overloaded")
    results = [b for b in last["content"] if b.get("type") == "tool_result"] if isinstance(last["content"], list) else []
    if results:
        return reply([text("The tool said: " + request_text({"content": [results[-1]]}))])
    if "use the weather tool" in said:
        return reply([text("Let me check."), tool_use("toolu_w1", "get_weather", {"city": "Paris"})])
    content = [text("Hello from the mock.")]
    if (body.get("thinking") or {}).get("type") == "enabled":
        content.insert(0, thinking("The user wants a greeting."))
    return reply(content)


def stream_events(message):
    """The Server-Sent Events Anthropic sends for a complete message, in
    order. Each block is opened with content_block_start carrying an empty
    shell (text "", tool_use input {}, thinking "" with signature ""), filled
    by content_block_delta events (text_delta, input_json_delta with pieces
    of the input's JSON text, thinking_delta then one signature_delta) and
    closed by content_block_stop. message_start carries the input usage and
    an output_tokens placeholder; message_delta carries stop_reason and the
    final output_tokens. A ping may come anywhere; the API sends one right
    after message_start."""
    start = dict(message, content=[], stop_reason=None, stop_sequence=None,
                 usage=dict(message["usage"], output_tokens=1))
    yield "message_start", {"type": "message_start", "message": start}
    yield "ping", {"type": "ping"}
    for i, block in enumerate(message["content"]):
        kind = block["type"]
        if kind == "text":
            shell, deltas = {"type": "text", "text": ""}, [
                {"type": "text_delta", "text": piece} for piece in _pieces(block["text"])]
        elif kind == "tool_use":
            shell = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": piece}
                      for piece in _pieces(json.dumps(block["input"]))]
        elif kind == "thinking":
            shell = {"type": "thinking", "thinking": "", "signature": ""}
            deltas = [{"type": "thinking_delta", "thinking": piece} for piece in _pieces(block["thinking"])]
            deltas.append({"type": "signature_delta", "signature": block["signature"]})
        else:
            raise ValueError(kind)
        yield "content_block_start", {"type": "content_block_start", "index": i, "content_block": shell}
        for delta in deltas:
            yield "content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta}
        yield "content_block_stop", {"type": "content_block_stop", "index": i}
    yield "message_delta", {"type": "message_delta",
                            "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
                            "usage": {"output_tokens": message["usage"]["output_tokens"]}}
    yield "message_stop", {"type": "message_stop"}


def _pieces(s, size=16):
    """Splits s into deltas (an empty string still gets one delta)."""
    return [s[i:i + size] for i in range(0, len(s), size)] or [""]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    recorder = None  # set by start()
    responder = None  # set by start()

    def log_message(self, *args):
        pass

    def _record(self, body, raw):
        request = {"method": self.command, "path": self.path,
                   "headers": {k.lower(): v for k, v in self.headers.items()},
                   "body": body, "raw": raw, "bytes": len(raw)}
        self.recorder.add(request)
        return request

    def _send_json(self, status, obj, extra_headers=None):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("request-id", MOCK_REQUEST_ID)
        for k, v in (extra_headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _not_found(self):
        self._send_json(404, Error(404, "not_found_error", f"Not found: {self.command} {self.path}").body())

    def do_HEAD(self):
        # Clients probe the base URL for reachability with HEAD.
        self._record(None, b"")
        self._send_json(200, {})

    def do_GET(self):
        self._record(None, b"")
        path = self.path.split("?")[0]
        if path == "/v1/models":
            models = [{"type": "model", "id": m, "display_name": m, "created_at": "2025-01-01T00:00:00Z"}
                      for m in ("claude-sonnet-4-5", "claude-haiku-4-5")]
            self._send_json(200, {"data": models, "has_more": False,
                                  "first_id": models[0]["id"], "last_id": models[-1]["id"]})
        else:
            self._not_found()

    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        request = self._record(body, raw)
        path = self.path.split("?")[0]  # Claude Code adds ?beta=true
        if body is None:
            self._send_json(400, Error(400, "invalid_request_error", "body is not JSON").body())
        elif path == "/v1/messages/count_tokens":
            self._send_json(200, {"input_tokens": input_tokens(raw)})
        elif path == "/v1/messages":
            if scripted_model.is_summary_call(body):
                request["summary"] = True
                answer = reply([text(scripted_model.checkpoint(scripted_model.summary_prompt(body)))])
            else:
                answer = self.responder(request)
            if isinstance(answer, Error):
                self._send_json(answer.status, answer.body(), answer.headers)
                return
            message = {"id": "msg_mock_%d" % time.monotonic_ns(), "type": "message", "role": "assistant",
                       "model": body.get("model"), "content": answer["content"],
                       "stop_reason": answer["stop_reason"], "stop_sequence": None,
                       "usage": {"input_tokens": input_tokens(raw), "output_tokens": output_tokens(answer["content"]),
                                 "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}
            request["response"] = message
            if body.get("stream"):
                self._stream(message)
            else:
                self._send_json(200, message)
        else:
            self._not_found()

    def _stream(self, message):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("request-id", MOCK_REQUEST_ID)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for event, data in stream_events(message):
            # Anthropic names every event twice: in the SSE "event:" field and
            # in the JSON's "type".
            frame = "event: %s\ndata: %s\n\n" % (event, json.dumps(data, separators=(",", ":")))
            self._write_chunk(frame.encode())
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _write_chunk(self, data):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()


def start(responder=keyword_responder):
    """Starts the mock on a free port; returns (server, recorder, base_url),
    base_url in condense's upstream shape http://127.0.0.1:PORT/v1."""
    recorder = Recorder()
    handler = type("BoundAnthropicHandler", (Handler,), {"recorder": recorder, "responder": staticmethod(responder)})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, recorder, "http://127.0.0.1:%d/v1" % server.server_address[1]


def read_stream(raw):
    """What a client makes of a Messages event stream (bytes): the events
    as (name, data) pairs, and the message they build: its id, content
    blocks in index order (text, thinking, tool_use with input parsed),
    stop_reason and usage, and checks a test may want: how many
    message_start and message_stop events came, the index of each
    content_block_start in order, and the deltas per block."""
    import client_tap
    events = [(name, json.loads(data)) for name, data in client_tap.sse_events(raw)]
    msg = {"id": None, "content": {}, "stop_reason": None, "usage": {}, "starts": 0, "stops": 0,
           "indices": [], "deltas": {}, "deltas_events": 0}
    partial = {}
    for _, e in events:
        kind = e.get("type")
        if kind == "message_start":
            msg["starts"] += 1
            msg["id"] = e["message"]["id"]
            msg["usage"].update(e["message"].get("usage") or {})
        elif kind == "content_block_start":
            i = e["index"]
            msg["indices"].append(i)
            msg["content"][i] = dict(e["content_block"])
            msg["deltas"][i] = 0
        elif kind == "content_block_delta":
            i, d = e["index"], e["delta"]
            block = msg["content"][i]
            msg["deltas"][i] += 1
            if d["type"] == "text_delta":
                block["text"] += d["text"]
            elif d["type"] == "thinking_delta":
                block["thinking"] += d["thinking"]
            elif d["type"] == "signature_delta":
                block["signature"] = d["signature"]
            elif d["type"] == "input_json_delta":
                partial[i] = partial.get(i, "") + d["partial_json"]
        elif kind == "message_delta":
            msg["stop_reason"] = e["delta"].get("stop_reason")
            msg["usage"].update(e.get("usage") or {})
        elif kind == "message_stop":
            msg["stops"] += 1
    for i, text in partial.items():
        msg["content"][i]["input"] = json.loads(text) if text else {}
    msg["blocks"] = [msg["content"][i] for i in sorted(msg["content"])]
    return events, msg
