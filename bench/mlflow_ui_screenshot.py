"""A screenshot of the MLflow UI comparing two pipeline runs, for the docs (docs/mlflow-compare.png).

Starts the test tracking server (tests/support/mlflow_server.py: SQLite store and artifacts in a temporary folder,
loopback only), logs two small real pipeline runs to it through :mod:`lmforge.tracking` (a BPE tokenizer
and token shards from the packaged Shakespeare scenes, then a 2-layer GPT-2 pretrained for a few steps, at
two learning rates), and has headless Chromium render MLflow's run comparison page.

    python bench/mlflow_ui_screenshot.py [--out docs/mlflow-compare.png] [--steps 60] [--level stage|pipeline]

``--level pipeline`` compares the two parent runs (each stage's final figures as ``<stage>.<name>``);
``stage`` compares the two ``pretrain`` runs (config params side by side and the loss per step). Needs the
server environment of tests/support/mlflow_server.py and ``chromium`` (Debian: ``apt-get install -y chromium``).
"""

from __future__ import annotations

import argparse
import base64
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

from lmforge.config import CheckpointConfig, ModelConfig, PretrainConfig, TokenizeConfig, TrainConfig
from lmforge.data.demo import shakespeare_documents
from lmforge.results import StageResult
from lmforge.tracking import PipelineRun, Tracker
from tests.support.demo_artifacts import write_shards, write_tokenizer
from tests.support.mlflow_server import MlflowServer, server_executable  # python -m from the repository root

ROOT = Path(__file__).resolve().parents[1]


def _data(work: Path) -> tuple[Path, Path, StageResult]:
    """A tokenizer and token shards of 80 scenes (every 10th in ``val``), and the tokenize stage's result."""
    docs = [d["text"] for d in itertools.islice(shakespeare_documents(), 80)]
    tok_dir = write_tokenizer(docs, work / "tokenizer", vocab_size=512)
    shards = work / "shards"
    tokens = write_shards(docs, tok_dir, shards, shard_tokens=50_000)
    return tok_dir, shards, StageResult(metrics={"documents": float(len(docs)), "tokens": float(tokens)})


def _pretrain_cfg(lr: float, steps: int) -> PretrainConfig:
    return PretrainConfig(
        model=ModelConfig(arch="gpt2", n_layer=2, n_head=2, n_embd=64, block_size=64),
        train=TrainConfig(
            max_steps=steps, batch_size=8, grad_accum=1, seq_len=64, lr=lr, min_lr=lr / 10, warmup_steps=3,
            precision="fp32", eval_interval=5, eval_batches=2, log_interval=1, checkpoint=CheckpointConfig(),
        ),
    )  # fmt: skip


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if found is None:
        raise SystemExit("chromium not found (Debian: apt-get install -y chromium)")
    return found


def _screenshot(url: str, out: Path, work: Path, size: tuple[int, int]) -> None:
    """Capture ``url`` in headless Chromium, driven over the DevTools protocol (loopback only).

    The MLflow UI opens its assistant panel on the first visit from localhost; it is closed first (the UI
    remembers that), so the capture shows the comparison alone.
    """
    import websocket  # websocket-client, a dependency of the kubernetes client

    profile = work / "chromium-profile"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"]
    flags += ["--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", f"--user-data-dir={profile}"]
    browser = subprocess.Popen(
        [_chromium(), *flags, f"--window-size={size[0]},{size[1]}", "about:blank"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "HOME": str(work)},
    )
    try:
        port_file = profile / "DevToolsActivePort"
        _wait(lambda: port_file.is_file() and port_file.read_text().strip() != "", "chromium's DevTools port")
        port = port_file.read_text().split()[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as resp:
            page = next(t for t in json.load(resp) if t["type"] == "page")
        ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=60, suppress_origin=True)
        calls = itertools.count(1)

        def call(method: str, **params: object) -> dict:
            ident = next(calls)
            ws.send(json.dumps({"id": ident, "method": method, "params": params}))
            while True:
                message = json.loads(ws.recv())
                if message.get("id") == ident:
                    if "error" in message:
                        raise SystemExit(f"DevTools {method}: {message['error']}")
                    return message.get("result", {})

        def js(expression: str) -> object:
            return call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

        call("Emulation.setDeviceMetricsOverride", width=size[0], height=size[1], deviceScaleFactor=1, mobile=False)
        close = "document.querySelector('[data-component-id=\"mlflow.assistant.chat_panel.close\"]')"
        call("Page.navigate", url=url.split("#", 1)[0] + "#/experiments")
        _wait(lambda: js(f"!!{close}"), "the MLflow UI", timeout=60)
        js(f"{close}.click()")
        call("Page.navigate", url=url)
        _wait(lambda: js("document.body.innerText.includes('Comparing')"), "the comparison page", timeout=60)
        time.sleep(3)  # the charts draw after the data arrives
        js("document.querySelectorAll('[role=\"switch\"]').forEach(s => s.click())")  # "Show diff only"
        time.sleep(1)
        png = call("Page.captureScreenshot", format="png")["data"]
        out.write_bytes(base64.b64decode(png))
        ws.close()
    finally:
        browser.terminate()
        browser.wait(timeout=30)


def _wait(ready, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.5)


def main() -> None:
    """Start the server, log two runs, capture the comparison page."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "mlflow-compare.png")
    parser.add_argument("--steps", type=int, default=60, help="Pretraining steps per run.")
    parser.add_argument("--level", choices=("pipeline", "stage"), default="stage")
    parser.add_argument("--width", type=int, default=1400)
    parser.add_argument("--height", type=int, default=1500)
    args = parser.parse_args()
    executable, origin = server_executable()
    if executable is None:
        raise SystemExit(origin)
    from lmforge.train import pretrain

    with tempfile.TemporaryDirectory(prefix="lmforge-mlflow-shot-") as tmp:
        work = Path(tmp)
        tok_dir, shards, tokenized = _data(work)
        with MlflowServer(work / "server", executable) as server:
            os.environ["MLFLOW_TRACKING_URI"] = server.uri
            os.environ["MLFLOW_EXPERIMENT_NAME"] = "lmforge"
            tracker = Tracker()
            compared: list[str] = []
            for i, lr in enumerate((1e-3, 1e-2)):
                run = PipelineRun(f"demo-run-{i + 1}", pipeline_version="0.1.0", preset="tiny-cpu")
                tracker.track_stage("tokenize", TokenizeConfig(vocab_size=512), tokenized, run=run)
                cfg = _pretrain_cfg(lr, args.steps)
                model = work / f"model-{i}"
                result = pretrain.run(cfg, shards=shards, tokenizer=tok_dir, model=model)
                stage = tracker.track_stage("pretrain", cfg, result, run=run, outputs={"model": model})
                compared.append(stage if args.level == "stage" else tracker.pipeline_run_id(run))
                tracker.end_pipeline_run(run)
            experiment = tracker.session.experiment_id()
            query = urllib.parse.urlencode({"runs": json.dumps(compared), "experiments": json.dumps([experiment])})
            url = f"{server.uri}/#/compare-runs?{query}"
            args.out.parent.mkdir(parents=True, exist_ok=True)
            _screenshot(url, args.out, work, (args.width, args.height))
    print(json.dumps({"screenshot": str(args.out), "compared_runs": compared, "url_path": url.split("#", 1)[1]}))


if __name__ == "__main__":
    main()
