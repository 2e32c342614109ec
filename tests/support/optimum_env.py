"""A second Python environment with what optimum's ONNX Runtime extra installs: transformers 4.x, optimum,
optimum-onnx and onnxruntime, at optimum's own pins (optimum-onnx 0.1.0 requires transformers<4.58 and optimum~=2.1).

lmforge's own environment has transformers 5, so what users of transformers 4.x (optimum, vLLM, KServe's Hugging Face
runtime and the serving images that pin it) get from a release is tested here, in a subprocess. The interpreter is
found at ``$LMFORGE_OPTIMUM_PYTHON`` or at ``.venv-optimum/bin/python`` in the repository, made by ``make
.venv-optimum/bin/python`` (``make test`` makes it); :func:`optimum_python` says which, or why there is none.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV_PYTHON = REPO / ".venv-optimum" / "bin" / "python"
_PROBE = "import transformers, optimum.onnxruntime; assert transformers.__version__.startswith('4.')"


def optimum_python() -> tuple[str | None, str]:
    """The Python with optimum[onnxruntime] and transformers 4.x, and where it came from (or why there is none)."""
    for origin, path in (
        ("$LMFORGE_OPTIMUM_PYTHON", os.environ.get("LMFORGE_OPTIMUM_PYTHON")),
        (".venv-optimum", str(VENV_PYTHON)),
    ):
        if not path or not Path(path).exists():
            continue
        try:
            done = subprocess.run([path, "-c", _PROBE], capture_output=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0:
            return path, origin
    return (
        None,
        "no optimum environment with transformers 4.x: make .venv-optimum/bin/python (or set LMFORGE_OPTIMUM_PYTHON)",
    )
