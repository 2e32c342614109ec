"""The ``kserve`` names the predictor uses, imported without letting kserve read this process's command line.

``kserve.model_server`` parses ``sys.argv`` when it is first imported (``parse_known_args`` with abbreviations,
so an unrelated ``--config ...`` would be taken for its ``--configure_logging``); it sees only the program name.
"""

from __future__ import annotations

import sys

_argv, sys.argv = sys.argv, sys.argv[:1]
try:
    from kserve import Model, ModelServer
    from kserve.constants.constants import FASTAPI_APP_IMPORT_STRING
    from kserve.errors import InferenceError, InvalidInput, ModelNotFound
    from kserve.model_server import app
    from kserve.protocol.infer_type import InferOutput, InferRequest, InferResponse
    from kserve.protocol.rest.server import RESTServer
finally:
    sys.argv = _argv

__all__ = [
    "FASTAPI_APP_IMPORT_STRING",
    "InferOutput",
    "InferRequest",
    "InferResponse",
    "InferenceError",
    "InvalidInput",
    "Model",
    "ModelNotFound",
    "ModelServer",
    "RESTServer",
    "app",
]
