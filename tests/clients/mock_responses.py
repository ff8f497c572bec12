"""A mock OpenAI Responses API upstream for the client-compatibility suites.

It speaks the Responses wire format: POST /v1/responses answered with a
JSON response object, or with Server-Sent Events when "stream" is true;
GET /v1/models; errors in OpenAI's shape
`{"error":{"message","type","param","code"}}`. When a context window is set
(window_tokens, counted as request bytes / 4) a larger request gets the
400 the API answers on overflow, param "input", code
"context_length_exceeded".

condense's summarizer calls for Responses requests (one user message
quoting a <conversation>, no tools) are answered with a checkpoint holding
every section it asks for (scripted_model.checkpoint), whatever the
responder: on /v1/responses, and on POST /v1/chat/completions, where
condense sent them before it learned to ask the Responses API (any other
chat request gets 404).

Every request it receives is recorded (method, path with query string,
headers, parsed body, raw bytes, and the response it answered), and any
path it does not serve is answered 404 and recorded too, so a test sees
everything a client asked for.

Responses are stateless here unless the client uses previous_response_id:
the mock keeps every response it produced, and a previous_response_id it
does not know is answered 400 previous_response_not_found, as the API does
for an id it has not stored.

What to answer to a /v1/responses request is decided by a responder, a
function of the recorded request returning a list of output items
(`message(...)`, `function_call(...)`, `reasoning(...)`) or an `Error`;
`keyword_responder` serves the Python SDK suite, and the agent tests bring
scripted ones.
"""

import itertools
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import scripted_model
from mock_upstream import Recorder

MOCK_REQUEST_ID = "req_mock_responses_1"
OVERFLOW_MESSAGE = ("Your input exceeds the context window of this model. "
                    "Please adjust your input and try again.")
_ids = itertools.count(1)


def _id(prefix):
    return "%s_mock%06d" % (prefix, next(_ids))


class Error:
    """An upstream error: HTTP status and the OpenAI error object's fields."""

    def __init__(self, status, message, type_, code=None, param=None, headers=None):
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = headers or {}

    def body(self):
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def overflow():
    return Error(400, OVERFLOW_MESSAGE, "invalid_request_error", "context_length_exceeded", "input")


# --- output items -------------------------------------------------------------
# Output items carry an id ("msg_", "fc_", "rs_") and a status; a
# stateless client sends them back as input items on the next turn, ids
# included (the Agents SDK, the Python SDK's model_dump and Codex all do;
# Codex also gives its function_call_output items ids of its own, "fco_...",
# and its reasoning items "content": null).

def message(text):
    return {"id": _id("msg"), "type": "message", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def function_call(call_id, name, arguments):
    """A call of a function tool; arguments is the JSON text of the object."""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    return {"id": _id("fc"), "type": "function_call", "status": "completed",
            "call_id": call_id, "name": name, "arguments": arguments}


def reasoning(summary, encrypted_content=None):
    """A reasoning item. encrypted_content is opaque to clients: they get it
    only when the request's include lists "reasoning.encrypted_content", and
    must send it back unchanged (with store false, that is how the model
    gets its reasoning back)."""
    item = {"id": _id("rs"), "type": "reasoning", "summary": [{"type": "summary_text", "text": summary}]}
    if encrypted_content is not None:
        item["encrypted_content"] = encrypted_content
    return item


def input_tokens(raw):
    """A stand-in for the real tokenizer: about four bytes a token."""
    return max(1, len(raw) // 4)


def output_tokens(items):
    return max(1, len(json.dumps(items)) // 4)


# --- reading a request --------------------------------------------------------

def input_items(body):
    """The request's input as a list of items (a string input is one user
    message)."""
    items = body.get("input")
    if isinstance(items, str):
        return [{"type": "message", "role": "user", "content": items}]
    return items or []


def item_text(item):
    """The text of an input item: a message's string content or its text
    parts, or a function_call_output's output (string, or a list of
    input_text parts)."""
    if item.get("type") == "function_call_output":
        content = item.get("output")
    else:
        content = item.get("content")
    if isinstance(content, str):
        return content
    return "\n".join(p.get("text", "") for p in content or [] if isinstance(p, dict))


def last_user_text(body):
    for item in reversed(input_items(body)):
        if item.get("role") == "user" and item.get("type", "message") == "message":
            return item_text(item)
    return ""


def prompt_of(body):
    """The request as a scripted model reads it (scripted_model.Prompt):
    messages' text, function_call items (arguments parsed) and
    function_call_output items, in order; reasoning is the model's own and
    not read back."""
    entries = []
    for it in input_items(body):
        kind = it.get("type", "message")
        if kind == "message":
            entries.append(scripted_model.Entry("text", item_text(it)))
        elif kind == "function_call":
            try:
                args = json.loads(it.get("arguments") or "{}")
            except ValueError:
                args = {}
            entries.append(scripted_model.Entry("call", call_id=it.get("call_id", ""), name=it.get("name", ""),
                                                args=args if isinstance(args, dict) else {}))
        elif kind == "function_call_output":
            entries.append(scripted_model.Entry("result", item_text(it), call_id=it.get("call_id", "")))
    tools = [t.get("name") for t in body.get("tools") or []]
    return scripted_model.Prompt(tools, entries)


def output_of(parts, encrypted=None):
    """A scripted model's parts as output items: think as a reasoning item
    (with `encrypted` as its encrypted_content), text as a message, a call
    as a function_call."""
    items = []
    for p in parts:
        if p.kind == "think":
            items.append(reasoning(p.text, encrypted))
        elif p.kind == "text":
            items.append(message(p.text))
        else:
            items.append(function_call(p.call_id, p.name, p.args))
    return items


def keyword_responder(request):
    """The Python SDK suite's behaviour, chosen by the last input item:
    - a function_call_output: "The tool said: <its output>";
    - a user message with "RATE_LIMIT" / "BAD_REQUEST": OpenAI's 429 / 400;
    - "use the weather tool": a function_call get_weather(city=Paris);
    - otherwise "Hello from the mock.".
    With reasoning requested (a "reasoning" object in the body), a reasoning
    item comes first, with encrypted_content when include asks for it."""
    body = request["body"]
    items = input_items(body)
    last = items[-1] if items else {}
    said = item_text(last) if last.get("role") == "user" else ""
    if "RATE_LIMIT" in said:
        return Error(429, "Rate limit reached for gpt-5 on tokens per min (TPM): Limit 30000, Used 30000, "
                     "Requested 500.", "tokens", "rate_limit_exceeded", headers={"retry-after": "2"})
    if "BAD_REQUEST" in said:
        return Error(400, "Invalid value: 'bogus'. Supported values are: 'auto' and 'disabled'.",
                     "invalid_request_error", "invalid_value", "truncation")
    if last.get("type") == "function_call_output":
        output = [message("The tool said: " + item_text(last))]
    elif "use the weather tool" in said:
        output = [function_call("call_w1", "get_weather", {"city": "Paris"})]
    else:
        output = [message("Hello from the mock.")]
    if body.get("reasoning") is not None:
        encrypted = "gAAAAB-mock-encrypted-reasoning==" if "reasoning.encrypted_content" in (
            body.get("include") or []) else None
        output.insert(0, reasoning("The user wants an answer.", encrypted))
    return output


# --- the response object and its event stream ----------------------------------

def response_object(body, output, usage, status="completed", response_id=None):
    """The Response object the API returns: the request's settings echoed,
    the output items, and usage (input_tokens with input_tokens_details.
    cached_tokens, output_tokens with output_tokens_details.reasoning_tokens)."""
    return {
        "id": response_id or _id("resp"), "object": "response", "created_at": int(time.time()),
        "status": status, "background": False, "error": None, "incomplete_details": None,
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "model": body.get("model"), "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "prompt_cache_key": body.get("prompt_cache_key"),
        "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
        "store": body.get("store", True), "temperature": 1.0,
        "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
        "top_p": 1.0, "truncation": body.get("truncation", "disabled"),
        "usage": usage, "user": None, "metadata": body.get("metadata") or {},
    }


def usage_of(raw, output):
    inp, out = input_tokens(raw), output_tokens(output)
    reasoning_tokens = sum(output_tokens([i]) for i in output if i["type"] == "reasoning")
    return {"input_tokens": inp, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": out, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": inp + out}


def stream_events(response):
    """The Server-Sent Events the API sends for a complete response, in
    order, as (event name, data) pairs; every data object repeats the name
    in "type" and carries a sequence_number counting from 0.

    response.created and response.in_progress carry the response with status
    "in_progress", no output and usage null. Each output item is opened by
    response.output_item.added with an empty shell (message content [],
    function_call arguments "", reasoning summary []) and closed by
    response.output_item.done with the whole item. Inside:
    - message: per content part response.content_part.added (text ""),
      response.output_text.delta pieces, response.output_text.done (the whole
      text), response.content_part.done;
    - function_call: response.function_call_arguments.delta pieces, then
      response.function_call_arguments.done (the whole arguments);
    - reasoning: per summary part response.reasoning_summary_part.added,
      response.reasoning_summary_text.delta, .done, and
      response.reasoning_summary_part.done; encrypted_content only arrives
      in output_item.done.
    response.completed carries the whole response, usage included."""
    seq = itertools.count()

    def ev(name, **data):
        return name, {"type": name, "sequence_number": next(seq), **data}

    shell = dict(response, status="in_progress", output=[], usage=None)
    yield ev("response.created", response=shell)
    yield ev("response.in_progress", response=shell)
    for i, item in enumerate(response["output"]):
        kind = item["type"]
        where = {"item_id": item["id"], "output_index": i}
        if kind == "message":
            yield ev("response.output_item.added", output_index=i,
                     item=dict(item, status="in_progress", content=[]))
            for c, part in enumerate(item["content"]):
                yield ev("response.content_part.added", **where, content_index=c,
                         part=dict(part, text=""))
                for piece in _pieces(part["text"]):
                    yield ev("response.output_text.delta", **where, content_index=c, delta=piece, logprobs=[])
                yield ev("response.output_text.done", **where, content_index=c, text=part["text"], logprobs=[])
                yield ev("response.content_part.done", **where, content_index=c, part=part)
        elif kind == "function_call":
            yield ev("response.output_item.added", output_index=i,
                     item=dict(item, status="in_progress", arguments=""))
            for piece in _pieces(item["arguments"]):
                yield ev("response.function_call_arguments.delta", **where, delta=piece)
            yield ev("response.function_call_arguments.done", **where, arguments=item["arguments"])
        elif kind == "reasoning":
            shell_item = {k: v for k, v in item.items() if k != "encrypted_content"}
            yield ev("response.output_item.added", output_index=i, item=dict(shell_item, summary=[]))
            for s, part in enumerate(item["summary"]):
                yield ev("response.reasoning_summary_part.added", **where, summary_index=s,
                         part=dict(part, text=""))
                for piece in _pieces(part["text"]):
                    yield ev("response.reasoning_summary_text.delta", **where, summary_index=s, delta=piece)
                yield ev("response.reasoning_summary_text.done", **where, summary_index=s, text=part["text"])
                yield ev("response.reasoning_summary_part.done", **where, summary_index=s, part=part)
        else:
            raise ValueError(kind)
        yield ev("response.output_item.done", output_index=i, item=item)
    yield ev("response.completed", response=response)


def _pieces(s, size=16):
    """Splits s into deltas (an empty string still gets one delta)."""
    return [s[i:i + size] for i in range(0, len(s), size)] or [""]


# --- the server -----------------------------------------------------------------

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    recorder = None  # set by start()
    responder = None  # set by start()
    window_tokens = None  # set by start()
    stored = None  # response id -> response, set by start()

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
        self.send_header("x-request-id", MOCK_REQUEST_ID)
        for k, v in (extra_headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _not_found(self):
        self._send_json(404, Error(404, f"Invalid URL ({self.command} {self.path})",
                                   "invalid_request_error").body())

    def do_HEAD(self):
        self._record(None, b"")
        self._send_json(200, {})

    def do_GET(self):
        self._record(None, b"")
        path = self.path.split("?")[0]
        if path == "/v1/models":
            self._send_json(200, {"object": "list", "data": [
                {"id": m, "object": "model", "created": 1, "owned_by": "mock"} for m in ("gpt-5", "gpt-5-codex")]})
        else:
            self._not_found()

    def do_DELETE(self):
        self._record(None, b"")
        self._not_found()

    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        request = self._record(body, raw)
        path = self.path.split("?")[0]
        if path == "/v1/chat/completions" and scripted_model.is_summary_call(body):
            request["summary"] = True
            content = scripted_model.checkpoint(scripted_model.summary_prompt(body))
            self._send_json(200, {
                "id": _id("chatcmpl"), "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model"),
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": content}}],
                "usage": {"prompt_tokens": input_tokens(raw), "completion_tokens": len(content) // 4,
                          "total_tokens": input_tokens(raw) + len(content) // 4}})
            return
        if path != "/v1/responses":
            self._not_found()
            return
        if not isinstance(body, dict):
            self._send_json(400, Error(400, "We could not parse the JSON body of your request.",
                                       "invalid_request_error").body())
            return
        prev = body.get("previous_response_id")
        if prev is not None and prev not in self.stored:
            answer = Error(400, f"Previous response with id '{prev}' not found.", "invalid_request_error",
                           "previous_response_not_found", "previous_response_id")
        elif self.window_tokens is not None and input_tokens(raw) > self.window_tokens:
            answer = overflow()
        elif scripted_model.is_summary_call(body):
            request["summary"] = True
            answer = [message(scripted_model.checkpoint(scripted_model.summary_prompt(body)))]
        else:
            answer = self.responder(request)
        if isinstance(answer, Error):
            request["error"] = answer.body()
            self._send_json(answer.status, answer.body(), answer.headers)
            return
        response = response_object(body, answer, usage_of(raw, answer))
        self.stored[response["id"]] = response
        request["response"] = response
        if body.get("stream"):
            self._stream(response)
        else:
            self._send_json(200, response)

    def _stream(self, response):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("x-request-id", MOCK_REQUEST_ID)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for event, data in stream_events(response):
            # Like Anthropic, the Responses API names each event twice: in
            # the SSE "event:" field and in the JSON's "type". No [DONE].
            frame = "event: %s\ndata: %s\n\n" % (event, json.dumps(data, separators=(",", ":")))
            self._write_chunk(frame.encode())
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _write_chunk(self, data):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()


def start(responder=keyword_responder, window_tokens=None):
    """Starts the mock on a free port; returns (server, recorder, base_url),
    base_url in condense's upstream shape http://127.0.0.1:PORT/v1."""
    recorder = Recorder()
    handler = type("BoundResponsesHandler", (Handler,), {
        "recorder": recorder, "responder": staticmethod(responder),
        "window_tokens": window_tokens, "stored": {}})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, recorder, "http://127.0.0.1:%d/v1" % server.server_address[1]


def read_stream(raw):
    """What a client makes of a Responses event stream (bytes): the events
    as (name, data) pairs, and a summary: how many response.created and
    response.completed events came, the output_index of each
    output_item.added in order, the items by output_index as
    output_item.done gave them, the text deltas per item, and the
    response of response.completed."""
    import client_tap
    events = [(name, json.loads(data)) for name, data in client_tap.sse_events(raw)]
    out = {"created": 0, "completed": 0, "indices": [], "items": {}, "deltas": {}, "response": None}
    for _, e in events:
        kind = e.get("type")
        if kind == "response.created":
            out["created"] += 1
        elif kind == "response.output_item.added":
            out["indices"].append(e["output_index"])
        elif kind == "response.output_item.done":
            out["items"][e["output_index"]] = e["item"]
        elif kind == "response.output_text.delta":
            out["deltas"][e["output_index"]] = out["deltas"].get(e["output_index"], 0) + 1
        elif kind == "response.completed":
            out["completed"] += 1
            out["response"] = e["response"]
    out["output"] = [out["items"][i] for i in sorted(out["items"])]
    return events, out
