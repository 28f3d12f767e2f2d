"""Starts the real `tokenmill serve` on a free loopback port for end-to-end tests."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tokenmill.cli.server_subprocess import launch, stop


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    log_path: Path
    model: str
    api_key: str | None = None  # sent with every request but /metrics' when set

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, str]:
        req = urllib.request.Request(self.base_url + path, headers=self._headers())
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def post(self, path: str, body: object, timeout: float = 60.0) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **self._headers()}
        req = urllib.request.Request(self.base_url + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def metrics(self) -> dict[str, float]:
        _, text = self.get("/metrics")
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 30.0) -> int:
        return stop(self.proc, timeout)


def start_server(
    model: Path | str | None,
    log_path: Path,
    *args: str,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> ServerProcess:
    # NOTE: float32 unless a test asks otherwise: the e2e tests compare with float32 runners.
    dtype = [] if "--dtype" in args else ["--dtype", "float32"]
    proc, base_url = launch(model, [*dtype, *args], log_path, env=env, timeout=timeout)
    return ServerProcess(proc, int(base_url.rsplit(":", 1)[1]), log_path, str(model))


def generate_once(model: Path | str, log_path: Path, body: dict, *args: str) -> dict:
    """One /generate answer from a server started for it with `args`, which must then exit
    0 on SIGTERM."""
    server = start_server(model, log_path, *args)
    try:
        status, answer = server.post("/generate", body)
        assert status == 200, answer
    finally:
        assert server.stop() == 0
    return answer
