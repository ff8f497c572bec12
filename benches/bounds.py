#!/usr/bin/env python3
"""Memory under the resource-exhaustion attacks, against the real binary.

Reproduces the original findings against a built condense binary (this
script builds nothing) and prints, per scenario, condense's resident memory
when idle, its peak above that while under attack, and whether `/healthz`
still answered. Everything runs on 127.0.0.1; every scenario is bounded in
time, and the script kills every process it started.

Scenarios (from the issue):
  a  1,100 idle TCP connections, condense under a 1,024 open-file limit;
     /healthz on a new connection must answer.
  b  20 clients each declaring a 30 MB chat body and withholding the last
     byte (default config: max_body_bytes 32 MiB, max_buffered_bytes
     128 MiB). Goal: peak < 256 MiB above idle.
  b2 the same with chunked bodies (no Content-Length), each withholding its
     last chunk.
  c  a 60 MB newline-free SSE line from the upstream on a streamed chat
     request (c1: the client did not ask for usage, so condense filters the
     stream; c2: it did, the stream passes unfiltered). Goal: < 64-128 MiB.
  d  a 300 MB chunked 400 error body from the upstream on a chat request.
     Goal: < 64-128 MiB.
  e  5 HTTP/2 (h2c) connections with 200 slow streams each (h2load, from
     Debian's nghttp2-client), condense under a 1,024 open-file
     limit, an upstream that holds every request. Goal: /healthz answers,
     condense stays under its limit, the streams past the cap get 503.
  f  one chat request whose tool result is 400k distinct path lines
     (16.5 MB). Goal: under 1 s of condense's CPU.
  g  three clients send 16.5 MB requests like f and hang up while their
     jobs wait; then an ordinary 272 KB Messages request. Goal: it is
     answered at once, the abandoned jobs are never run.
  h  an upstream that echoes a field of the client's request in its 400
     (OpenAI's "Invalid value: '...'"); tenant B sends "maximum context
     length is 50 tokens" as reasoning_effort, then tenant A sends a
     47k-token conversation. Goal: A's request goes out unchanged, the
     learned window does not move.
  i  a 12 MB user message that is one word (lowercase letters, no spaces),
     answered, then a short user message, on each route: i1 chat
     completions, i2 Anthropic Messages, i3 Responses (issue 34: 534-624
     MiB, the tokenizer's merge of one long piece). Goal: < 128 MiB.
  j  one assistant turn of 80,000 tool calls and their 80,000 results, the
     answer and a next question (16-18 MB), on each route: j1 chat, j2
     Messages, j3 Responses (issue 34: +553 MiB, 22 s of CPU). Goal: < 128
     MiB.
  Both are far over the window of the model they name, so condense counts
  and compacts them; the notes give the CPU time condense spent on the
  request (utime + stime from /proc/<pid>/stat).

condense (a: under `setrlimit(RLIMIT_NOFILE, 1024)`, like `prlimit
--nofile=1024:1024`) is configured by environment variables only:
CONDENSE_SERVER__LISTEN, CONDENSE_UPSTREAM__BASE_URL (a raw-socket fake
upstream in this script), CONDENSE_UPSTREAM__LEARN_WINDOWS=false.

Peak RSS: /proc/<pid>/status VmRSS sampled every 10 ms, and VmHWM after
resetting it (`echo 5 > /proc/<pid>/clear_refs`) once condense is idle; the
larger of the two is reported.

Usage: python3 benches/bounds.py [--bin target/release/condense] [--only a,c1]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field

MIB = 1 << 20
HOST = "127.0.0.1"

# --------------------------------------------------------------------------
# Process and memory helpers
# --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def status_kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


class Sampler:
    """Samples a process's VmRSS in the background; keeps the maximum."""

    def __init__(self, pid: int, every: float = 0.01):
        self.pid, self.every = pid, every
        self.max_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.max_kib = max(self.max_kib, status_kib(self.pid, "VmRSS"))
            except (OSError, KeyError):
                return
            time.sleep(self.every)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


class Condense:
    """The condense binary, serving on a free port."""

    def __init__(self, binary: str, upstream: str, nofile: int | None = None, env: dict | None = None):
        self.port = free_port()
        self.addr = (HOST, self.port)
        e = {k: v for k, v in os.environ.items() if not k.startswith("CONDENSE_") and k != "RUST_LOG"}
        e.update(
            {
                "CONDENSE_SERVER__LISTEN": f"{HOST}:{self.port}",
                "CONDENSE_UPSTREAM__BASE_URL": upstream,
                "CONDENSE_UPSTREAM__LEARN_WINDOWS": "false",
                "RUST_LOG": "error",
            }
        )
        e.update(env or {})

        def limit() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.proc = subprocess.Popen(
            [binary],
            env=e,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=limit,
        )
        deadline = time.monotonic() + 30
        while not healthz(self.addr, timeout=0.5)[0]:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("condense did not start")
            time.sleep(0.05)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def idle_kib(self) -> int:
        """VmRSS once settled; then the peak (VmHWM) is reset to it."""
        time.sleep(0.5)
        rss = status_kib(self.pid, "VmRSS")
        try:
            with open(f"/proc/{self.pid}/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        return rss

    def peak_kib(self, sampled: int) -> int:
        try:
            hwm = status_kib(self.pid, "VmHWM")
        except (OSError, KeyError):
            hwm = 0
        return max(hwm, sampled)

    def metric(self, series: str) -> float | None:
        try:
            with urllib.request.urlopen(f"http://{HOST}:{self.port}/metrics", timeout=5) as r:
                for line in r.read().decode().splitlines():
                    if line.startswith(series + " "):
                        return float(line.rsplit(" ", 1)[1])
        except OSError:
            return None
        return 0.0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def healthz(addr: tuple[str, int], timeout: float = 5.0) -> tuple[bool, float]:
    """Whether GET /healthz on a new connection answered 200, and how fast."""
    start = time.monotonic()
    try:
        with socket.create_connection(addr, timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
        ok = data.startswith(b"HTTP/1.1 200")
    except OSError:
        ok = False
    return ok, time.monotonic() - start


# --------------------------------------------------------------------------
# A fake upstream (raw sockets)
# --------------------------------------------------------------------------

OK_ANSWER = json.dumps(
    {
        "id": "ok",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "fine"}, "finish_reason": "stop"}],
    }
).encode()


def read_message(conn: socket.socket, keep_body: bool) -> tuple[bytes, bytes] | None:
    """Reads one request (head and Content-Length body); returns its head
    and, when `keep_body`, its body (else the body is read and dropped)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    parts = [rest] if keep_body else []
    left = length - len(rest)
    while left > 0:
        chunk = conn.recv(min(1 << 20, left))
        if not chunk:
            return None
        if keep_body:
            parts.append(chunk)
        left -= len(chunk)
    return head, b"".join(parts)


def read_request(conn: socket.socket) -> bytes | None:
    """Reads one request; returns its head (the body is dropped)."""
    read = read_message(conn, keep_body=False)
    return None if read is None else read[0]


def read_body(conn: socket.socket) -> bytes | None:
    """Reads one request with a Content-Length body; returns the body."""
    read = read_message(conn, keep_body=True)
    return None if read is None else read[1]


def send_chunked(conn: socket.socket, parts) -> None:
    for part in parts:
        conn.sendall(b"%x\r\n" % len(part) + part + b"\r\n")
    conn.sendall(b"0\r\n\r\n")


def repeated(total: int, byte: bytes, piece: int = MIB):
    block = byte * piece
    while total > 0:
        n = min(piece, total)
        yield block[:n]
        total -= n


SSE_FIRST = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n'
SSE_LINE_BYTES = 60 * 1000 * 1000
SSE_TAIL = b"\n\ndata: [DONE]\n\n"
SSE_TOTAL = len(SSE_FIRST) + len(b"data: ") + SSE_LINE_BYTES + len(SSE_TAIL)

ERROR_HEAD = b'{"error":{"message":"bad request","type":"invalid_request_error","param":null,"code":null,"padding":"'
ERROR_PAD = 300 * 1000 * 1000
ERROR_TAIL = b'"}}'
ERROR_TOTAL = len(ERROR_HEAD) + ERROR_PAD + len(ERROR_TAIL)


class FakeUpstream:
    """Answers chat requests as `mode` says ("ok", "long_sse", "huge_400",
    "hold": read the request and never answer, "echo_400": a 400 quoting
    the request's reasoning_effort when it has one, else "ok")."""

    def __init__(self, mode: str):
        self.mode = mode
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((HOST, 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.requests = 0
        self.last_body_bytes = 0
        self.held: list[socket.socket] = []
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}/v1"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        if self.mode == "hold":
            if read_request(conn) is not None:
                self.requests += 1
                self.held.append(conn)
            return
        if self.mode == "echo_400":
            self._echo(conn)
            return
        with conn:
            try:
                while read_request(conn) is not None:
                    self.requests += 1
                    if self.mode == "long_sse":
                        conn.sendall(
                            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                        )
                        send_chunked(
                            conn,
                            [SSE_FIRST, b"data: ", *repeated(SSE_LINE_BYTES, b"x"), SSE_TAIL],
                        )
                    elif self.mode == "huge_400":
                        conn.sendall(
                            b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
                        )
                        send_chunked(conn, [ERROR_HEAD, *repeated(ERROR_PAD, b"p"), ERROR_TAIL])
                    else:
                        conn.sendall(
                            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                            % len(OK_ANSWER)
                            + OK_ANSWER
                        )
            except OSError:
                pass

    def _echo(self, conn: socket.socket) -> None:
        with conn:
            try:
                while True:
                    body = read_body(conn)
                    if body is None:
                        return
                    self.requests += 1
                    self.last_body_bytes = len(body)
                    try:
                        effort = json.loads(body).get("reasoning_effort")
                    except ValueError:
                        effort = None
                    if effort is not None:
                        answer = json.dumps({"error": {
                            "message": f"Invalid value: '{effort}'. Supported values are: 'low', 'medium', and 'high'.",
                            "type": "invalid_request_error", "param": "reasoning_effort", "code": "invalid_value"}}).encode()
                        conn.sendall(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(answer) + answer)
                    else:
                        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(OK_ANSWER) + OK_ANSWER)
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        for held in self.held:
            held.close()


# --------------------------------------------------------------------------
# Clients
# --------------------------------------------------------------------------


def chat_request(body: dict, path: str = "/v1/chat/completions") -> bytes:
    raw = json.dumps(body).encode()
    return (
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n" % (path.encode(), len(raw))
    ) + raw


CHAT = {
    "model": "gpt-4o",
    "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}],
}


def read_counted(s: socket.socket, deadline: float) -> tuple[int, int]:
    """Reads a whole response off `s` without keeping its body; returns the
    status and the number of body bytes (chunked or Content-Length)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            raise RuntimeError("closed before the response head")
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (l.partition(b":") for l in lines[1:])}
    body = 0
    if b"chunked" in headers.get(b"transfer-encoding", b""):
        buf = bytearray(rest)

        def fill() -> None:
            if time.monotonic() > deadline:
                raise TimeoutError("response not read within the time limit")
            chunk = s.recv(1 << 20)
            if not chunk:
                raise RuntimeError("chunked body cut short")
            buf.extend(chunk)

        while True:
            while b"\r\n" not in buf:
                fill()
            i = buf.index(b"\r\n")
            size = int(bytes(buf[:i]).split(b";")[0], 16)
            del buf[: i + 2]
            if size == 0:
                return status, body
            body += size
            # Skip the chunk's data and its CRLF without keeping them.
            remaining = size + 2
            if len(buf) >= remaining:
                del buf[:remaining]
                continue
            remaining -= len(buf)
            buf.clear()
            while remaining > 0:
                if time.monotonic() > deadline:
                    raise TimeoutError("response not read within the time limit")
                chunk = s.recv(min(1 << 20, remaining))
                if not chunk:
                    raise RuntimeError("chunk cut short")
                remaining -= len(chunk)
    length = int(headers.get(b"content-length", b"-1"))
    body = len(rest)
    while length < 0 or body < length:
        if time.monotonic() > deadline:
            raise TimeoutError
        chunk = s.recv(1 << 20)
        if not chunk:
            break
        body += len(chunk)
    return status, body


ROUTES = {
    "chat": "/v1/chat/completions",
    "messages": "/v1/messages",
    "responses": "/v1/responses",
}


def long_word(size: int = 12 * 1000 * 1000) -> str:
    """`size` lowercase letters without a space: one piece to the tokenizer."""
    rng = random.Random(34)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    # A block of random letters, repeated: random enough that merges go
    # on, cheap to make.
    block = "".join(rng.choice(letters) for _ in range(1 << 16))
    return (block * (size // len(block) + 1))[:size]


def one_word_body(route: str) -> dict:
    """The word as the first user message, answered, then a short last user
    message (which no stage shortens): the word is counted and compacted."""
    turns = [
        {"role": "user", "content": long_word()},
        {"role": "assistant", "content": "I read it."},
        {"role": "user", "content": "Now summarize it in one line."},
    ]
    if route == "chat":
        return {"model": "gpt-4o", "messages": turns}
    if route == "messages":
        return {"model": "claude-sonnet-4-5", "max_tokens": 256, "messages": turns}
    return {"model": "gpt-4o", "input": turns}


def tool_calls_body(route: str, calls: int = 80_000) -> dict:
    """One assistant turn of `calls` tool calls, all their results, the
    answer to them and a next question."""
    ask = "List every file, one call each."
    after = [{"role": "assistant", "content": "All files are there."}, {"role": "user", "content": "Which is the largest?"}]
    args = lambda i: json.dumps({"cmd": f"stat src/file_{i}.rs"})
    out = lambda i: f"src/file_{i}.rs: 1{i % 1000} bytes"
    if route == "chat":
        turn = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": f"call_{i}", "type": "function", "function": {"name": "run", "arguments": args(i)}}
                for i in range(calls)
            ],
        }
        results = [{"role": "tool", "tool_call_id": f"call_{i}", "content": out(i)} for i in range(calls)]
        return {"model": "gpt-4o", "messages": [{"role": "user", "content": ask}, turn, *results, *after]}
    if route == "messages":
        turn = {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": f"toolu_{i}", "name": "run", "input": {"cmd": f"stat src/file_{i}.rs"}}
                for i in range(calls)
            ],
        }
        results = {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": out(i)} for i in range(calls)],
        }
        return {
            "model": "claude-sonnet-4-5",
            "max_tokens": 256,
            "messages": [{"role": "user", "content": ask}, turn, results, *after],
        }
    items = [{"role": "user", "content": ask}]
    items += [
        {"type": "function_call", "call_id": f"call_{i}", "name": "run", "arguments": args(i)} for i in range(calls)
    ]
    items += [{"type": "function_call_output", "call_id": f"call_{i}", "output": out(i)} for i in range(calls)]
    return {"model": "gpt-4o", "input": items + after}


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_big_request(binary: str, time_limit: float, name: str, route: str, body: dict, goal: str) -> Result:
    """One large request on `route`; the upstream answers it with a small 200."""
    r = Result(name, goal=goal)
    raw = chat_request(body, ROUTES[route])
    del body
    up = FakeUpstream("ok")
    c = Condense(binary, up.base_url, env={"CONDENSE_UPSTREAM__ANTHROPIC_BASE_URL": up.base_url})
    try:
        idle = c.idle_kib()
        cpu = cpu_seconds(c.pid)
        deadline = time.monotonic() + time_limit
        started = time.monotonic()
        with Sampler(c.pid) as sampler:
            with socket.create_connection(c.addr, timeout=time_limit) as s:
                s.sendall(raw)
                status, got = read_counted(s, deadline)
            took = time.monotonic() - started
            ok, health = healthz(c.addr)
        r.idle_mib = idle / 1024
        r.peak_above_idle_mib = (c.peak_kib(sampler.max_kib) - idle) / 1024
        r.healthz = f"{'200' if ok else 'NO ANSWER'} in {health * 1000:.0f} ms"
        r.notes.append(f"{len(raw) / 1e6:.1f} MB sent, client got {status} in {took:.1f} s")
        r.notes.append(f"condense CPU {cpu_seconds(c.pid) - cpu:.1f} s")
        r.notes.append(f"upstream requests={up.requests}")
    except (OSError, RuntimeError, TimeoutError) as e:
        r.notes.append(f"FAILED: {e!r}")
    finally:
        c.kill()
        up.close()
    return r


# --------------------------------------------------------------------------
# Scenarios
# --------------------------------------------------------------------------


@dataclass
class Result:
    name: str
    idle_mib: float = 0.0
    peak_above_idle_mib: float = 0.0
    goal: str = ""
    healthz: str = ""
    notes: list[str] = field(default_factory=list)


def run_idle_connections(binary: str, time_limit: float) -> Result:
    r = Result("a: 1,100 idle conns, nofile 1024", goal="/healthz answers")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1400:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    up = FakeUpstream("ok")
    c = Condense(binary, up.base_url, nofile=1024)
    conns: list[socket.socket] = []
    try:
        idle = c.idle_kib()
        deadline = time.monotonic() + time_limit
        with Sampler(c.pid) as sampler:
            for _ in range(1100):
                if time.monotonic() > deadline:
                    r.notes.append("connect loop hit the time limit")
                    break
                conns.append(socket.create_connection(c.addr, timeout=5))
            time.sleep(0.5)
            ok, took = healthz(c.addr, timeout=5)
            time.sleep(0.2)
        r.idle_mib = idle / 1024
        r.peak_above_idle_mib = (c.peak_kib(sampler.max_kib) - idle) / 1024
        r.healthz = f"{'200' if ok else 'NO ANSWER'} in {took * 1000:.0f} ms"
        evicted = c.metric('condense_connections_closed_total{reason="evicted"}')
        open_now = c.metric("condense_open_connections")
        r.notes.append(f"{len(conns)} opened, {evicted:.0f} evicted, {open_now:.0f} open")
    finally:
        for s in conns:
            s.close()
        c.kill()
        up.close()
    return r


def run_withheld_bodies(binary: str, time_limit: float, chunked: bool = False) -> Result:
    name = "b2: 20 x 30 MB chunked bodies withheld" if chunked else "b: 20 x 30 MB bodies withheld"
    r = Result(name, goal="< 256 MiB")
    up = FakeUpstream("ok")
    c = Condense(binary, up.base_url)
    declared = 30 * 1000 * 1000
    outcome: dict[int, str] = {}
    conns: list[socket.socket] = []
    lock = threading.Lock()
    deadline = time.monotonic() + time_limit

    def client(i: int) -> None:
        try:
            s = socket.create_connection(c.addr, timeout=10)
        except OSError as e:
            outcome[i] = f"connect failed: {e}"
            return
        with lock:
            conns.append(s)
        framing = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % declared
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + framing
            + b"\r\n\r\n"
        )
        try:
            s.sendall(head)
            # A body beyond the room is refused on its headers.
            select.select([s], [], [], 0.2)
            piece = b" " * MIB
            left = declared - 1
            while left > 0:
                if time.monotonic() > deadline:
                    outcome[i] = "time limit"
                    return
                # Refused on the headers? Then stop sending.
                if select.select([s], [], [], 0)[0]:
                    break
                n = min(len(piece), left)
                if chunked:
                    s.sendall(b"%x\r\n" % n + piece[:n] + b"\r\n")
                else:
                    s.sendall(piece[:n])
                left -= n
            if left == 0:
                outcome[i] = "holding"
                return
            status, _ = read_counted(s, deadline)
            outcome[i] = str(status)
        except OSError as e:
            # Refused while sending: the answer may still be readable.
            try:
                status, _ = read_counted(s, deadline)
                outcome[i] = str(status)
            except (OSError, RuntimeError, ValueError, IndexError):
                outcome[i] = f"error: {e.__class__.__name__}"
        except (RuntimeError, ValueError, IndexError, TimeoutError) as e:
            outcome[i] = f"error: {e}"

    try:
        idle = c.idle_kib()
        with Sampler(c.pid) as sampler:
            threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(20)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=max(0.0, deadline - time.monotonic()))
            # Let condense hold what it holds for a moment.
            time.sleep(1.0)
            ok, took = healthz(c.addr)
        r.idle_mib = idle / 1024
        r.peak_above_idle_mib = (c.peak_kib(sampler.max_kib) - idle) / 1024
        r.healthz = f"{'200' if ok else 'NO ANSWER'} in {took * 1000:.0f} ms"
        counts: dict[str, int] = {}
        for v in outcome.values():
            counts[v] = counts.get(v, 0) + 1
        r.notes.append(", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    finally:
        for s in conns:
            s.close()
        c.kill()
        up.close()
    return r


def run_upstream_body(binary: str, time_limit: float, name: str, mode: str, body: dict, expect_status: int, expect_bytes: int, goal: str) -> Result:
    r = Result(name, goal=goal)
    up = FakeUpstream(mode)
    c = Condense(binary, up.base_url)
    try:
        idle = c.idle_kib()
        deadline = time.monotonic() + time_limit
        with Sampler(c.pid) as sampler:
            with socket.create_connection(c.addr, timeout=30) as s:
                s.sendall(chat_request(body))
                status, got = read_counted(s, deadline)
            ok, took = healthz(c.addr)
        r.idle_mib = idle / 1024
        r.peak_above_idle_mib = (c.peak_kib(sampler.max_kib) - idle) / 1024
        r.healthz = f"{'200' if ok else 'NO ANSWER'} in {took * 1000:.0f} ms"
        whole = "whole" if (status, got) == (expect_status, expect_bytes) else f"MISMATCH (expected {expect_status}, {expect_bytes} B)"
        r.notes.append(f"client got {status}, {got / 1e6:.1f} MB: {whole}")
        if mode == "long_sse":
            n = c.metric('condense_upstream_invalid_responses_total{kind="sse_event_too_long"}')
            r.notes.append(f"sse_event_too_long={n:.0f}")
        else:
            r.notes.append(f"upstream requests={up.requests} (1 = no retry)")
    except (OSError, RuntimeError, TimeoutError) as e:
        r.notes.append(f"FAILED: {e!r}")
    finally:
        c.kill()
        up.close()
    return r


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def open_files(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def get_status(addr: tuple[str, int], path: str, timeout: float = 5.0) -> str:
    """The status and body of a GET on a new connection, or what failed."""
    try:
        with socket.create_connection(addr, timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(b"GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % path.encode())
            data = b""
            while True:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        return f"{head.split()[1].decode()} {body[:20].decode(errors='replace')}"
    except (OSError, IndexError) as e:
        return f"NO ANSWER ({e.__class__.__name__})"


def distinct_paths(lines: int, tag: str) -> dict:
    """A chat body whose answered tool result is `lines` distinct paths."""
    out = "".join(f"src/{tag}/module_{i}/sub_{i * 7}/file_{i}.py: ok\n" for i in range(lines))
    return {
        "model": "gpt-4o",
        "messages": [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "Look at the tree."},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "sh", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": out},
            {"role": "assistant", "content": "Seen it."},
            {"role": "user", "content": "Now what?"},
        ],
    }


def run_h2c_streams(binary: str, time_limit: float) -> Result:
    r = Result("e: 5 x 200 h2c slow streams, nofile 1024", goal="/healthz answers, fds < 1024")
    if not shutil.which("h2load"):
        r.notes.append("skipped: no h2load (Debian: nghttp2-client)")
        return r
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4096:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
    up = FakeUpstream("hold")
    c = Condense(binary, up.base_url, nofile=1024, env={"CONDENSE_UPSTREAM__FIRST_BYTE_TIMEOUT_SECONDS": str(int(time_limit))})
    body_file = f"/tmp/condense-bounds-{os.getpid()}.json"
    with open(body_file, "w") as f:
        json.dump(CHAT, f)
    url = f"http://{HOST}:{c.port}/v1/chat/completions"
    clients = []
    try:
        idle = c.idle_kib()
        with Sampler(c.pid) as sampler:
            # h2load speaks h2c with prior knowledge to an http:// URL: 5
            # connections, 200 streams each at once.
            cmd = ["h2load", "-c", "5", "-m", "200", "-n", "1000", "-T", str(int(time_limit)),
                   "-d", body_file, "-H", "content-type: application/json", url]
            clients.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            # Until the upstream's count stops growing.
            last, still = -1, 0
            deadline = time.monotonic() + min(time_limit, 30)
            while still < 10 and time.monotonic() < deadline:
                time.sleep(0.2)
                still = still + 1 if up.requests == last else 0
                last = up.requests
            files = open_files(c.pid)
            ok, took = healthz(c.addr)
            ready = get_status(c.addr, "/readyz")
            refused = c.metric('condense_proxy_errors_total{kind="overloaded"}')
        r.idle_mib = idle / 1024
        r.peak_above_idle_mib = (c.peak_kib(sampler.max_kib) - idle) / 1024
        r.healthz = f"{'200' if ok else 'NO ANSWER'} in {took * 1000:.0f} ms"
        refused_text = "/metrics unanswered" if refused is None else f"{refused:.0f} refused 503"
        r.notes.append(f"{up.requests} held upstream, {refused_text}, {files} fds open, /readyz {ready}")
    finally:
        for p in clients:
            p.kill()
            p.wait()
        c.kill()
        up.close()
        os.unlink(body_file)
    return r


def run_distinct_paths(binary: str, time_limit: float) -> Result:
    r = Result("f: 16.5 MB of distinct path lines", goal="< 1 s of CPU")
    up = FakeUpstream("ok")
    c = Condense(binary, up.base_url)
    try:
        idle = c.idle_kib()
        raw = chat_request(distinct_paths(400_000, "f"))
        deadline = time.monotonic() + time_limit
        with Sampler(c.pid) as sampler:
            before = cpu_seconds(c.pid)
            started = time.monotonic()
            with socket.create_connection(c.addr, timeout=time_limit) as s:
                s.sendall(raw)
                status, _ = read_counted(s, deadline)
            took = time.monotonic() - started
            cpu = cpu_seconds(c.pid) - before
            ok, hz = healthz(c.addr)
        r.idle_mib = idle / 1024
        r.peak_above_idle_mib = (c.peak_kib(sampler.max_kib) - idle) / 1024
        r.healthz = f"{'200' if ok else 'NO ANSWER'} in {hz * 1000:.0f} ms"
        r.notes.append(f"{len(raw) / 1e6:.1f} MB: status {status}, {cpu:.2f} s CPU, {took:.2f} s to the answer")
    finally:
        c.kill()
        up.close()
    return r


def messages_request(body: dict) -> bytes:
    raw = json.dumps(body).encode()
    return (
        b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nanthropic-version: 2023-06-01\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(raw)
    ) + raw


def ordinary_messages(bytes_wanted: int) -> dict:
    """An Anthropic Messages conversation of about `bytes_wanted` bytes."""
    msgs, turn = [], 0
    text = "def handler(request):\n    return respond(request.args)\n" * 40
    while sum(len(json.dumps(m)) for m in msgs) < bytes_wanted:
        msgs.append({"role": "user", "content": f"Turn {turn}: read the next file."})
        msgs.append({"role": "assistant", "content": [{"type": "text", "text": "Reading."}, {"type": "tool_use", "id": f"t{turn}", "name": "read", "input": {"path": f"src/m{turn}.py"}}]})
        msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{turn}", "content": f"# m{turn}\n" + text}]})
        turn += 1
    msgs.append({"role": "assistant", "content": "Read them all."})
    msgs.append({"role": "user", "content": "Summarise."})
    return {"model": "claude-sonnet-4-5", "max_tokens": 1024, "messages": msgs}


def run_abandoned_jobs(binary: str, time_limit: float) -> Result:
    r = Result("g: 3 hung-up 16.5 MB jobs, then a 272 KB Messages request", goal="answered at once; jobs dropped")
    up = FakeUpstream("ok")
    c = Condense(binary, up.base_url, env={"CONDENSE_UPSTREAM__ANTHROPIC_BASE_URL": up.base_url})
    try:
        idle = c.idle_kib()
        heavy = [chat_request(distinct_paths(400_000, f"g{i}")) for i in range(4)]
        ordinary = messages_request(ordinary_messages(272_000))
        deadline = time.monotonic() + time_limit
        with Sampler(c.pid) as sampler:
            # One that stays, taking a large slot; three that hang up.
            keeper = socket.create_connection(c.addr, timeout=time_limit)
            keeper.sendall(heavy[0])
            time.sleep(0.3)
            for raw in heavy[1:]:
                with socket.create_connection(c.addr, timeout=30) as s:
                    s.sendall(raw)
                    time.sleep(0.3)
            started = time.monotonic()
            with socket.create_connection(c.addr, timeout=time_limit) as s:
                s.sendall(ordinary)
                status, _ = read_counted(s, deadline)
            took = time.monotonic() - started
            kept_status, _ = read_counted(keeper, deadline)
            keeper.close()
            time.sleep(0.5)
        r.idle_mib = idle / 1024
        r.peak_above_idle_mib = (c.peak_kib(sampler.max_kib) - idle) / 1024
        jobs = {o: c.metric(f'condense_prepare_jobs_total{{outcome="{o}"}}') for o in ("run", "abandoned", "busy")}
        r.notes.append(f"{len(ordinary) / 1e3:.0f} KB Messages: {status} in {took:.2f} s; the kept 16.5 MB one: {kept_status}")
        r.notes.append(", ".join(f"{k}={v:.0f}" for k, v in jobs.items()) + f"; upstream requests={up.requests}")
    finally:
        c.kill()
        up.close()
    return r


def run_poisoned_window(binary: str, time_limit: float) -> Result:
    r = Result("h: an echoed 'maximum context length is 50 tokens'", goal="no window learned")
    up = FakeUpstream("echo_400")
    c = Condense(binary, up.base_url, env={"CONDENSE_AUTH__CLIENT_KEYS": '["tenant-a","tenant-b"]', "CONDENSE_UPSTREAM__API_KEY": "sk-shared"})
    gauge = 'condense_context_window_tokens{model="gpt-4o"}'

    def send(key: str, body: dict) -> int:
        raw = json.dumps(body).encode()
        req = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer %s\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n" % (key.encode(), len(raw))
        ) + raw
        with socket.create_connection(c.addr, timeout=30) as s:
            s.sendall(req)
            status, _ = read_counted(s, time.monotonic() + time_limit)
        return status

    try:
        idle = c.idle_kib()
        with Sampler(c.pid) as sampler:
            a = {"model": "gpt-4o", "messages": [{"role": "system", "content": "You are a coding agent."}]}
            for i in range(60):
                a["messages"].append({"role": "user", "content": f"Step {i}: " + "please read the file and report. " * 80})
                a["messages"].append({"role": "assistant", "content": f"Step {i} done: " + "the file holds what was expected. " * 10})
            a["messages"].append({"role": "user", "content": "Go on."})
            send("tenant-a", a)
            before = c.metric(gauge)
            b_status = send("tenant-b", dict(CHAT, reasoning_effort="maximum context length is 50 tokens"))
            after = c.metric(gauge)
            a_status = send("tenant-a", a)
        r.idle_mib = idle / 1024
        r.peak_above_idle_mib = (c.peak_kib(sampler.max_kib) - idle) / 1024
        sent = len(json.dumps(a).encode())
        r.notes.append(f"B got {b_status}; window gauge {before:.0f} -> {after:.0f}")
        r.notes.append(f"A got {a_status}: {sent} bytes sent, {up.last_body_bytes} forwarded")
    finally:
        c.kill()
        up.close()
    return r


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", default="target/release/condense", help="the condense binary (default: %(default)s)")
    p.add_argument("--only", default="a,b,b2,c1,c2,d,e,f,g,h,i1,i2,i3,j1,j2,j3", help="scenarios to run (default: %(default)s)")
    p.add_argument("--time-limit", type=float, default=120.0, help="seconds per scenario")
    args = p.parse_args()
    if not os.access(args.bin, os.X_OK):
        print(f"no executable at {args.bin}; build it with `cargo build --release`", file=sys.stderr)
        return 2
    streamed = dict(CHAT, stream=True)
    asked = dict(streamed, stream_options={"include_usage": True})
    scenarios = {
        "a": lambda: run_idle_connections(args.bin, args.time_limit),
        "b": lambda: run_withheld_bodies(args.bin, args.time_limit),
        "b2": lambda: run_withheld_bodies(args.bin, args.time_limit, chunked=True),
        "c1": lambda: run_upstream_body(
            args.bin, args.time_limit, "c1: 60 MB SSE line (usage stripped)", "long_sse", streamed, 200, SSE_TOTAL, "< 64-128 MiB"
        ),
        "c2": lambda: run_upstream_body(
            args.bin, args.time_limit, "c2: 60 MB SSE line (usage asked)", "long_sse", asked, 200, SSE_TOTAL, "< 64-128 MiB"
        ),
        "d": lambda: run_upstream_body(
            args.bin, args.time_limit, "d: 300 MB chunked 400 body", "huge_400", CHAT, 400, ERROR_TOTAL, "< 64-128 MiB"
        ),
        "e": lambda: run_h2c_streams(args.bin, args.time_limit),
        "f": lambda: run_distinct_paths(args.bin, args.time_limit),
        "g": lambda: run_abandoned_jobs(args.bin, args.time_limit),
        "h": lambda: run_poisoned_window(args.bin, args.time_limit),
    }
    for i, route in enumerate(ROUTES, 1):
        scenarios[f"i{i}"] = lambda route=route, i=i: run_big_request(
            args.bin, args.time_limit, f"i{i}: 12 MB one-word message ({route})", route, one_word_body(route), "< 128 MiB"
        )
        scenarios[f"j{i}"] = lambda route=route, i=i: run_big_request(
            args.bin, args.time_limit, f"j{i}: 80k tool calls in one turn ({route})", route, tool_calls_body(route), "< 128 MiB"
        )
    results = []
    for key in args.only.split(","):
        key = key.strip()
        if key not in scenarios:
            print(f"unknown scenario {key}", file=sys.stderr)
            return 2
        started = time.monotonic()
        try:
            res = scenarios[key]()
        except (OSError, RuntimeError) as e:
            res = Result(key, notes=[f"FAILED: {e!r}"])
        res.notes.append(f"{time.monotonic() - started:.1f} s")
        results.append(res)
        print(f"done: {res.name}", file=sys.stderr, flush=True)

    cols = ("scenario", "idle RSS", "peak above idle", "goal", "/healthz", "notes")
    rows = [
        (
            r.name,
            f"{r.idle_mib:.1f} MiB",
            f"{r.peak_above_idle_mib:.1f} MiB",
            r.goal,
            r.healthz,
            "; ".join(r.notes),
        )
        for r in results
    ]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = " | ".join(c.ljust(w) for c, w in zip(cols, widths))
    print(line)
    print("-+-".join("-" * w for w in widths))
    for row in rows:
        print(" | ".join(v.ljust(w) for v, w in zip(row, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
