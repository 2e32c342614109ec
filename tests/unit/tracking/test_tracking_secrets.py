"""No credential reaches MLflow: every param, tag, model-version tag and artifact is read back and grepped."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from lmforge.report_html import breakable
from lmforge.results import StageResult
from lmforge.tracking import PipelineRun, Tracker, register_release
from tests.support.escapes import spelled_out

pytestmark = pytest.mark.s3

ENV_SECRETS = {
    "AWS_ACCESS_KEY_ID": "AKIALMFORGETEST0001",
    "AWS_SECRET_ACCESS_KEY": "aws-secret-value-4f1c9e",
    "AWS_SESSION_TOKEN": "aws-session-token-77ab",
    "HF_TOKEN": "hf_lmforgetesttoken123",
    "MLFLOW_TRACKING_TOKEN": "mlflow-bearer-token-5d2",  # sent as a header; the test server ignores it
}
CONFIG_SECRET = "config-secret-value-31337"
URL_PASSWORD = "url-password-8a8a"
ALL_SECRETS = [*ENV_SECRETS.values(), CONFIG_SECRET, URL_PASSWORD]


def _rest(uri: str, path: str, body: dict | None = None) -> str:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"{uri}{path}", data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as resp:
        return resp.read().decode()


def test_credentials_in_env_config_summary_and_files_appear_in_no_param_tag_or_artifact(
    tracking_env, mlflow_server, monkeypatch, tmp_path
):
    for key, value in ENV_SECRETS.items():
        monkeypatch.setenv(key, value)
    cfg = {
        "storage": {
            "endpoint": f"https://lmforge:{URL_PASSWORD}@s3.example.com",
            "secret_access_key": CONFIG_SECRET,
            "bucket": "models",
        },
        "launch": {"env": {"API_TOKEN": CONFIG_SECRET}},
        "tokenize": {"eos_token": "<|endoftext|>", "vocab_size": 512},
    }
    out = tmp_path / "model"
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({"kind": "model", "note": ENV_SECRETS["AWS_SECRET_ACCESS_KEY"]}))
    (out / "report.html").write_text(f"<p>token {ENV_SECRETS['HF_TOKEN']} and {CONFIG_SECRET}</p>")
    result = StageResult(
        metrics={"loss": 1.0},
        html=f"<p>{ENV_SECRETS['MLFLOW_TRACKING_TOKEN']}</p>",
        summary={
            "copied_from": f"s3://b/k?key={ENV_SECRETS['AWS_ACCESS_KEY_ID']}",
            "session": ENV_SECRETS["AWS_SESSION_TOKEN"],
        },
    )
    tracker = Tracker()
    child = tracker.track_stage("pretrain", cfg, result, run=PipelineRun("kfp-secrets"), outputs={"model": out})
    with pytest.raises(ValueError), tracker.stage_run("evaluate", cfg, run=PipelineRun("kfp-secrets")) as failed:
        raise ValueError(f"could not sign with {ENV_SECRETS['AWS_SECRET_ACCESS_KEY']}")
    manifest = {
        "kind": "release",
        "model_name": "secrets",
        "version": "v1",
        "created_at": "2026-12-01T00:00:00.000Z",
        "run_id": "kfp-secrets",
        "artifacts": {"student": {"fingerprint": "f" * 64, "source_uri": f"https://u:{URL_PASSWORD}@host/student"}},
        "evaluation": {"gate": {"passed": True, "checks": []}, "metrics": {"student_bits_per_byte": 1.0}},
    }
    registration = register_release(f"s3://releases/models/secrets/v1?sig={CONFIG_SECRET}", manifest, tracker=tracker)

    assert child is not None and failed.run_id is not None and registration is not None
    uri = mlflow_server.uri
    experiment = tracker.session.experiment_id()
    seen = _rest(uri, "/api/2.0/mlflow/runs/search", {"experiment_ids": [experiment], "max_results": 1000})
    seen += _rest(uri, "/api/2.0/mlflow/registered-models/search?max_results=100")
    seen += _rest(uri, "/api/2.0/mlflow/model-versions/search?filter=name%3D%27secrets%27")
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    for run_id in (child, failed.run_id):
        folder = Path(client.download_artifacts(run_id, "", str(tmp_path / "down" / run_id)))
        seen += "".join(p.read_text(encoding="utf-8") for p in folder.rglob("*") if p.is_file())
    for secret in ALL_SECRETS:
        assert secret not in seen, f"{secret} reached MLflow"
    # ... and it is the redaction that kept them out (the logging happened):
    params = client.get_run(child).data.params
    assert params["storage.secret_access_key"] == "***"
    assert params["launch.env.API_TOKEN"] == "***"
    assert params["storage.endpoint"] == "https://lmforge:***@s3.example.com"
    assert params["tokenize.eos_token"] == "<|endoftext|>"  # a special token is not a credential
    assert params["storage.bucket"] == "models"
    assert "***" in client.get_run(failed.run_id).data.tags["lmforge.error"]
    assert (Path(tmp_path / "down" / child) / "model" / "report.html").read_text() == "<p>token *** and ***</p>"


def test_a_secret_escaped_or_broken_up_in_uploaded_files_reaches_the_server_in_no_form(
    tracking_env, mlflow_server, monkeypatch, tmp_path
):
    """An AWS-style secret key in an input path, as report.html renders it (escaped, ``<wbr>`` after each separator),
    as JSON writes it, URL-encoded in Markdown, and in a log-like file that is not valid UTF-8: what the real server
    keeps is read back and decoded by the standard library's HTML, JSON and URL decoders."""
    secret = "wJalrXUtnFEMI/K7MDENG+bPxRfi&CYEXAMPLEKEY"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    source = f"s3://corpus/{secret}/part-0.jsonl"
    out = tmp_path / "data"
    out.mkdir()
    (out / "report.html").write_text(f"<p>input <code>{breakable(source)}</code></p>", encoding="utf-8")
    (out / "manifest.json").write_text(json.dumps({"source": source}).replace("/", "\\/"), encoding="utf-8")
    (out / "report.md").write_text(f"[input](https://h/get?u={urllib.parse.quote(source, safe='')})\n")
    (out / "stats.json").write_bytes(b'{"note": "caf\xe9 ' + "\u00ad".join(secret).encode() + b'"}')
    result = StageResult(metrics={"docs": 1.0}, html=f"<p>{breakable(source)}</p>")

    tracker = Tracker()
    run_id = tracker.track_stage("clean", {}, result, run=PipelineRun("kfp-escaped"), outputs={"data": out})

    from mlflow import MlflowClient

    folder = Path(MlflowClient(mlflow_server.uri).download_artifacts(run_id, "data", str(tmp_path / "down")))
    uploaded = {p.name: p.read_bytes().decode("utf-8", errors="replace") for p in folder.iterdir()}
    assert sorted(uploaded) == ["manifest.json", "report.html", "report.md", "stats.json"]
    for name, text in uploaded.items():
        assert not spelled_out(text, secret), f"{name} reached MLflow with the secret: {text}"
        assert "***" in text, name  # scrubbed, not dropped
    assert "part-<wbr>0.<wbr>jsonl" in uploaded["report.html"]  # the rest of the page is as rendered
    assert (folder / "stats.json").read_bytes().startswith(b'{"note": "caf\xe9 ***')  # the odd byte kept as is
