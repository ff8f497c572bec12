"""A tap between an agent and condense: a reverse proxy on 127.0.0.1 that
passes every request to condense and every answer back as it comes (a
stream chunk by chunk, never buffered whole), and records what the agent
got: method, path, status, headers and the answer's bytes. The agent tests
read the streams condense sent off it (one message_start, continued
indices, never a condense_recall call) without trusting the agent to show
them.
"""

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from mock_upstream import Recorder

HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection",
       "proxy-authorization", "proxy-authenticate", "content-length", "host"}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    recorder = None  # set by start()
    target = None  # (host, port), set by start()

    def log_message(self, *args):
        pass

    def _relay(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
        entry = {"method": self.command, "path": self.path, "request": body or b"",
                 "request_headers": {k.lower(): v for k, v in self.headers.items()},
                 "status": None, "headers": {}, "body": b""}
        self.recorder.add(entry)
        conn = http.client.HTTPConnection(*self.target, timeout=600)
        try:
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            entry["status"] = resp.status
            entry["headers"] = {k.lower(): v for k, v in resp.getheaders()}
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in HOP:
                    self.send_header(k, v)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            received = bytearray()
            while True:
                chunk = resp.read1(65536)
                if not chunk:
                    break
                received.extend(chunk)
                if self.command != "HEAD":
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
            entry["body"] = bytes(received)
            if self.command != "HEAD":
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
        finally:
            conn.close()

    do_GET = do_POST = do_HEAD = do_DELETE = do_PUT = _relay


def start(base_url):
    """Starts a tap in front of condense at base_url (http://host:port...);
    returns (server, recorder, root URL of the tap, http://127.0.0.1:PORT)."""
    u = urlsplit(base_url)
    recorder = Recorder()
    handler = type("BoundTap", (Handler,), {"recorder": recorder, "target": (u.hostname, u.port)})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, recorder, "http://127.0.0.1:%d" % server.server_address[1]


def sse_events(raw):
    """The (event name or None, data text) pairs of an SSE body."""
    out = []
    for block in raw.decode("utf-8", "replace").replace("\r\n", "\n").split("\n\n"):
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].lstrip(" "))
        if data:
            out.append((name, "\n".join(data)))
    return out


def dump(path, seen):
    """Writes what the tap saw to `path`, one JSON object a line: the
    request as the agent sent it, and the answer's bytes as text."""
    import json
    with open(path, "w") as f:
        for t in seen:
            f.write(json.dumps({k: (v.decode("utf-8", "replace") if isinstance(v, bytes) else v)
                                for k, v in t.items()}) + "\n")
