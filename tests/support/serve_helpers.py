"""Helpers of the serve tests and bench/serve_bench.py: a predictor subprocess on loopback, a varied tiny model,
and a load of well-formed and hostile requests.

:class:`ServeProcess` starts ``python -m lmforge.serve`` (the real kserve ModelServer), or ``lmforge serve``, on a free
127.0.0.1 port.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

from lmforge.artifacts import write_manifest
from lmforge.config import ExportConfig
from lmforge.export import export_onnx
from lmforge.model.build import load_causal_lm, load_tokenizer, save_model_dir

READY_TIMEOUT_S = 180.0


def free_port() -> int:
    """A TCP port nothing listens on now (bound and released on 127.0.0.1)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServeProcess:
    """A predictor subprocess; ``url`` once :meth:`start` returned."""

    def __init__(
        self, model_path: Path, log_file: Path, overrides: dict[str, Any] | None = None, *, cli: bool = False
    ) -> None:
        self.model_path = model_path
        self.log_file = log_file
        self.overrides = overrides or {}
        self.cli = cli  # start it as `lmforge serve PATH --set serve.K=V` instead of the image's entry point
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ServeProcess:
        """Start the server and wait (bounded) until its v2 readiness route answers."""
        if self.cli:
            cmd = [sys.executable, "-m", "lmforge", "serve", str(self.model_path), "--port", str(self.port)]
            for key, value in self.overrides.items():
                cmd += ["--set", f"serve.{key}={json.dumps(value)}"]
        else:
            cmd = [sys.executable, "-m", "lmforge.serve", str(self.model_path), "--host", "127.0.0.1"]
            cmd += ["--port", str(self.port), "--overrides", json.dumps(self.overrides)]
        with open(self.log_file, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"predictor exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/v2/health/ready", timeout=2.0).status_code == 200:
                    return self
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"predictor not ready after {READY_TIMEOUT_S:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        """The last lines the server logged."""
        text = self.log_file.read_text(errors="replace") if self.log_file.is_file() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM (uvicorn shuts down gracefully), then SIGKILL if it lingers."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


@contextlib.contextmanager
def serving(
    model_path: Path, log_file: Path, overrides: dict[str, Any] | None = None, *, cli: bool = False
) -> Iterator[ServeProcess]:
    """A started :class:`ServeProcess`, stopped on exit."""
    server = ServeProcess(model_path, log_file, overrides, cli=cli).start()
    try:
        yield server
    finally:
        server.stop()


def redraw_weights(model_dir: Path, out: Path, *, std: float = 0.3, seed: int = 0) -> Path:
    """Save ``model_dir`` with every matrix redrawn ~ N(0, std²) into ``out``.

    A freshly initialized tiny GPT-2 (std 0.02, tied embedding) greedily repeats one token, which cannot tell a
    right decoder from a wrong one; with larger weights its continuations vary and argmax margins are clear.
    """
    model = load_causal_lm(model_dir)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    save_model_dir(model, load_tokenizer(model_dir), out)
    write_manifest(out, "model")
    return out


def export_redrawn(model_dir: Path, work: Path) -> Path:
    """``model_dir`` with redrawn weights (:func:`redraw_weights`, in ``work/model``) exported by the real
    ``export_onnx`` stage into ``work/onnx``."""
    export_onnx.run(ExportConfig(), model=redraw_weights(model_dir, work / "model"), onnx_model=work / "onnx")
    return work / "onnx"


@dataclass(frozen=True)
class Answer:
    """One request of :func:`mixed_load`: hostile or not, which kind, its HTTP status and latency."""

    hostile: bool
    kind: str
    status: int
    latency_s: float


def hostile_request(i: int, model: str) -> tuple[str, str, bytes]:
    """The ``i``-th hostile request, cycling through the attacks: ``(kind, path, body)``."""
    kinds = [
        ("bad_seed", "/openai/v1/completions", {"model": model, "prompt": "hi", "temperature": 1.0, "seed": -1}),
        ("tiny_temperature", "/openai/v1/completions", {"model": model, "prompt": "hi", "temperature": 1e-310}),
        ("10k_prompts", "/openai/v1/completions", {"model": model, "prompt": ["To be"] * 10_000}),
        ("10k_instances", f"/v1/models/{model}:predict", {"instances": ["To be"] * 10_000}),
        ("malformed_json", "/openai/v1/completions", None),
        ("deep_json", f"/v2/models/{model}/infer", None),
    ]
    kind, path, body = kinds[i % len(kinds)]
    if kind == "malformed_json":
        return kind, path, b'{"model": "' + model.encode() + b'", "prompt": "unterminated'
    if kind == "deep_json":
        return kind, path, b"[" * 100_000
    return kind, path, json.dumps(body).encode()


async def mixed_load(
    url: str,
    prompts: list[str],
    *,
    model: str,
    requests: int,
    concurrency: int,
    hostile_share: float,
    max_tokens: int,
) -> list[Answer]:
    """``requests`` requests from ``concurrency`` clients in a closed loop; every ``1 / hostile_share``-th one is
    hostile (:func:`hostile_request`), the others are greedy OpenAI completions of ``prompts``."""
    every = round(1 / hostile_share) if hostile_share > 0 else 0
    order = iter(range(requests))
    answers: list[Answer] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(base_url=url, timeout=120.0, limits=limits, headers=headers) as client:

        async def client_loop() -> None:
            for i in order:
                if every and i % every == every - 1:
                    kind, path, body = hostile_request(i // every, model)
                else:
                    prompt = prompts[i % len(prompts)]
                    kind, path = "completion", "/openai/v1/completions"
                    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
                    body = body.encode()
                start = time.perf_counter()
                resp = await client.post(path, content=body)
                answers.append(Answer(kind != "completion", kind, resp.status_code, time.perf_counter() - start))

        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    return answers
