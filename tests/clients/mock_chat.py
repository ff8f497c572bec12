"""A scripted mock OpenAI chat-completions upstream for the agent tests
that speak chat completions (opencode).

POST /v1/chat/completions is answered the way OpenAI does: JSON, or
Server-Sent Events when "stream" is true (the role first, the text in
word-sized content deltas, then each tool call: its id and name with empty
arguments, the arguments in pieces; the finish_reason; a usage chunk when
stream_options.include_usage is set, "usage": null on the other chunks
then; `data: [DONE]`). GET /v1/models lists the model. Errors take OpenAI's
shape `{"error":{"message","type","param","code"}}`.

What to answer is decided by a responder, a function of the recorded
request returning an assistant message (`message_of(parts)`) or an
`Error`. condense's summarizer calls (one user message quoting a
<conversation>, no tools) are answered with a checkpoint holding every
section it asks for (scripted_model.checkpoint), whatever the responder.

Every request is recorded (method, path, headers, parsed body, raw bytes
and their length, the message answered and its usage).
"""

import itertools
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import scripted_model
from mock_upstream import Recorder

_ids = itertools.count(1)


class Error:
    """An upstream error: HTTP status and the OpenAI error object's fields."""

    def __init__(self, status, message, type_, code=None, param=None):
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param

    def body(self):
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def text_of(content):
    """A message's content as text (a string, or the text of its parts)."""
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def prompt_of(body):
    """The request as a scripted model reads it (scripted_model.Prompt):
    each message's text, an assistant's tool calls (arguments parsed) and
    each tool message as a result, in order."""
    entries = []
    for msg in body.get("messages") or []:
        if msg.get("role") == "tool":
            entries.append(scripted_model.Entry("result", text_of(msg.get("content")),
                                                call_id=msg.get("tool_call_id", "")))
            continue
        if msg.get("content"):
            entries.append(scripted_model.Entry("text", text_of(msg.get("content"))))
        for c in msg.get("tool_calls") or []:
            fn = c.get("function") or {}
            try:
                args = json.loads(fn.get("arguments") or "{}")
            except ValueError:
                args = {}
            entries.append(scripted_model.Entry("call", call_id=c.get("id", ""), name=fn.get("name", ""),
                                                args=args if isinstance(args, dict) else {}))
    tools = [(t.get("function") or {}).get("name") for t in body.get("tools") or []]
    return scripted_model.Prompt(tools, entries)


def message_of(parts):
    """A scripted model's parts as one assistant message: the texts as its
    content, the calls as its tool_calls (chat completions has no standard
    place for reasoning: think parts are left out)."""
    texts = [p.text for p in parts if p.kind == "text"]
    calls = [{"id": p.call_id, "type": "function",
              "function": {"name": p.name, "arguments": json.dumps(p.args)}} for p in parts if p.kind == "call"]
    message = {"role": "assistant", "content": "\n\n".join(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    return message


def read_stream(raw):
    """What a client makes of a chat-completions event stream (bytes): the
    chunks, and a summary: the content, the tool calls (id, name,
    arguments), every finish_reason given, the number of content deltas,
    of role deltas and of [DONE] lines, the chunk ids, and the usage."""
    import client_tap
    out = {"content": "", "content_deltas": 0, "roles": 0, "calls": {}, "finish": [], "done": 0,
           "ids": [], "usage": None}
    chunks = []
    for _, data in client_tap.sse_events(raw):
        if data.strip() == "[DONE]":
            out["done"] += 1
            continue
        c = json.loads(data)
        chunks.append(c)
        if c.get("id") not in out["ids"]:
            out["ids"].append(c.get("id"))
        if c.get("usage"):
            out["usage"] = c["usage"]
        for choice in c.get("choices") or []:
            d = choice.get("delta") or {}
            if d.get("role"):
                out["roles"] += 1
            if d.get("content"):
                out["content"] += d["content"]
                out["content_deltas"] += 1
            for tc in d.get("tool_calls") or []:
                call = out["calls"].setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
                call["id"] = tc.get("id") or call["id"]
                fn = tc.get("function") or {}
                call["name"] += fn.get("name") or ""
                call["arguments"] += fn.get("arguments") or ""
            if choice.get("finish_reason"):
                out["finish"].append(choice["finish_reason"])
    out["tool_calls"] = [out["calls"][i] for i in sorted(out["calls"])]
    return chunks, out


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    recorder = None  # set by start()
    responder = None  # set by start()
    models = ()  # set by start()

    def log_message(self, *args):
        pass

    def _send_json(self, status, obj):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("x-request-id", "req_mock_chat")
        self.end_headers()
        self.wfile.write(data)

    def _record(self, body, raw):
        request = {"method": self.command, "path": self.path,
                   "headers": {k.lower(): v for k, v in self.headers.items()},
                   "body": body, "raw": raw, "bytes": len(raw)}
        self.recorder.add(request)
        return request

    def do_GET(self):
        self._record(None, b"")
        if self.path.split("?")[0] == "/v1/models":
            self._send_json(200, {"object": "list", "data": [
                {"id": m, "object": "model", "created": 1, "owned_by": "mock"} for m in self.models]})
        else:
            self._send_json(404, Error(404, "not found", "invalid_request_error").body())

    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        request = self._record(body, raw)
        if self.path.split("?")[0] != "/v1/chat/completions":
            self._send_json(404, Error(404, "not found", "invalid_request_error").body())
            return
        if not isinstance(body, dict):
            self._send_json(400, Error(400, "We could not parse the JSON body of your request.",
                                       "invalid_request_error").body())
            return
        if scripted_model.is_summary_call(body):
            request["summary"] = True
            answer = {"role": "assistant", "content": scripted_model.checkpoint(scripted_model.summary_prompt(body))}
        else:
            answer = self.responder(request)
        if isinstance(answer, Error):
            request["error"] = answer.body()
            self._send_json(answer.status, answer.body())
            return
        finish = "tool_calls" if answer.get("tool_calls") else "stop"
        prompt_tokens = max(1, len(raw) // 4)
        completion_tokens = max(1, len(json.dumps(answer)) // 4)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        completion_id = "chatcmpl-mock-%d" % next(_ids)
        request["response"] = {"message": answer, "finish_reason": finish, "usage": usage, "id": completion_id}
        if body.get("stream"):
            self._stream(body, completion_id, answer, finish, usage)
        else:
            self._send_json(200, {
                "id": completion_id, "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model"),
                "choices": [{"index": 0, "message": answer, "finish_reason": finish, "logprobs": None}],
                "usage": usage})

    def _stream(self, body, completion_id, message, finish, usage):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def chunk(delta, finish_reason=None):
            c = {"id": completion_id, "object": "chat.completion.chunk", "created": int(time.time()),
                 "model": body.get("model"),
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}
            if include_usage:
                c["usage"] = None
            return c

        events = [chunk({"role": "assistant", "content": ""})]
        words = (message.get("content") or "").split(" ")
        if message.get("content"):
            events += [chunk({"content": w if i == len(words) - 1 else w + " "}) for i, w in enumerate(words)]
        for i, call in enumerate(message.get("tool_calls") or []):
            args = call["function"]["arguments"]
            events.append(chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                                 "function": {"name": call["function"]["name"], "arguments": ""}}]}))
            events += [chunk({"tool_calls": [{"index": i, "function": {"arguments": args[k:k + 16]}}]})
                       for k in range(0, len(args), 16)]
        events.append(chunk({}, finish))
        if include_usage:
            events.append({"id": completion_id, "object": "chat.completion.chunk", "created": int(time.time()),
                           "model": body.get("model"), "choices": [], "usage": usage})
        for ev in events:
            self._write_chunk(("data: " + json.dumps(ev) + "\n\n").encode())
        self._write_chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _write_chunk(self, data):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()


def start(responder, models=("mock-model",)):
    """Starts the mock on a free port; returns (server, recorder, base_url),
    base_url in condense's upstream shape http://127.0.0.1:PORT/v1."""
    recorder = Recorder()
    handler = type("BoundChatHandler", (Handler,), {
        "recorder": recorder, "responder": staticmethod(responder), "models": tuple(models)})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, recorder, "http://127.0.0.1:%d/v1" % server.server_address[1]
