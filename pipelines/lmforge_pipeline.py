"""The lmforge DAG: raw text → cleaned corpus → tokens → pretrain → LoRA → distill → ONNX → INT8
→ TensorRT → evaluate → (gate) promote → serve.

Only wiring lives here: data passing, retries, caching and display names. Where a step runs (GPU pool or
not, its requests) follows its stage's registry entry (:func:`_place`). Every stage's behaviour comes from its
component and the ``lmforge`` library.
"""

from dataclasses import dataclass
from typing import Any

from kfp import dsl, kubernetes
from kfp.dsl import Artifact, Dataset, Input, Model, pipeline_context

from lmforge.cluster import GPU_POOL_NODE_SELECTOR, GPU_POOL_TOLERATION, GPU_RESOURCE
from lmforge.run_context import RUN_ID_ENV
from lmforge.stages import STAGES, get_stage, overrides_help
from lmforge_kfp.components import load_component
from lmforge_kfp.components.images import image_for, service_image

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


@dsl.pipeline(name="clean-one-shard")
def clean_one_shard(
    corpus_uri: str,
    shard_index: int,
    shard_count: int,
    corpus_fingerprint: str,
    preset: str,
    overrides: str,
    cpu_request: str,
    memory_request: str,
    s3_secret_name: str,
    mlflow_secret_name: str,
) -> Dataset:
    """One iteration of the cleaning fan-out: ``clean_shard`` with its requests and credentials.

    A sub-pipeline because KFP's SDK does not pass a pipeline parameter that only a task's *resources* use
    into a ``ParallelFor`` DAG: the backend's driver then fails to resolve it (``parent DAG does not have input
    parameter``). As inputs of this sub-pipeline the requests reach the step inside the loop.
    """
    shard = clean_shard(
        corpus_uri=corpus_uri,
        shard_index=shard_index,
        shard_count=shard_count,
        corpus_fingerprint=corpus_fingerprint,
        preset=preset,
        overrides=overrides,
    )
    shard.set_display_name("clean shard").set_retry(num_retries=2, backoff_duration="30s")
    _as_nested_step(shard, cpu_request, memory_request, s3_secret_name, mlflow_secret_name)
    return shard.outputs["shard"]


@dsl.pipeline(name="dedup-exact-one-part")
def dedup_exact_one_part(
    shards: Input[list[Dataset]],
    part: int,
    parts: int,
    preset: str,
    overrides: str,
    cpu_request: str,
    memory_request: str,
    s3_secret_name: str,
    mlflow_secret_name: str,
) -> Artifact:
    """One iteration of the exact-dedup fan-out: ``dedup_exact_part`` with its requests and credentials (a
    sub-pipeline for the reason given in :func:`clean_one_shard`)."""
    exact = dedup_exact_part(shards=shards, part=part, parts=parts, preset=preset, overrides=overrides)
    exact.set_display_name("exact dedup part").set_retry(num_retries=2, backoff_duration="30s")
    _as_nested_step(exact, cpu_request, memory_request, s3_secret_name, mlflow_secret_name)
    return exact.outputs["exact"]


@dsl.pipeline(name="dedup-exact-fan-out")
def dedup_exact_fan_out(
    shards: Input[list[Dataset]],
    exact_parts: list[int],
    parts: int,
    preset: str,
    overrides: str,
    cpu_request: str,
    memory_request: str,
    s3_secret_name: str,
    mlflow_secret_name: str,
) -> list[Artifact]:
    """``dedup_exact_part`` for every exact part (``dsl.ParallelFor``), collected.

    A sub-pipeline because the SDK cannot pass a ``dsl.Collected`` (the cleaned shards, the exact parts) into a
    ``ParallelFor`` DAG (its compiler types it as a parameter and fails); as an input of this sub-pipeline it is a
    plain artifact list the loop can read.
    """
    with dsl.ParallelFor(exact_parts, name="exact-dedup-fan-out") as part:
        exact = dedup_exact_one_part(
            shards=shards,
            part=part,
            parts=parts,
            preset=preset,
            overrides=overrides,
            cpu_request=cpu_request,
            memory_request=memory_request,
            s3_secret_name=s3_secret_name,
            mlflow_secret_name=mlflow_secret_name,
        )
    return dsl.Collected(exact.output)


@dsl.pipeline(name="dedup-band-one-part")
def dedup_band_one_part(
    shards: Input[list[Dataset]],
    exact: Input[list[Artifact]],
    band_task: int,
    band_groups: int,
    parts: int,
    preset: str,
    overrides: str,
    cpu_request: str,
    memory_request: str,
    s3_secret_name: str,
    mlflow_secret_name: str,
) -> Artifact:
    """One iteration of the LSH band fan-out: ``dedup_band_part`` with its requests and credentials (a sub-pipeline
    for the reason given in :func:`clean_one_shard`)."""
    pairs = dedup_band_part(
        shards=shards,
        exact=exact,
        band_task=band_task,
        band_groups=band_groups,
        parts=parts,
        preset=preset,
        overrides=overrides,
    )
    pairs.set_display_name("LSH band part").set_retry(num_retries=2, backoff_duration="30s")
    _as_nested_step(pairs, cpu_request, memory_request, s3_secret_name, mlflow_secret_name)
    return pairs.outputs["pairs"]


@dsl.pipeline(name="dedup-band-fan-out")
def dedup_band_fan_out(
    shards: Input[list[Dataset]],
    exact: Input[list[Artifact]],
    band_tasks: list[int],
    band_groups: int,
    parts: int,
    preset: str,
    overrides: str,
    cpu_request: str,
    memory_request: str,
    s3_secret_name: str,
    mlflow_secret_name: str,
) -> list[Artifact]:
    """``dedup_band_part`` for every band task (band group × part, ``dsl.ParallelFor``), collected; a sub-pipeline
    for the reason given in :func:`dedup_exact_fan_out`."""
    with dsl.ParallelFor(band_tasks, name="band-dedup-fan-out") as band_task:
        pairs = dedup_band_one_part(
            shards=shards,
            exact=exact,
            band_task=band_task,
            band_groups=band_groups,
            parts=parts,
            preset=preset,
            overrides=overrides,
            cpu_request=cpu_request,
            memory_request=memory_request,
            s3_secret_name=s3_secret_name,
            mlflow_secret_name=mlflow_secret_name,
        )
    return dsl.Collected(pairs.output)


@dsl.pipeline(name="promote-release")
def promote_release(
    student: Input[Model],
    onnx_fp32: Input[Model],
    int8_dynamic: Input[Model],
    int8_qdq: Input[Model],
    engine: Input[Artifact],
    evaluation: Input[Artifact],
    release_root: str,
    model_name: str,
    version: str,
    cpu_request: str,
    memory_request: str,
    s3_secret_name: str,
    mlflow_secret_name: str,
) -> str:
    """``promote`` with its requests and credentials, as a sub-pipeline for the reason given in
    :func:`clean_one_shard`: it runs inside the gate's ``dsl.If``, another DAG that the SDK would not pass the
    request parameters into."""
    released = promote(
        student=student,
        onnx_fp32=onnx_fp32,
        int8_dynamic=int8_dynamic,
        int8_qdq=int8_qdq,
        engine=engine,
        evaluation=evaluation,
        release_root=release_root,
        model_name=model_name,
        version=version,
    )
    released.set_display_name("promote").set_caching_options(False).set_retry(num_retries=2, backoff_duration="30s")
    _as_nested_step(released, cpu_request, memory_request, s3_secret_name, mlflow_secret_name)
    return released.outputs["Output"]


@dsl.pipeline(name="serve-release")
def serve_release(
    release: str,
    predictor_image: str,
    gpu_node_selector: dict,
    gpu_tolerations: list,
    preset: str,
    overrides: str,
    cpu_request: str,
    memory_request: str,
    s3_secret_name: str,
    mlflow_secret_name: str,
) -> Artifact:
    """``serve`` with its requests and credentials, a sub-pipeline inside the gate's ``dsl.If`` for the reason given
    in :func:`clean_one_shard`. The step itself needs no GPU: a GPU predictor's placement goes into the
    InferenceService it writes (``gpu_node_selector``, ``gpu_tolerations``)."""
    served = serve(
        release=release,
        predictor_image=predictor_image,
        gpu_node_selector=gpu_node_selector,
        gpu_tolerations=gpu_tolerations,
        preset=preset,
        overrides=overrides,
    )
    served.set_display_name("serve").set_caching_options(False).set_retry(num_retries=2, backoff_duration="30s")
    _as_nested_step(served, cpu_request, memory_request, s3_secret_name, mlflow_secret_name)
    return served.outputs["serving"]


def _with_fields_in_overrides_help(func):
    """Append every field (type, default) of a section to its ``<section>_overrides`` parameter's description, so
    the Kubeflow UI shows what each JSON object may hold (the field help itself: ``lmforge config --explain``)."""
    lines = []
    for line in (func.__doc__ or "").split("\n"):
        name = line.strip().partition(":")[0]
        lines.append(line)
        if name.endswith("_overrides"):
            lines.append(f"            Fields: {overrides_help(name.removesuffix('_overrides'))}.")
    func.__doc__ = "\n".join(lines)
    return func


@dsl.pipeline(name=PIPELINE_NAME)
@_with_fields_in_overrides_help
def lmforge_pipeline(
    corpus_uri: str = "demo://shakespeare",
    qa_uri: str = "demo://chatterbot",
    base_model_uri: str = "",
    student_base_uri: str = "",
    preset: str = "tiny-cpu",
    release_root: str = "s3://lmforge/releases",
    release_version: str = "",
    clean_shards: int = 1,
    dedup_band_groups: int = 1,
    dedup_parts: int = 1,
    clean_overrides: str = "{}",
    tokenize_overrides: str = "{}",
    pretrain_overrides: str = "{}",
    finetune_lora_overrides: str = "{}",
    distill_overrides: str = "{}",
    export_onnx_overrides: str = "{}",
    quantize_int8_overrides: str = "{}",
    build_tensorrt_overrides: str = "{}",
    evaluate_overrides: str = "{}",
    serve_overrides: str = "{}",
    model_name: str = "",
    gpu_accelerator_type: str = GPU_RESOURCE,
    gpu_count: int = 1,
    gpu_node_selector: dict = DEFAULT_GPU_NODE_SELECTOR,
    gpu_tolerations: list = DEFAULT_GPU_TOLERATIONS,
    cpu_request: str = "2",
    memory_request: str = "8Gi",
    gpu_step_cpu_request: str = "8",
    gpu_step_memory_request: str = "48Gi",
    launch: str = "{}",
    staging_uri: str = "",
    s3_secret_name: str = "lmforge-s3",
    mlflow_secret_name: str = "lmforge-mlflow",
):
    """Raw text to a cleaned corpus, pretrained, LoRA-tuned, distilled, INT8 and TensorRT model, evaluated and gated.

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
            to gpu_count.
        staging_uri: s3://bucket/prefix where multi-node jobs read their inputs and write their outputs
            (<staging_uri>/<run id>/<task>/); needed only when launch sets num_nodes > 1. The GPU presets' checkpoints
            go to <staging_uri>/checkpoints/<run id>/<stage>/ (without staging_uri: under release_root).
        s3_secret_name: Secret with AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL (optional with IRSA).
        mlflow_secret_name: Secret with MLFLOW_TRACKING_URI (and MLFLOW_TRACKING_TOKEN or _USERNAME/_PASSWORD,
            MLFLOW_EXPERIMENT_NAME): every step logs to that MLflow server and promote registers the release; no
            such Secret: no tracking.
    """
    arguments = dict(locals())  # the pipeline's parameters: preflight's inputs are named after them
    checked = preflight(**{port.name: arguments[port.name] for port in get_stage("preflight").inputs})
    checked.set_display_name("0 preflight checks").set_caching_options(False)
    placement = _Placement(
        cpu_request=cpu_request,
        memory_request=memory_request,
        gpu_step_cpu_request=gpu_step_cpu_request,
        gpu_step_memory_request=gpu_step_memory_request,
        gpu_accelerator_type=gpu_accelerator_type,
        gpu_count=checked.outputs["gpu_limit"],
        gpu_node_selector=gpu_node_selector,
        gpu_tolerations=gpu_tolerations,
        s3_secret_name=s3_secret_name,
        mlflow_secret_name=mlflow_secret_name,
    )
    launch_args = {
        "launch": launch,
        "staging_uri": staging_uri,
        "gpu_count": gpu_count,
        "run_root": checked.outputs["run_root"],
    }

    shard_indices = plan_shards(shard_count=clean_shards)
    shard_indices.set_display_name("1a plan corpus shards")
    shard_indices.after(checked)  # nothing starts before preflight, which also creates the run's MLflow parent run
    with dsl.ParallelFor(shard_indices.outputs["Output"], name="clean-fan-out") as shard_index:
        shard = clean_one_shard(
            corpus_uri=corpus_uri,
            shard_index=shard_index,
            shard_count=clean_shards,
            corpus_fingerprint=checked.outputs["corpus_fingerprint"],
            preset=preset,
            overrides=clean_overrides,
            cpu_request=cpu_request,
            memory_request=memory_request,
            s3_secret_name=s3_secret_name,
            mlflow_secret_name=mlflow_secret_name,
        )
        shard.set_display_name("1b clean shard")
    dedup_plan = plan_dedup(band_groups=dedup_band_groups, parts=dedup_parts, preset=preset, overrides=clean_overrides)
    dedup_plan.set_display_name("1c.1 plan dedup parts").after(checked)
    requests = {
        "cpu_request": cpu_request,
        "memory_request": memory_request,
        "s3_secret_name": s3_secret_name,
        "mlflow_secret_name": mlflow_secret_name,
    }
    exact = dedup_exact_fan_out(
        shards=dsl.Collected(shard.output),
        exact_parts=dedup_plan.outputs["exact_parts"],
        parts=dedup_parts,
        preset=preset,
        overrides=clean_overrides,
        **requests,
    )
    exact.set_display_name("1c.2 exact dedup (digest parts)")
    pairs = dedup_band_fan_out(
        shards=dsl.Collected(shard.output),
        exact=exact.output,
        band_tasks=dedup_plan.outputs["band_tasks"],
        band_groups=dedup_band_groups,
        parts=dedup_parts,
        preset=preset,
        overrides=clean_overrides,
        **requests,
    )
    pairs.set_display_name("1c.3 near dedup (MinHash LSH band parts)")
    deduped = dedup_union(
        shards=dsl.Collected(shard.output),
        exact=exact.output,
        pairs=pairs.output,
        preset=preset,
        overrides=clean_overrides,
    )
    deduped.set_display_name("1c.4 dedup union (removal plan)")
    cleaned = merge_shards(
        corpus_uri=corpus_uri,
        shards=dsl.Collected(shard.output),
        plan=deduped.outputs["plan"],
        preset=preset,
        overrides=clean_overrides,
    )
    cleaned.set_display_name("1d merge cleaned shards")

    tokens = tokenize(
        cleaned=cleaned.outputs["cleaned"],
        base_model=base_model_uri,
        base_model_fingerprint=checked.outputs["base_model_fingerprint"],
        preset=preset,
        overrides=tokenize_overrides,
    )
    tokens.set_display_name("2 tokenize + pack shards")

    base = pretrain(
        shards=tokens.outputs["shards"],
        tokenizer=tokens.outputs["tokenizer"],
        base_model=base_model_uri,
        base_model_fingerprint=checked.outputs["base_model_fingerprint"],
        preset=preset,
        overrides=pretrain_overrides,
        job_image=image_for("pretrain"),
        **launch_args,
    )
    base.set_display_name("3 pretrain").set_retry(num_retries=2, backoff_duration="60s")

    tuned = finetune_lora(
        base_model=base.outputs["model"],
        qa_uri=qa_uri,
        qa_fingerprint=checked.outputs["qa_fingerprint"],
        preset=preset,
        overrides=finetune_lora_overrides,
        job_image=image_for("finetune_lora"),
        **launch_args,
    )
    tuned.set_display_name("4 LoRA fine-tune").set_retry(num_retries=2, backoff_duration="60s")

    student = distill(
        teacher=tuned.outputs["merged_model"],
        shards=tokens.outputs["shards"],
        qa_uri=qa_uri,
        student_base=student_base_uri,
        qa_fingerprint=checked.outputs["qa_fingerprint"],
        student_base_fingerprint=checked.outputs["student_base_fingerprint"],
        preset=preset,
        overrides=distill_overrides,
        job_image=image_for("distill"),
        **launch_args,
    )
    student.set_display_name("5 distill").set_retry(num_retries=2, backoff_duration="60s")

    exported = export_onnx(model=student.outputs["student"], preset=preset, overrides=export_onnx_overrides)
    exported.set_display_name("6 export ONNX")

    quantized = quantize_int8(
        onnx_model=exported.outputs["onnx_model"],
        shards=tokens.outputs["shards"],
        preset=preset,
        overrides=quantize_int8_overrides,
    )
    quantized.set_display_name("7 quantize INT8")

    engine = build_tensorrt(int8_qdq=quantized.outputs["int8_qdq"], preset=preset, overrides=build_tensorrt_overrides)
    engine.set_display_name("8 build TensorRT engine")

    evaluated = evaluate(
        shards=tokens.outputs["shards"],
        teacher=tuned.outputs["merged_model"],
        student=student.outputs["student"],
        onnx_fp32=exported.outputs["onnx_model"],
        int8_dynamic=quantized.outputs["int8_dynamic"],
        int8_qdq=quantized.outputs["int8_qdq"],
        engine=engine.outputs["engine"],
        cleaned=cleaned.outputs["cleaned"],
        base=base.outputs["model"],
        qa_uri=qa_uri,
        release_root=release_root,
        preset=preset,
        overrides=evaluate_overrides,
        model_name=checked.outputs["model_name"],
        production_fingerprint=checked.outputs["production_fingerprint"],
    )
    evaluated.set_display_name("9 evaluate + gate")

    # kfp.local resolves a condition on a task's single return value ("Output") but not on a named
    # output, so evaluate returns the gate decision as its only parameter output.
    with dsl.If(evaluated.outputs["Output"] == True, name="gate-passed"):  # noqa: E712 - KFP condition
        released = promote_release(
            student=student.outputs["student"],
            onnx_fp32=exported.outputs["onnx_model"],
            int8_dynamic=quantized.outputs["int8_dynamic"],
            int8_qdq=quantized.outputs["int8_qdq"],
            engine=engine.outputs["engine"],
            evaluation=evaluated.outputs["evaluation"],
            release_root=release_root,
            model_name=checked.outputs["model_name"],
            version=release_version,
            cpu_request=cpu_request,
            memory_request=memory_request,
            s3_secret_name=s3_secret_name,
            mlflow_secret_name=mlflow_secret_name,
        )
        released.set_display_name("10 promote release").set_caching_options(False)
        served = serve_release(
            release=released.output,
            predictor_image=service_image("serve"),
            gpu_node_selector=gpu_node_selector,
            gpu_tolerations=gpu_tolerations,
            preset=preset,
            overrides=serve_overrides,
            cpu_request=cpu_request,
            memory_request=memory_request,
            s3_secret_name=s3_secret_name,
            mlflow_secret_name=mlflow_secret_name,
        )
        served.set_display_name("11 serve release").set_caching_options(False)

    for task in _stage_tasks():  # the sub-pipelines place their own steps (_as_nested_step)
        _place(task, placement)
