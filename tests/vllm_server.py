"""A real vLLM engine (its OpenAI server) for the engine tests: started from the command
:class:`kvbus.infra.vllm_engine.EngineSpec` gives, in a process group of its own, and asked over HTTP
with the standard library."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kvbus.infra.vllm_engine import EngineSpec

MODEL_DIR = Path(__file__).resolve().parent / "vllm_model"
"""The tiny Llama the engine tests run (a config.json: 2 layers, hidden 64, vocab 1024, dummy weights)."""
START_TIMEOUT = 600.0
"""Seconds an engine may take to answer /v1/models after its start (80-160 s seen on a loaded VM)."""


class VllmServer:
    """One running engine: ``spec`` started with ``python`` (the engine venv's), output in ``log``."""

    def __init__(self, python: Path, spec: EngineSpec, log: Path) -> None:
        self.spec, self.log = spec, log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(spec.command(python), stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, **spec.environment()}, start_new_session=True)
        self.url = f"http://127.0.0.1:{spec.port}"

    def wait_ready(self, timeout: float = START_TIMEOUT) -> float:
        """Wait until the server lists its model; returns the seconds it took. Fails with the log's tail
        if the process exits or the time runs out."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.proc.poll() is not None:
                raise AssertionError(f"the engine exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as r:
                    if self.spec.served_name in r.read().decode():
                        return time.monotonic() - started
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1)
        raise AssertionError(f"the engine did not list its model within {timeout:.0f}s:\n{self.tail()}")

    def tail(self, chars: int = 3000) -> str:
        """The end of the engine's log."""
        return self.log.read_text(errors="replace")[-chars:]

    def _post(self, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else b""
        req = urllib.request.Request(f"{self.url}{path}", data, {"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=120) as r:
            text = r.read().decode()
        return json.loads(text) if text.strip() else {}

    def complete(self, tokens: list[int], cache_salt: str | None = None, max_tokens: int = 2) -> int:
        """Send one greedy completion of the prompt ``tokens`` (``max_tokens`` out: identical prompts decode
        identical tokens); returns the prompt tokens the engine took from its prefix cache
        (``usage.prompt_tokens_details.cached_tokens``)."""
        body: dict[str, Any] = {"model": self.spec.served_name, "prompt": tokens, "max_tokens": max_tokens,
                                "temperature": 0.0, "ignore_eos": True}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        usage = self._post("/v1/completions", body)["usage"]
        return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0

    def reset_prefix_cache(self) -> None:
        """``POST /reset_prefix_cache`` (served with ``VLLM_SERVER_DEV_MODE=1``)."""
        self._post("/reset_prefix_cache", None)

    def kill(self) -> None:
        """SIGKILL the engine's process group (the API server and its engine core)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)
