"""A real `kiln serve` process on a free loopback port, for the server tests and the load script."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m kiln.cli serve --port <free port> *args`, its log in a temporary file."""

    def __init__(self, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="kiln-serve-", suffix=".log", delete=False)
        env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, "-m", "kiln.cli", "serve", "--port", str(self.port), *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.port_open_s: float | None = None  # process start -> first HTTP answer
        self.ready_s: float | None = None  # process start -> /health 200
        self.before_ready: dict[str, tuple[int, dict]] = {}  # first answers seen while starting

    def wait_ready(self, timeout_s: float = 180.0) -> "ServerProcess":
        """Poll /health until 200; on the way, record what /health and /v1/models said."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kiln serve exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                status, body = self.get("/health")
            except OSError:
                time.sleep(0.05)
                continue
            if self.port_open_s is None:
                self.port_open_s = time.perf_counter() - self.started
            if status == 200:
                self.ready_s = time.perf_counter() - self.started
                return self
            self.before_ready.setdefault("health", (status, body))
            self.before_ready.setdefault("models", self.get("/v1/models"))
            time.sleep(0.05)
        raise TimeoutError(f"kiln serve was not ready after {timeout_s} s:\n{self.log_text()}")

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict | None = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def get(self, path: str) -> tuple[int, dict]:
        status, body = self.request("GET", path)
        return status, json.loads(body)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, keyed by name and labels: 'kiln_requests_total{finish_reason=abort,...}'."""
        status, body = self.request("GET", "/metrics")
        assert status == 200
        samples = {}
        for family in text_string_to_metric_families(body.decode()):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return samples

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then SIGKILL if it lingers; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode

    def log_text(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()[-6000:]
