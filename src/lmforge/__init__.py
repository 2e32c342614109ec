"""lmforge: raw text to an evaluated, quantized, releasable language model, as one Kubeflow pipeline.

The library holds all stage logic and never imports ``kfp``; see ``components/`` and ``pipelines/``.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("lmforge")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
