"""Starts the mock upstreams and the real condense binary in front of them."""

import os
import queue
import re
import subprocess
import threading
import urllib.request
from pathlib import Path

import pytest

import mock_anthropic
import mock_upstream

ROOT = Path(__file__).resolve().parents[2]


def _binary():
    path = os.environ.get("CONDENSE_BIN") or str(ROOT / "target" / "debug" / "condense")
    if not Path(path).exists():
        pytest.fail(f"condense binary not found at {path}; run `cargo build` or set CONDENSE_BIN")
    return path


def anthropic_upstream_env(anthropic_url, openai_url):
    """The environment that points condense at a mock Anthropic upstream
    (anthropic_url) and a mock OpenAI one (openai_url), both
    http://127.0.0.1:PORT/v1."""
    return {"CONDENSE_UPSTREAM__BASE_URL": openai_url, "CONDENSE_UPSTREAM__ANTHROPIC_BASE_URL": anthropic_url}


class Condense:
    """The condense binary on a free port. upstream_url sets
    upstream.base_url (None: extra_env does); args go after the binary's
    name, e.g. ["--config", path] (without it condense reads
    config/condense.toml)."""

    def __init__(self, upstream_url, extra_env=None, args=()):
        env = {k: v for k, v in os.environ.items() if not k.startswith("CONDENSE_")}
        env.update({
            "CONDENSE_SERVER__LISTEN": "127.0.0.1:0",
            "CONDENSE_LOG__FORMAT": "text",
            "NO_COLOR": "1",
        })
        if upstream_url is not None:
            env["CONDENSE_UPSTREAM__BASE_URL"] = upstream_url
        env.update(extra_env or {})
        self.log = []
        self.proc = subprocess.Popen([_binary(), *args], env=env, cwd=ROOT,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        found = queue.Queue()

        def read():
            for line in self.proc.stderr:
                self.log.append(line)
                m = re.search(r"listen=(\S+)", line)
                if m:
                    found.put(m.group(1))

        threading.Thread(target=read, daemon=True).start()
        try:
            self.addr = found.get(timeout=30)
        except queue.Empty:
            self.proc.kill()
            raise RuntimeError("condense did not report its listen address:\n" + "".join(self.log))
        # The OpenAI SDKs take the base URL with /v1, Anthropic's without it.
        self.base_url = f"http://{self.addr}/v1"
        self.root_url = f"http://{self.addr}"

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


@pytest.fixture(scope="session")
def anthropic_upstream():
    server, recorder, url = mock_anthropic.start()
    yield recorder, url
    server.shutdown()


def anthropic_condense_for(anthropic_url, openai_url, tmp_dir=None, config_toml=None):
    """condense in front of the Anthropic mock; with config_toml, started
    with --config on that text (written into tmp_dir)."""
    args = ()
    if config_toml is not None:
        path = Path(tmp_dir) / "condense.toml"
        path.write_text(config_toml)
        args = ("--config", str(path))
    return Condense(None, anthropic_upstream_env(anthropic_url, openai_url), args)


@pytest.fixture(scope="session")
def anthropic_condense(anthropic_upstream, upstream):
    c = anthropic_condense_for(anthropic_upstream[1], upstream[1])
    yield c
    c.stop()


def scrape_metrics(condense):
    """condense's /metrics as {(name, frozenset of label pairs): value}."""
    text = urllib.request.urlopen(f"http://{condense.addr}/metrics", timeout=10).read().decode()
    samples = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$", line)
        if m:
            labels = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
            samples[(m.group(1), labels)] = float(m.group(3))
    return samples
