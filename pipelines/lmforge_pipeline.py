"""The lmforge DAG: raw text → cleaned corpus → tokens → pretrain → LoRA → distill → ONNX → INT8
→ TensorRT → evaluate → (gate) promote → serve.

Only wiring lives here: data passing, retries, caching and display names. Where a step runs (GPU pool or
not, its requests) follows its stage's registry entry (:func:`_place`). Every stage's behaviour comes from its
component and the ``lmforge`` library.
"""

from collections.abc import Mapping
from dataclasses import dataclass, fields
from functools import partial
from types import SimpleNamespace
from typing import Any

from kfp import dsl, kubernetes
from kfp.dsl import pipeline_context

from lmforge.cluster import GPU_POOL_NODE_SELECTOR, GPU_POOL_TOLERATION, GPU_RESOURCE
from lmforge.run_context import RUN_ID_ENV
from lmforge.stages import STAGES, get_stage, overrides_help
from lmforge_kfp.components import load_component
from lmforge_kfp.components.images import image_for, service_image
from lmforge_kfp.pipelines.signatures import NESTED_STEP_INPUTS, documented_parameters, fan_out, nested_step, pipeline

preflight = load_component("preflight")
plan_shards = load_component("plan_shards")
clean_shard = load_component("clean_shard")
plan_dedup = load_component("plan_dedup")
dedup_exact_part = load_component("dedup_exact_part")
dedup_band_part = load_component("dedup_band_part")
dedup_union = load_component("dedup_union")
merge_shards = load_component("merge_shards")
tokenize = load_component("tokenize")
pretrain = load_component("pretrain")
finetune_lora = load_component("finetune_lora")
distill = load_component("distill")
export_onnx = load_component("export_onnx")
quantize_int8 = load_component("quantize_int8")
build_tensorrt = load_component("build_tensorrt")
evaluate = load_component("evaluate")
promote = load_component("promote")
serve = load_component("serve")

PIPELINE_NAME = "lmforge"
DEFAULT_GPU_NODE_SELECTOR = dict(GPU_POOL_NODE_SELECTOR)
DEFAULT_GPU_TOLERATIONS = [dict(GPU_POOL_TOLERATION)]
S3_ENV_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL")
# The MLflow client's own variables: the server, its credentials, the experiment (docs/kubeflow.md).
MLFLOW_ENV_KEYS = (
    "MLFLOW_TRACKING_URI",
    "MLFLOW_TRACKING_TOKEN",
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_EXPERIMENT_NAME",
)


def _with_requests(task: dsl.PipelineTask, cpu, memory) -> dsl.PipelineTask:
    """CPU and memory requests from (string) pipeline parameters, so the scheduler can place and account the step."""
    return task.set_cpu_request(cpu).set_memory_request(memory)


def _with_s3_credentials(task: dsl.PipelineTask, secret_name) -> dsl.PipelineTask:
    """Expose the S3 Secret's keys as env vars (optional: with IRSA no Secret exists)."""
    return kubernetes.use_secret_as_env(
        task, secret_name=secret_name, secret_key_to_env={key: key for key in S3_ENV_KEYS}, optional=True
    )


def _with_mlflow(task: dsl.PipelineTask, secret_name) -> dsl.PipelineTask:
    """Expose the MLflow Secret's keys as env vars, which turn tracking on (optional: without the Secret, or
    without its MLFLOW_TRACKING_URI, nothing is tracked). A Secret and not a parameter: KFP cannot make a
    parameter an env var (kubeflow/pipelines#10111), and a parameter on every step would join every cache key."""
    return kubernetes.use_secret_as_env(
        task, secret_name=secret_name, secret_key_to_env={key: key for key in MLFLOW_ENV_KEYS}, optional=True
    )


def _with_run_id(task: dsl.PipelineTask) -> dsl.PipelineTask:
    """Give the step the run id (the pod label KFP sets) as an env var: it names a multi-node job so that a
    retried step adopts it. Not a task input, whose value would change the step's cache key on every run."""
    return kubernetes.use_field_path_as_env(task, env_name=RUN_ID_ENV, field_path="metadata.labels['pipeline/runid']")


def _as_nested_step(task: dsl.PipelineTask, cpu, memory, s3_secret_name, mlflow_secret_name) -> dsl.PipelineTask:
    """What every step inside a sub-pipeline gets: its requests, the S3 and MLflow Secrets and the run id."""
    _with_s3_credentials(_with_requests(task, cpu, memory), s3_secret_name)
    return _with_mlflow(_with_run_id(task), mlflow_secret_name)


def _on_gpu_pool(
    task: dsl.PipelineTask, gpu_accelerator_type, gpu_count, node_selector, tolerations
) -> dsl.PipelineTask:
    """Request GPUs and pin the task to the GPU node pool (selector + taint tolerations), all from parameters.

    ``gpu_count`` must be a *string* channel: the KFP backend's driver reads a runtime accelerator limit with
    ``GetStringValue`` (backend/src/v2/driver/resolve.go), so an integer parameter is silently dropped.
    """
    task.set_accelerator_type(gpu_accelerator_type).set_accelerator_limit(gpu_count)
    kubernetes.add_node_selector_json(task, node_selector_json=node_selector)
    kubernetes.add_toleration_json(task, toleration_json=tolerations)
    return task


@dataclass(frozen=True)
class _Placement:
    """The pipeline parameters that place a step: requests of CPU and GPU steps, the GPU pool, the Secrets."""

    cpu_request: Any
    memory_request: Any
    gpu_step_cpu_request: Any
    gpu_step_memory_request: Any
    gpu_accelerator_type: Any
    gpu_count: Any  # the pipeline's gpu_count as a string: preflight's gpu_limit output (see _on_gpu_pool)
    gpu_node_selector: Any
    gpu_tolerations: Any
    s3_secret_name: Any
    mlflow_secret_name: Any


def _place(task: dsl.PipelineTask, placement: _Placement) -> dsl.PipelineTask:
    """Place a step as its stage's registry entry says: a GPU stage (``StageSpec.on_gpu``) on the GPU pool with the
    GPU step requests, any other with the CPU step requests; every step gets the S3 and MLflow Secrets and the run
    id (every step's MLflow run finds its pipeline run by it, a distributed stage's job is named after it)."""
    if get_stage(_stage_of(task)).on_gpu:
        _with_requests(task, placement.gpu_step_cpu_request, placement.gpu_step_memory_request)
        _on_gpu_pool(
            task,
            placement.gpu_accelerator_type,
            placement.gpu_count,
            placement.gpu_node_selector,
            placement.gpu_tolerations,
        )
    else:
        _with_requests(task, placement.cpu_request, placement.memory_request)
    _with_s3_credentials(task, placement.s3_secret_name)
    _with_mlflow(task, placement.mlflow_secret_name)
    return _with_run_id(task)


def _stage_of(task: dsl.PipelineTask) -> str:
    """The stage a task runs (its component is named after it), or the name of the sub-pipeline it runs."""
    return task.component_spec.name.replace("-", "_")


def _stage_tasks() -> list[dsl.PipelineTask]:
    """The tasks of the pipeline being defined that run a registry stage (not a sub-pipeline), in creation order."""
    tasks = pipeline_context.Pipeline.get_default_pipeline().tasks.values()
    return [task for task in tasks if _stage_of(task) in STAGES]


# The steps inside a ParallelFor or the gate's If, each in a sub-pipeline that takes its placement as inputs
# (lmforge_kfp.pipelines.signatures says why).
clean_one_shard = nested_step(clean_shard, "clean-one-shard", "clean shard", "shard", _as_nested_step)
dedup_exact_one_part = nested_step(
    dedup_exact_part, "dedup-exact-one-part", "exact dedup part", "exact", _as_nested_step
)
dedup_band_one_part = nested_step(dedup_band_part, "dedup-band-one-part", "LSH band part", "pairs", _as_nested_step)
dedup_exact_fan_out = fan_out(dedup_exact_one_part, "dedup-exact-fan-out", "part", "exact_parts", "exact-dedup-fan-out")
dedup_band_fan_out = fan_out(dedup_band_one_part, "dedup-band-fan-out", "band_task", "band_tasks", "band-dedup-fan-out")
promote_release = nested_step(promote, "promote-release", "promote", "Output", _as_nested_step, cached=False)
serve_release = nested_step(serve, "serve-release", "serve", "serving", _as_nested_step, cached=False)


def _with_fields_in_overrides_help(doc: str) -> str:
    """Append every field (type, default) of a section to its ``<section>_overrides`` parameter's description, so
    the Kubeflow UI shows what each JSON object may hold (the field help itself: ``lmforge config --explain``)."""
    lines = []
    for line in doc.split("\n"):
        name = line.strip().partition(":")[0]
        lines.append(line)
        if name.endswith("_overrides"):
            lines.append(f"            Fields: {overrides_help(name.removesuffix('_overrides'))}.")
    return "\n".join(lines)


PIPELINE_DOC = """\
Raw text to a cleaned corpus, pretrained, LoRA-tuned, distilled, INT8 and TensorRT model, evaluated and gated.

    Args:
        corpus_uri: Raw corpus: local path, glob, s3:// URI, or demo://shakespeare (packaged demo text).
        qa_uri: Fine-tuning Q&A JSONL (prompt/response per line): local, s3://, or demo://chatterbot.
        base_model_uri: Model to start from instead of pretraining from scratch: a Hugging Face causal-LM directory
            (local or s3://: config.json, safetensors, tokenizer files; GPT-2 or Llama shaped), e.g. written by plain
            save_pretrained. tokenize then uses its tokenizer, pretrain continues training it
            ({"train.max_steps": 0} in pretrain_overrides passes it through); empty: train from scratch.
        student_base_uri: A smaller pretrained model (same form, same tokenizer as the teacher) distill trains as
            the student; empty: the student is built from the teacher's layers.
        preset: Config preset every stage starts from: tiny-cpu (laptop demo) or gpt2-124m (one GPU node).
        release_root: Model registry root (local path or s3://bucket/prefix); releases land in models/<name>/<version>/.
        release_version: Release version; empty picks a UTC timestamp. An existing version is never overwritten.
        clean_shards: Corpus shards cleaned in parallel (dsl.ParallelFor); the result is identical for any count.
        dedup_band_groups: Groups of LSH bands the near-dedup fans out over (dsl.ParallelFor of band groups ×
            dedup_parts steps); each step holds only its group's band keys, so memory per step is bounded by shard
            size and band group, not corpus size. The result is identical for any count. Sizing: the table in
            docs/benchmarks.md ("Dedup past one pod").
        dedup_parts: Parts the exact digests and each group's band keys are hashed into: dedup_parts exact steps and
            dedup_band_groups × dedup_parts band steps, each holding about 1/dedup_parts of its share.
        clean_overrides: JSON object of clean settings overriding the preset, e.g. {"min_words": 5}.
        tokenize_overrides: JSON object of tokenizer and shard settings, e.g. {"vocab_size": 8192}.
        pretrain_overrides: JSON object of pretraining settings, e.g. {"train.max_steps": 500}.
        finetune_lora_overrides: JSON object of LoRA settings, e.g. {"r": 16, "train.max_steps": 100}.
        distill_overrides: JSON object of distillation settings, e.g. {"temperature": 4.0}.
        export_onnx_overrides: JSON object of ONNX export settings, e.g. {"opset": 18}.
        quantize_int8_overrides: JSON object of INT8 settings, e.g. {"calibrate_method": "entropy"}.
        build_tensorrt_overrides: JSON object of TensorRT build settings, e.g. {"max_seq": 2048}.
        evaluate_overrides: JSON object of evaluation and gate settings, e.g. {"gate.max_student_perplexity": 50.0}.
        serve_overrides: JSON object of serving settings (predictor, InferenceService, apply), e.g. {"apply": true}.
        model_name: Release name: releases land in <release_root>/models/<model_name>/<version>/; empty: derived from
            the corpus (lmforge-demo for the demo corpus).
        gpu_accelerator_type: Accelerator resource for the GPU stages (pretrain, LoRA, distill, TensorRT).
        gpu_count: GPUs per GPU-stage pod; pretrain, LoRA and distill run one process per GPU (torchrun) when it is
            above 1.
        gpu_node_selector: Node selector (JSON object) that pins GPU stages (and a GPU predictor) to the GPU node pool.
        gpu_tolerations: Tolerations (JSON list) for the GPU node pool's taints (GPU stages and a GPU predictor).
        cpu_request: CPU request of every CPU step (Kubernetes quantity, e.g. "2" or "500m").
        memory_request: Memory request of every CPU step (Kubernetes quantity, e.g. "8Gi").
        gpu_step_cpu_request: CPU request of the GPU steps; the default fits gpt2-124m on one GPU with its data
            loader.
        gpu_step_memory_request: Memory request of the GPU steps (host memory: checkpoints, DeepSpeed offload).
        launch: JSON object of LaunchConfig fields for the training steps, e.g. {"num_nodes": 4, "gpus_per_node": 8}:
            num_nodes > 1 runs pretrain, LoRA and distill each as a Kubeflow Trainer TrainJob ({"backend":
            "pytorchjob"}: PyTorchJob) and needs staging_uri (and an s3:// or demo:// qa_uri); gpus_per_node defaults
            to gpu_count; accelerator (default H100) is the GPU model preflight plans the training steps on.
        staging_uri: s3://bucket/prefix where multi-node jobs read their inputs and write their outputs
            (<staging_uri>/<run id>/<task>/); needed only when launch sets num_nodes > 1. The GPU presets' checkpoints
            go to <staging_uri>/checkpoints/<run id>/<stage>/ (without staging_uri: under release_root).
        s3_secret_name: Secret with AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL (optional with IRSA).
        mlflow_secret_name: Secret with MLFLOW_TRACKING_URI (and MLFLOW_TRACKING_TOKEN or _USERNAME/_PASSWORD,
            MLFLOW_EXPERIMENT_NAME): every step logs to that MLflow server and promote registers the release; no
            such Secret: no tracking.
    """

# The pipeline's parameters that preflight does not take: type and default. Preflight's inputs are typed and
# defaulted by its registry entry (through its component), but for the three it requires. The docstring's Args
# order them and give their help.
OWN_PARAMETERS: dict[str, tuple[Any, Any]] = {
    "release_version": (str, ""),
    "clean_shards": (int, 1),
    "dedup_band_groups": (int, 1),
    "dedup_parts": (int, 1),
    "gpu_accelerator_type": (str, GPU_RESOURCE),
    "gpu_node_selector": (dict, DEFAULT_GPU_NODE_SELECTOR),
    "gpu_tolerations": (list, DEFAULT_GPU_TOLERATIONS),
    "cpu_request": (str, "2"),
    "memory_request": (str, "8Gi"),
    "gpu_step_cpu_request": (str, "8"),
    "gpu_step_memory_request": (str, "48Gi"),
    "mlflow_secret_name": (str, "lmforge-mlflow"),
}
REQUIRED_INPUT_DEFAULTS = {
    "corpus_uri": "demo://shakespeare",
    "qa_uri": "demo://chatterbot",
    "release_root": "s3://lmforge/releases",
}


def _settings(
    stage: str, arguments: Mapping[str, Any], launch_args: Mapping[str, Any], checked: dsl.PipelineTask
) -> dict[str, Any]:
    """What a stage's task takes from the pipeline besides its data: its cache keys (preflight's fingerprints of the
    same names), the preset and its section's overrides (a stage with settings), and its job image and the launch
    parameters (a distributed stage)."""
    spec = get_stage(stage)
    taken: dict[str, Any] = {key.name: checked.outputs[key.name] for key in spec.cache_keys}
    if spec.config:
        taken |= {"preset": arguments["preset"], "overrides": arguments[f"{spec.section}_overrides"]}
    if spec.distributed:
        taken |= {"job_image": image_for(stage), **launch_args}
    return taken


def _lmforge_dag(arguments: dict[str, Any]) -> None:
    """The DAG, from the pipeline's arguments by name."""
    p = SimpleNamespace(**arguments)
    checked = preflight(**{port.name: arguments[port.name] for port in get_stage("preflight").inputs})
    checked.set_display_name("0 preflight checks").set_caching_options(False)
    placement = _Placement(
        **{field.name: arguments[field.name] for field in fields(_Placement)}
        | {"gpu_count": checked.outputs["gpu_limit"]}
    )
    launch_args = {
        "launch": p.launch,
        "staging_uri": p.staging_uri,
        "gpu_count": p.gpu_count,
        "run_root": checked.outputs["run_root"],
    }
    settings = partial(_settings, arguments=arguments, launch_args=launch_args, checked=checked)
    requests = {name: arguments[name] for name in NESTED_STEP_INPUTS}

    shard_indices = plan_shards(shard_count=p.clean_shards)
    shard_indices.set_display_name("1a plan corpus shards")
    shard_indices.after(checked)  # nothing starts before preflight, which also creates the run's MLflow parent run
    with dsl.ParallelFor(shard_indices.outputs["Output"], name="clean-fan-out") as shard_index:
        shard = clean_one_shard(
            corpus_uri=p.corpus_uri,
            shard_index=shard_index,
            shard_count=p.clean_shards,
            **settings("clean_shard"),
            **requests,
        )
        shard.set_display_name("1b clean shard")
    dedup_plan = plan_dedup(band_groups=p.dedup_band_groups, parts=p.dedup_parts, **settings("plan_dedup"))
    dedup_plan.set_display_name("1c.1 plan dedup parts").after(checked)
    exact = dedup_exact_fan_out(
        shards=dsl.Collected(shard.output),
        exact_parts=dedup_plan.outputs["exact_parts"],
        parts=p.dedup_parts,
        **settings("dedup_exact_part"),
        **requests,
    )
    exact.set_display_name("1c.2 exact dedup (digest parts)")
    pairs = dedup_band_fan_out(
        shards=dsl.Collected(shard.output),
        exact=exact.output,
        band_tasks=dedup_plan.outputs["band_tasks"],
        band_groups=p.dedup_band_groups,
        parts=p.dedup_parts,
        **settings("dedup_band_part"),
        **requests,
    )
    pairs.set_display_name("1c.3 near dedup (MinHash LSH band parts)")
    deduped = dedup_union(
        shards=dsl.Collected(shard.output),
        exact=exact.output,
        pairs=pairs.output,
        **settings("dedup_union"),
    )
    deduped.set_display_name("1c.4 dedup union (removal plan)")
    cleaned = merge_shards(
        corpus_uri=p.corpus_uri,
        shards=dsl.Collected(shard.output),
        plan=deduped.outputs["plan"],
        **settings("merge_shards"),
    )
    cleaned.set_display_name("1d merge cleaned shards")

    tokens = tokenize(
        cleaned=cleaned.outputs["cleaned"],
        base_model=p.base_model_uri,
        **settings("tokenize"),
    )
    tokens.set_display_name("2 tokenize + pack shards")

    base = pretrain(
        shards=tokens.outputs["shards"],
        tokenizer=tokens.outputs["tokenizer"],
        base_model=p.base_model_uri,
        **settings("pretrain"),
    )
    base.set_display_name("3 pretrain").set_retry(num_retries=2, backoff_duration="60s")

    tuned = finetune_lora(
        base_model=base.outputs["model"],
        qa_uri=p.qa_uri,
        **settings("finetune_lora"),
    )
    tuned.set_display_name("4 LoRA fine-tune").set_retry(num_retries=2, backoff_duration="60s")

    student = distill(
        teacher=tuned.outputs["merged_model"],
        shards=tokens.outputs["shards"],
        qa_uri=p.qa_uri,
        student_base=p.student_base_uri,
        **settings("distill"),
    )
    student.set_display_name("5 distill").set_retry(num_retries=2, backoff_duration="60s")

    exported = export_onnx(model=student.outputs["student"], **settings("export_onnx"))
    exported.set_display_name("6 export ONNX")

    quantized = quantize_int8(
        onnx_model=exported.outputs["onnx_model"],
        shards=tokens.outputs["shards"],
        **settings("quantize_int8"),
    )
    quantized.set_display_name("7 quantize INT8")

    engine = build_tensorrt(int8_qdq=quantized.outputs["int8_qdq"], **settings("build_tensorrt"))
    engine.set_display_name("8 build TensorRT engine")

    released_models = {  # what a release holds: evaluate scores them, promote publishes them
        "student": student.outputs["student"],
        "onnx_fp32": exported.outputs["onnx_model"],
        "int8_dynamic": quantized.outputs["int8_dynamic"],
        "int8_qdq": quantized.outputs["int8_qdq"],
        "engine": engine.outputs["engine"],
    }
    evaluated = evaluate(
        shards=tokens.outputs["shards"],
        teacher=tuned.outputs["merged_model"],
        **released_models,
        cleaned=cleaned.outputs["cleaned"],
        base=base.outputs["model"],
        qa_uri=p.qa_uri,
        release_root=p.release_root,
        **settings("evaluate"),
        model_name=checked.outputs["model_name"],
        plan=checked.outputs["plan"],
    )
    evaluated.set_display_name("9 evaluate + gate")

    # kfp.local resolves a condition on a task's single return value ("Output") but not on a named
    # output, so evaluate returns the gate decision as its only parameter output.
    with dsl.If(evaluated.outputs["Output"] == True, name="gate-passed"):  # noqa: E712 - KFP condition
        released = promote_release(
            **released_models,
            evaluation=evaluated.outputs["evaluation"],
            release_root=p.release_root,
            model_name=checked.outputs["model_name"],
            version=p.release_version,
            **requests,
        )
        released.set_display_name("10 promote release").set_caching_options(False)
        served = serve_release(
            release=released.output,
            predictor_image=service_image("serve"),
            gpu_node_selector=p.gpu_node_selector,
            gpu_tolerations=p.gpu_tolerations,
            **settings("serve"),
            **requests,
        )
        served.set_display_name("11 serve release").set_caching_options(False)

    for task in _stage_tasks():  # the sub-pipelines place their own steps (_as_nested_step)
        _place(task, placement)


lmforge_pipeline = pipeline(
    PIPELINE_NAME,
    _with_fields_in_overrides_help(PIPELINE_DOC),
    documented_parameters(PIPELINE_DOC, preflight, OWN_PARAMETERS, REQUIRED_INPUT_DEFAULTS),
    _lmforge_dag,
)
