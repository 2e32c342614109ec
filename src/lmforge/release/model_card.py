"""Model cards: the ``README.md`` with Hugging Face card metadata that every release carries, and ``lmforge push``.

A card states, in the YAML header ``huggingface_hub.ModelCard`` reads, ``library_name``, ``pipeline_tag``,
``license``, ``language``, ``tags``, ``base_model`` (when the run started from a hub model, ``evaluate.card``),
``datasets`` (the corpus and Q&A URIs; their fingerprints in the body) and ``model-index`` with the model's own
evaluation numbers: held-out perplexity and bits per byte, the held-out Q&A metrics and every
lm-evaluation-harness task metric, all copied from the evaluation's ``results.json`` (so the card and the report
show the same numbers). The student's card is the release's ``README.md`` and ``student/README.md``; each ONNX
folder gets its own (``library_name: onnx``) with that model's numbers.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lmforge import storage
from lmforge.contracts import scale_text
from lmforge.errors import ConfigError, LmforgeError

log = logging.getLogger("lmforge.promote")

CARD = "README.md"
HF_SCHEME = "hf://"
CARD_ARTIFACTS = {"student": "transformers", "onnx_fp32": "onnx", "int8_dynamic": "onnx", "int8_qdq": "onnx"}
"""Release folders that get a card, and the library that loads each."""
_QA_METRICS = (("exact_match", "exact_match"), ("f1", "f1"), ("bleu", "bleu"), ("rouge_l", "rouge"))
"""lmforge's Q&A metric and the Hub's metric type for it."""


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def eval_results(model: str, results: Mapping[str, Any]) -> list[Any]:
    """``huggingface_hub.EvalResult`` entries of ``model``'s numbers in ``results``."""
    from huggingface_hub import EvalResult

    entry = (results.get("models") or {}).get(model) or {}
    corpus = str(((results.get("data") or {}).get("clean") or {}).get("input") or "held-out corpus")
    qa_uri = str((results.get("generation") or {}).get("qa_uri") or "held-out Q&A")
    text = ("text-generation", "lmforge-heldout-text", f"held-out text of {corpus}")
    qa = ("question-answering", "lmforge-heldout-qa", f"held-out Q&A of {qa_uri}")
    # (task type, dataset type, dataset name, metric type, metric name, value)
    rows = [(*text, key, key.replace("_", " "), entry.get(key)) for key in ("perplexity", "bits_per_byte")]
    rows += [(*qa, metric, f"{key} ({scale_text(key, '-')})", entry.get(key)) for key, metric in _QA_METRICS]
    harness = results.get("harness") or {}
    for task, scores in ((harness.get("scores") or {}).get(model) or {}).items():
        task_row = ("text-generation", task, f"lm-evaluation-harness {task}")
        rows += [(*task_row, m, m, v) for m, v in scores.items() if not m.endswith("_stderr")]
    return [
        EvalResult(
            task_type=task_type,
            dataset_type=dataset_type,
            dataset_name=dataset_name,
            metric_type=metric_type,
            metric_name=metric_name,
            metric_value=float(value),
        )
        for task_type, dataset_type, dataset_name, metric_type, metric_name, value in rows
        if _finite(value)
    ]


def _datasets(results: Mapping[str, Any], inputs: Mapping[str, Any]) -> list[tuple[str, str | None]]:
    corpus = ((results.get("data") or {}).get("clean") or {}).get("input")
    qa = (results.get("generation") or {}).get("qa_uri")
    shards = (inputs.get("shards") or {}).get("fingerprint")
    return [(str(uri), fp) for uri, fp in ((corpus, shards), (qa, None)) if uri]


def model_card(
    *, model_name: str, version: str, artifact: str, results: Mapping[str, Any], evaluation: Mapping[str, Any]
) -> str:
    """The card of one release folder (``artifact``) as ``README.md`` text.

    Args:
        model_name, version: the release.
        artifact: ``student`` or an ONNX folder (:data:`CARD_ARTIFACTS`).
        results: the evaluation's ``results.json``.
        evaluation: the evaluation's manifest (its ``config.card`` and ``inputs``).
    """
    from huggingface_hub import ModelCard, ModelCardData

    card_cfg = (evaluation.get("config") or {}).get("card") or {}
    datasets = _datasets(results, evaluation.get("inputs") or {})
    data = ModelCardData(
        model_name=f"{model_name} {version} ({artifact})",
        library_name=CARD_ARTIFACTS.get(artifact, "transformers"),
        pipeline_tag="text-generation",
        license=card_cfg.get("license") or "other",
        language=card_cfg.get("language") or None,
        tags=[*(card_cfg.get("tags") or []), artifact],
        base_model=card_cfg.get("base_model") or None,
        datasets=[uri for uri, _ in datasets] or None,
        eval_results=eval_results(artifact, results) or None,
    )
    verdict = [line for line in results.get("verdict") or [] if line.startswith(f"{artifact}")]
    lines = [
        f"# {model_name} {version}: {artifact}",
        "",
        f"Made by lmforge; the release's gate {'passed' if results.get('passed') else 'failed'} "
        f"(served model: {results.get('served_model')}).",
        "",
        *(["## Verdict", "", *(f"- {line}" for line in verdict), ""] if verdict else []),
        "## Training data",
        "",
        "| dataset | fingerprint |",
        "|---|---|",
        *(f"| `{uri}` | {f'`{fp}`' if fp else 'not recorded'} |" for uri, fp in datasets),
        "",
        "## Evaluation",
        "",
        "The numbers in the metadata above come from the evaluation report (evaluation/report.html in the release).",
    ]
    return ModelCard.from_template(data, template_str="---\n{{ card_data }}\n---\n\n" + "\n".join(lines) + "\n").content


def write_cards(
    target: str, artifacts: list[str], *, model_name: str, version: str, results: Any, evaluation: Any
) -> None:
    """Write the release's ``README.md`` (the student's card) and one in every card folder present in ``artifacts``."""
    for artifact in artifacts:
        if artifact in CARD_ARTIFACTS:
            text = model_card(
                model_name=model_name, version=version, artifact=artifact, results=results, evaluation=evaluation
            )
            storage.write_bytes(storage.join(target, artifact, CARD), text.encode())
            if artifact == "student":
                storage.write_bytes(storage.join(target, CARD), text.encode())


def parse_hub_target(target: str) -> str:
    """``org/name`` of ``hf://org/name``.

    Raises:
        ConfigError: not of that form.
    """
    repo = target[len(HF_SCHEME) :] if target.startswith(HF_SCHEME) else ""
    parts = repo.split("/")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"--to {target!r}: expected hf://<org>/<name>")
    return repo


def push(release: str, target: str, *, artifact: str = "student", token: str | None = None) -> str:
    """Upload one folder of a release (its card included) to the Hugging Face Hub repository ``target``
    (``hf://org/name``), creating the repository if needed; return the commit URL.

    The hub is ``$HF_ENDPOINT`` (default huggingface.co); the token is ``token`` or ``$HF_TOKEN``.

    Raises:
        ConfigError: a bad target, or no token.
        LmforgeError: the folder has no card, or the hub could not be reached or refused the upload.
    """
    repo = parse_hub_target(target)
    token = token or os.environ.get("HF_TOKEN")
    if not token:
        raise ConfigError("lmforge push needs a Hugging Face token: set HF_TOKEN or pass --token")
    from huggingface_hub import HfApi

    with tempfile.TemporaryDirectory(prefix="lmforge-push-") as scratch:
        root = storage.localize(storage.join(release, artifact), scratch) if storage.is_s3(release) else None
        folder = root or Path(release, artifact)
        if not Path(folder, CARD).is_file():
            raise LmforgeError(f"{storage.join(release, artifact)} has no {CARD}; push a release promote wrote")
        api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None, token=token)
        try:
            api.create_repo(repo, repo_type="model", exist_ok=True)
            commit = api.upload_folder(
                repo_id=repo, folder_path=str(folder), commit_message=f"lmforge release {release}"
            )
        except Exception as exc:  # the network boundary: connection refused, DNS, HTTP 4xx/5xx from the hub
            raise LmforgeError(f"push to {target} ({api.endpoint}) failed: {exc}") from exc
    log.info("pushed %s to %s", folder, commit.commit_url)
    return str(commit.commit_url)
