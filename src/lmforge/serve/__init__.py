"""Serving a released model: the lmforge predictor on KServe's ModelServer, InferenceService manifests, Triton.

* :mod:`lmforge.serve.server` — :func:`~lmforge.serve.server.serve_model`: the predictor in ``kserve.ModelServer``
  (REST v1, Open Inference Protocol v2, OpenAI completions) for a release or an ONNX model directory;
* :mod:`lmforge.serve.predictor` — the ``kserve.Model``: ONNX Runtime with the KV-cache graph, continuous batching
  (:mod:`~lmforge.serve.batcher`, :mod:`~lmforge.serve.generate`) and streaming;
* :mod:`lmforge.serve.manifests` — KServe ``InferenceService`` / ``ServingRuntime`` dicts and the Triton model
  repository (``config.pbtxt``);
* :mod:`lmforge.serve.apply` — create or update the InferenceService and wait for Ready;
* :mod:`lmforge.serve.serve` — the ``serve`` stage: those objects written for a release, and applied.

Only the first two import ``kserve`` (the ``serve`` extra); manifests need nothing beyond the core install.
"""
