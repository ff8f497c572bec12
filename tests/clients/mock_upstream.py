"""A mock OpenAI-compatible upstream for the client-compatibility suite.

It answers /v1/chat/completions the way OpenAI does (JSON, or Server-Sent
Events when "stream" is true, with a usage chunk only when
stream_options.include_usage is set) and records every request it receives
so the tests can check what condense forwarded.

Behaviour is chosen by the last message of the conversation:
- a user message containing "use the weather tool" gets a tool call back;
- a tool message gets an answer that quotes the tool result;
- a user message containing "RATE_LIMIT" gets OpenAI's 429 error body;
- a user message containing "BAD_REQUEST" gets a 400 error body;
- a streamed request whose user message contains "CUT_STREAM" gets one
  event, then a connection reset;
- anything else gets "Hello from the mock.".
"""

import json
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Recorder:
    def __init__(self):
        self.requests = []
        self.lock = threading.Lock()

    def add(self, item):
        with self.lock:
            self.requests.append(item)

    def last(self):
        with self.lock:
            return self.requests[-1]


def _error(message, type_, code):
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    recorder = None  # set by start()

    def log_message(self, *args):
        pass

    def _send_json(self, status, obj, extra_headers=None):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("x-request-id", "req_mock_123")
        for k, v in (extra_headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.recorder.add({"method": "GET", "path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}, "body": None})
        if self.path.startswith("/v1/models"):
            self._send_json(200, {"object": "list", "data": [
                {"id": "gpt-4o", "object": "model", "created": 1, "owned_by": "mock"}]})
        else:
            self._send_json(404, _error("not found", "invalid_request_error", None))

    def do_POST(self):
        length = int(self.headers.get("Content-Length", "0"))
        raw = self.rfile.read(length)
        body = json.loads(raw)
        self.recorder.add({"method": "POST", "path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}, "body": body})
        if self.path != "/v1/chat/completions":
            self._send_json(404, _error("not found", "invalid_request_error", None))
            return
        last = body["messages"][-1]
        text = last.get("content") or ""
        if isinstance(text, list):
            text = " ".join(p.get("text", "") for p in text if isinstance(p, dict))
        if "RATE_LIMIT" in text:
            self._send_json(429, _error("Rate limit reached for gpt-4o on tokens per min (TPM): Limit 30000, Used 30000, Requested 500.",
                                        "tokens", "rate_limit_exceeded"), {"Retry-After": "2"})
            return
        if "BAD_REQUEST" in text:
            self._send_json(400, _error("Invalid value for 'temperature'.", "invalid_request_error", "invalid_value"))
            return
        prompt_tokens = len(raw) // 4
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 5, "total_tokens": prompt_tokens + 5}
        if last.get("role") == "user" and "use the weather tool" in text:
            message = {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_w1", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]}
            finish = "tool_calls"
        elif last.get("role") == "tool":
            message = {"role": "assistant", "content": "The tool said: " + last["content"]}
            finish = "stop"
        else:
            message = {"role": "assistant", "content": "Hello from the mock."}
            finish = "stop"
        if body.get("stream") and "CUT_STREAM" in text:
            self._cut_stream(body)
        elif body.get("stream"):
            self._stream(body, message, finish, usage)
        else:
            self._send_json(200, {
                "id": "chatcmpl-mock", "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model"),
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": usage,
            })

    def _stream(self, body, message, finish, usage):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def chunk(delta, finish_reason=None):
            c = {"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 1,
                 "model": body.get("model"),
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}
            if include_usage:
                c["usage"] = None
            return c

        events = [chunk({"role": "assistant", "content": ""})]
        if message.get("content"):
            for word in message["content"].split(" "):
                events.append(chunk({"content": word + " "}))
        for i, call in enumerate(message.get("tool_calls") or []):
            events.append(chunk({"tool_calls": [{"index": i, **call}]}))
        events.append(chunk({}, finish))
        if include_usage:
            events.append({"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 1,
                           "model": body.get("model"), "choices": [], "usage": usage})
        for ev in events:
            self._write_chunk(("data: " + json.dumps(ev) + "\n\n").encode())
            time.sleep(0.01)
        self._write_chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")

    def _cut_stream(self, body):
        """Sends one event, then resets the connection."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        ev = {"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 1, "model": body.get("model"),
              "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hel"}, "finish_reason": None}]}
        self._write_chunk(("data: " + json.dumps(ev) + "\n\n").encode())
        time.sleep(0.05)
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.connection.close()
        self.close_connection = True

    def _write_chunk(self, data):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()


def start():
    """Starts the mock on a free port; returns (server, recorder, base_url)."""
    recorder = Recorder()
    handler = type("BoundHandler", (Handler,), {"recorder": recorder})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, recorder, "http://127.0.0.1:%d/v1" % server.server_address[1]
