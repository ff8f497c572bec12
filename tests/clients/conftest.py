"""Starts the mock upstream and the real condense binary in front of it."""

import os
import queue
import re
import subprocess
import threading
from pathlib import Path

import pytest

import mock_upstream

ROOT = Path(__file__).resolve().parents[2]


def _binary():
    path = os.environ.get("CONDENSE_BIN") or str(ROOT / "target" / "debug" / "condense")
    if not Path(path).exists():
        pytest.fail(f"condense binary not found at {path}; run `cargo build` or set CONDENSE_BIN")
    return path


class Condense:
    def __init__(self, upstream_url, extra_env=None):
        env = {k: v for k, v in os.environ.items() if not k.startswith("CONDENSE_")}
        env.update({
            "CONDENSE_SERVER__LISTEN": "127.0.0.1:0",
            "CONDENSE_UPSTREAM__BASE_URL": upstream_url,
            "CONDENSE_LOG__FORMAT": "text",
            "NO_COLOR": "1",
        })
        env.update(extra_env or {})
        self.proc = subprocess.Popen([_binary()], env=env, cwd=ROOT,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        found = queue.Queue()

        def read():
            for line in self.proc.stderr:
                m = re.search(r"listen=(\S+)", line)
                if m:
                    found.put(m.group(1))

        threading.Thread(target=read, daemon=True).start()
        try:
            self.addr = found.get(timeout=30)
        except queue.Empty:
            self.proc.kill()
            raise RuntimeError("condense did not report its listen address")
        self.base_url = f"http://{self.addr}/v1"

    def stop(self):
        self.proc.terminate()
        try:
            assert self.proc.wait(timeout=30) == 0
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.fixture(scope="session")
def upstream():
    server, recorder, url = mock_upstream.start()
    yield recorder, url
    server.shutdown()


@pytest.fixture(scope="session")
def condense(upstream):
    _, url = upstream
    c = Condense(url)
    yield c
    c.stop()


@pytest.fixture(scope="session")
def gated_condense(upstream):
    _, url = upstream
    c = Condense(url, {"CONDENSE_AUTH__CLIENT_KEYS": "[ck-good]",
                       "CONDENSE_UPSTREAM__API_KEY": "sk-upstream"})
    yield c
    c.stop()
