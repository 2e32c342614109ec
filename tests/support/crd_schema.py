"""The CRD schemas under tests/data/crds/ as the Kubernetes API server applies them, for tests and the fake API server.

With ``fieldValidation=Strict`` (kubectl's default; lmforge.launch sends it on every create) the API server
rejects a field that the CRD's structural schema does not declare, except under
``x-kubernetes-preserve-unknown-fields``; without it the field is pruned with a warning. The rule and the
message format follow KEP-2885 (server-side unknown field validation, kubernetes/enhancements
``keps/sig-api-machinery/2885-server-side-unknown-field-validation``) and the API server's answer to such a
create: ``400 BadRequest``, ``<Kind> in version "<v>" cannot be handled as a <Kind>: strict decoding error:
unknown field "spec.x"``.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

CRDS = Path(__file__).parents[1] / "data" / "crds"
TRAINER_CRDS = {  # Kubeflow Trainer release -> its TrainJob CRD
    "v2.1.0": CRDS / "trainer-v2.1.0" / "trainer.kubeflow.org_trainjobs.yaml",
    "v2.3.0": CRDS / "trainer-v2.3.0" / "trainer.kubeflow.org_trainjobs.yaml",
    "main": CRDS / "trainer.kubeflow.org_trainjobs.yaml",
}
RUNTIME_CRDS = {  # Kubeflow Trainer release -> its ClusterTrainingRuntime CRD
    "v2.1.0": CRDS / "trainer-v2.1.0" / "trainer.kubeflow.org_clustertrainingruntimes.yaml",
    "v2.3.0": CRDS / "trainer-v2.3.0" / "trainer.kubeflow.org_clustertrainingruntimes.yaml",
}
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def strict(schema: Any) -> Any:
    """The schema with every object closed (``additionalProperties: false``) unless it preserves unknown fields.

    ``x-kubernetes-*`` keys themselves (CEL rules, list types) are dropped; tests check the CEL rules that matter
    by hand.
    """
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    preserve = schema.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in schema and "additionalProperties" not in schema and not preserve:
        out["additionalProperties"] = False
    return out


@cache
def load_crd(path: Path) -> dict[str, Any]:
    """A CRD file, parsed."""
    return yaml.load(Path(path).read_text(encoding="utf-8"), Loader=_Loader)


def crd_schema(path: Path, version: str) -> dict[str, Any]:
    """The ``openAPIV3Schema`` of ``version`` in the CRD at ``path``."""
    (entry,) = [v for v in load_crd(path)["spec"]["versions"] if v["name"] == version]
    return entry["schema"]["openAPIV3Schema"]


def strict_validator(path: Path, version: str) -> jsonschema.Validator:
    """A validator that treats unknown fields as errors, as ``fieldValidation=Strict`` does."""
    return jsonschema.Draft7Validator(strict(crd_schema(path, version)))


def unknown_fields(obj: Any, schema: dict[str, Any], prefix: str = "", *, prune: bool = False) -> list[str]:
    """Dotted paths (``spec.runtimePatches``, ``spec.items[0].x``) of fields ``schema`` does not declare.

    With ``prune`` they are also deleted from ``obj``, as the API server does without strict validation.
    """
    found: list[str] = []
    if isinstance(obj, dict) and "properties" in schema:
        props = schema["properties"]
        for key in list(obj):
            path = f"{prefix}.{key}" if prefix else key
            if key in props:
                if path != "metadata":  # ObjectMeta is validated by the server's own types, not the CRD schema
                    found += unknown_fields(obj[key], props[key], path, prune=prune)
            elif not schema.get("x-kubernetes-preserve-unknown-fields") and "additionalProperties" not in schema:
                found.append(path)
                if prune:
                    del obj[key]
    elif isinstance(obj, list) and "items" in schema:
        for i, item in enumerate(obj):
            found += unknown_fields(item, schema["items"], f"{prefix}[{i}]", prune=prune)
    return found
