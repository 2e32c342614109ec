"""KFP component: LoRA fine-tuning on prompt/response pairs."""

from kfp import dsl
from kfp.dsl import HTML, Input, Metrics, Model, Output

from components.images import image_for


@dsl.component(base_image=image_for("finetune_lora"), install_kfp_package=False)
def finetune_lora(
    base_model: Input[Model],
    qa_uri: str,
    adapter: Output[Model],
    merged_model: Output[Model],
    metrics: Output[Metrics],
    curves: Output[HTML],
    qa_fingerprint: str = "",
    preset: str = "tiny-cpu",
    overrides: str = "{}",
):
    """Fine-tune the base model with LoRA (prompt tokens masked from the loss); emit adapter and merged model.

    Args:
        base_model: Hugging Face causal LM directory (e.g. from ``pretrain``).
        qa_uri: JSONL with ``prompt``/``response`` per line (local, ``s3://`` or ``demo://chatterbot``).
        adapter: PEFT adapter directory.
        merged_model: Standalone model with the adapter merged in.
        metrics: Held-out answer loss before/after, trainable fraction, tokens/s.
        curves: HTML loss curves.
        qa_fingerprint: Content hash of the Q&A data from ``preflight``; part of the cache key, so changed data
            behind the same URI is never served from cache. Recorded on the adapter artifact.
        preset: lmforge preset the stage config starts from.
        overrides: JSON object of LoraConfig fields, e.g. {"r": 16, "train.max_steps": 100}.
    """
    from lmforge.component_io import publish, setup_logging
    from lmforge.config import resolve_stage_config
    from lmforge.train import lora as stage

    setup_logging()
    adapter.metadata["qa_fingerprint"] = qa_fingerprint
    cfg = resolve_stage_config("finetune_lora", preset, overrides)
    result = stage.run(cfg, base_model.path, qa_uri, adapter.path, merged_model.path)
    publish(result, metrics=metrics, html=curves)
