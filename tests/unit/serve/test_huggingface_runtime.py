"""The ``huggingface`` serve target: a release's ``student/`` as KServe's stock ``kserve-huggingfaceserver`` serves it.

huggingfaceserver is not on PyPI (KServe builds it into its image from ``python/huggingfaceserver``), so the rules
of it that decide whether a release loads and what it answers are copied here, and only those, from
github.com/kserve/kserve tag v0.20.0, commit 1fb781055dd1567164358233e1125142ca6ef1fe (Apache-2.0, Copyright The
KServe Authors), ``python/huggingfaceserver/huggingfaceserver/``:

* ``__main__.py``: the command line (KServe's ``model_server.parser``, from the installed ``kserve``, plus the
  server's own arguments) and ``load_model`` (the dtype, the task from ``config.json``'s architectures);
* ``task.py``: ``ARCHITECTURES_2_TASK``, ``SUPPORTED_TASKS``, ``infer_task_from_model_architecture`` and the Auto
  class of a text generation task (``TASK_2_CLS``);
* ``utils.py``: ``_get_and_verify_max_len`` (the context keys; a ``--max_model_len`` above them is refused);
* ``generative_model.py``: ``load`` (tokenizer and model arguments, the ``[PAD]`` fallback), ``create_completion``,
  ``build_generation_config`` and ``_handle_request`` (a non-streamed completion, greedy at temperature 0).

The server parses its arguments with ``parse_known_args``, so a misspelt one would be dropped in silence; these tests
parse strictly. On a GPU the vLLM backend adds vLLM's own options (``make_arg_parser``), which needs vLLM and is not
installed here: the tests add the two lmforge passes, ``--dtype`` and ``--gpu-memory-utilization``, as vLLM 0.24
names them. ``parse_known_args`` skips the underscore-to-dash rewriting of vLLM's ``FlexibleArgumentParser`` (only its
``parse_args`` does it), so plain argparse parses them as the server does.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from accelerate import init_empty_weights
from kserve.model_server import parser as kserve_parser
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PretrainedConfig

from lmforge.artifacts import write_manifest
from lmforge.config.base import validate_config
from lmforge.config.serve import ServeConfig
from lmforge.errors import InputDataError
from lmforge.release.promote import promote
from lmforge.serve.serve import run as serve
from tests.support.crd_schema import CRDS, strict_validator

pytestmark = pytest.mark.slow

KSERVE = CRDS / "kserve"
STOCK_RUNTIME = KSERVE / "v0.20.0" / "kserve-huggingfaceserver.yaml"
PROMPTS = ("ROMEO:", "O Romeo, Romeo", "the")
MAX_TOKENS = 12

# task.py
ARCHITECTURES_2_TASK = {
    "TapasForQuestionAnswering": "table_question_answering",
    "ForQuestionAnswering": "question_answering",
    "ForTokenClassification": "token_classification",
    "ForSequenceClassification": "sequence_classification",
    "ForMultipleChoice": "multiple_choice",
    "ForMaskedLM": "fill_mask",
    "ForCausalLM": "text_generation",
    "ForConditionalGeneration": "text2text_generation",
    "MTModel": "text2text_generation",
    "EncoderDecoderModel": "text2text_generation",
    "ForPrediction": "time_series_forecast",
}
SUPPORTED_TASKS = {
    *("sequence_classification", "token_classification", "fill_mask", "text_generation"),
    *("text2text_generation", "text_embedding", "time_series_forecast"),
}
TASK_2_CLS = {"text_generation": AutoModelForCausalLM}  # the one entry a causal LM reaches
# utils.py: _get_and_verify_max_len's possible_keys
MAX_LEN_KEYS = (
    *("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length"),
    *("max_sequence_length", "max_seq_length", "seq_len"),
)
# __main__.py: the Hugging Face backend's --dtype (CPU default float32)
HF_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
HF_DTYPES |= {"half": torch.float16, "float": torch.float32}
# vLLM's --dtype choices (vllm.config.ModelConfig.dtype), for the GPU backend
VLLM_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")


def _server_parser(*, vllm: bool) -> argparse.ArgumentParser:
    """huggingfaceserver's argument parser (``__main__.py``): with ``vllm`` the two vLLM options lmforge passes,
    without it the Hugging Face backend's ``--task``, ``--max_log_len`` and ``--dtype``."""
    parser = argparse.ArgumentParser(parents=[kserve_parser])
    parser.add_argument("--model_dir", default="/mnt/models")
    parser.add_argument("--model_id", default=None)
    parser.add_argument("--model_revision", default=None)
    parser.add_argument("--tokenizer_revision", default=None)
    parser.add_argument("--max_length", dest="max_model_len", type=int)
    parser.add_argument("--max_model_len", type=int)
    for flag in ("--disable_lower_case", "--disable_special_tokens", "--trust_remote_code"):
        parser.add_argument(flag, action="store_true")
    parser.add_argument("--tensor_input_names", type=lambda arg: arg.split(","), default=None)
    parser.add_argument("--backend", default="auto", choices=("auto", "huggingface", "vllm"))
    for flag in ("--return_token_type_ids", "--return_offsets_mapping", "--disable_log_requests"):
        parser.add_argument(flag, action="store_true")
    output_format = parser.add_mutually_exclusive_group()
    output_format.add_argument("--return_probabilities", action="store_true")
    output_format.add_argument("--return_raw_logits", action="store_true")
    if vllm:
        parser.add_argument("--dtype", default="auto", choices=VLLM_DTYPES)
        parser.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    else:
        parser.add_argument("--task")
        parser.add_argument("--max_log_len", "--max-log-len", type=int, default=None)
        parser.add_argument("--dtype", default="auto", choices=("auto", *HF_DTYPES))
    return parser


def _container_args(isvc: dict[str, Any]) -> list[str]:
    """The model server's command line in the predictor pod: the stock runtime's args with ``{{.Name}}`` filled in,
    then the InferenceService's (KServe's ``MergeRuntimeContainers`` concatenates the two lists)."""
    (container,) = yaml.safe_load(STOCK_RUNTIME.read_text())["spec"]["containers"]
    name = isvc["metadata"]["name"]
    return [a.replace("{{.Name}}", name) for a in container["args"]] + isvc["spec"]["predictor"]["model"]["args"]


def _infer_task(config: PretrainedConfig) -> str:
    """task.py ``infer_task_from_model_architecture``."""
    architecture = config.architectures[0]
    task = next((t for suffix, t in ARCHITECTURES_2_TASK.items() if architecture.endswith(suffix)), None)
    if task is None:
        raise ValueError(f"Task couldn't be inferred from {architecture}. Please manually set `task` option. ")
    if task not in SUPPORTED_TASKS:
        raise ValueError(f"Task {task} is not supported.")
    return task


def _verify_max_len(config: PretrainedConfig, max_model_len: int | None) -> int:
    """utils.py ``_get_and_verify_max_len`` for a config without rope scaling or sliding window."""
    derived = min((getattr(config, k) for k in MAX_LEN_KEYS if getattr(config, k, None) is not None), default=2048)
    if max_model_len is not None and max_model_len > derived:
        raise ValueError(f"User-specified max_model_len ({max_model_len}) is greater than the derived max_model_len")
    return int(derived if max_model_len is None else max_model_len)


def _load_as_huggingfaceserver(model_dir: Path, argv: list[str]) -> tuple[Any, Any, int]:
    """``load_model`` and ``HuggingfaceGenerativeModel.load`` on the CPU: model, tokenizer and max length."""
    args = _server_parser(vllm=False).parse_args(argv)
    config = AutoConfig.from_pretrained(str(model_dir), revision=args.model_revision, trust_remote_code=False)
    dtype = args.dtype
    if dtype == "auto":
        dtype = getattr(config, "dtype", None) or "float32"
    dtype = HF_DTYPES[dtype] if isinstance(dtype, str) else dtype
    task = args.task or _infer_task(config)
    max_length = _verify_max_len(config, args.max_model_len)
    model_cls = TASK_2_CLS[task]
    with init_empty_weights():
        empty = model_cls.from_config(config, trust_remote_code=False)
    device_map = "auto" if empty._no_split_modules else torch.device("cpu")
    tokenizer_kwargs = {} if config.is_encoder_decoder else {"padding_side": "left"}
    tokenizer = AutoTokenizer.from_pretrained(
        str(model_dir), revision=args.tokenizer_revision, do_lower_case=not args.disable_lower_case, **tokenizer_kwargs
    )
    model = model_cls.from_pretrained(model_dir, revision=args.model_revision, device_map=device_map, dtype=dtype)
    model.eval()
    if not tokenizer.pad_token:
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})
        model.resize_token_embeddings(len(tokenizer))
    return model, tokenizer, max_length


@torch.no_grad()
def _complete_as_huggingfaceserver(model: Any, tokenizer: Any, max_length: int, prompt: str) -> str:
    """``create_completion`` of one prompt, greedy (temperature 0 is not passed on), not streamed."""
    inputs = tokenizer([prompt], padding=True, return_tensors="pt")
    prompt_len = inputs["input_ids"].shape[-1]
    assert prompt_len + MAX_TOKENS <= max_length, "the server refuses a completion past its context"
    config = GenerationConfig(max_new_tokens=MAX_TOKENS, top_p=None, pad_token_id=tokenizer.pad_token_id)
    outputs = model.generate(**inputs, stopping_criteria=None, generation_config=config)
    return tokenizer.batch_decode(outputs[:, prompt_len:], skip_special_tokens=True)[0]


@torch.no_grad()
def _transformers_greedy(model_dir: Path, prompt: str) -> str:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    inputs = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[-1] :], skip_special_tokens=True)


def _release(student: Path, root: Path, name: str) -> Path:
    evaluation = root / "evaluation"
    evaluation.mkdir(parents=True)
    (evaluation / "results.json").write_text(json.dumps({"passed": True, "gate": {"checks": []}}))
    write_manifest(evaluation, "evaluation")
    registry = root / "registry"
    promote(
        model_name=name,
        release_root=str(registry),
        version="v1",
        artifacts={"student": student},
        evaluation_dir=evaluation,
    )
    return registry / "models" / name / "v1"


@pytest.fixture(scope="module")
def release(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A release holding a demo-shaped student (2-layer GPT-2, the tiny tokenizer), as promote writes it."""
    return _release(tiny_model_dir, tmp_path_factory.mktemp("hf-release"), "lmforge-demo")


def _serve(release: Path, out: Path, **fields: Any) -> dict[str, Any]:
    serve(validate_config(ServeConfig, {"runtime": "huggingface", **fields}), release=str(release), serving=out)
    return yaml.safe_load((out / "inferenceservice.yaml").read_text())


def test_serve_stage_points_the_stock_runtime_at_the_releases_student(release: Path, tmp_path: Path) -> None:
    isvc = _serve(release, tmp_path / "serving")
    model = isvc["spec"]["predictor"]["model"]
    assert (model["runtime"], model["storageUri"]) == ("kserve-huggingfaceserver", str(release / "student"))
    student = Path(model["storageUri"])
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in student.iterdir()}
    context = json.loads((student / "config.json").read_text())["n_positions"]
    assert model["args"] == [
        "--model_name=lmforge-demo",
        f"--max_model_len={context}",
        "--dtype=float32",
        "--backend=huggingface",
        "--task=text_generation",
    ]
    for version in ("v0.15.2", "v0.20.0"):
        crd = KSERVE / version / "serving.kserve.io_inferenceservices.yaml"
        assert not list(strict_validator(crd, "v1beta1").iter_errors(isvc))
    assert not (tmp_path / "serving" / "servingruntime.yaml").exists()
    manifest = json.loads((tmp_path / "serving" / "manifest.json").read_text())
    assert (manifest["runtime"], manifest["artifact"]) == ("huggingface", "student")


def test_cpu_arguments_are_ones_the_stock_runtime_parses(release: Path, tmp_path: Path) -> None:
    argv = _container_args(_serve(release, tmp_path / "s", model_name="demo"))
    args = _server_parser(vllm=False).parse_args(argv)  # strict: an argument it does not define fails here
    assert (args.model_name, args.backend, args.dtype, args.task) == (
        "demo",
        "huggingface",
        "float32",
        "text_generation",
    )
    assert args.model_dir == "/mnt/models"  # where KServe's storage initializer puts storageUri
    assert args.max_model_len == json.loads((release / "student" / "config.json").read_text())["n_positions"]


def test_gpu_arguments_are_ones_the_vllm_backend_parses(release: Path, tmp_path: Path) -> None:
    isvc = _serve(release, tmp_path / "s", device="gpu", hf_gpu_memory_utilization=0.8)
    args = _server_parser(vllm=True).parse_args(_container_args(isvc))
    assert (args.model_name, args.backend, args.dtype, args.gpu_memory_utilization) == (
        "lmforge-demo",
        "vllm",
        "auto",
        0.8,
    )
    with pytest.raises(SystemExit):  # the underscored spelling is no option of the server's: it would be dropped
        _server_parser(vllm=True).parse_args(["--gpu_memory_utilization=0.8"])


def test_the_student_loads_and_generates_as_huggingfaceserver_does(release: Path, tmp_path: Path) -> None:
    """Loaded with the runtime's rules and the InferenceService's arguments, the release's student completes each
    prompt exactly as ``transformers`` greedy generation does."""
    isvc = _serve(release, tmp_path / "s")
    student = Path(isvc["spec"]["predictor"]["model"]["storageUri"])
    model, tokenizer, max_length = _load_as_huggingfaceserver(student, _container_args(isvc))
    with pytest.raises(ValueError, match="Task couldn't be inferred from GPT2LMHeadModel"):  # hence --task
        _infer_task(AutoConfig.from_pretrained(student))
    assert tokenizer.padding_side == "left" and tokenizer.pad_token is not None
    assert next(model.parameters()).dtype == torch.float32
    for prompt in PROMPTS:
        served = _complete_as_huggingfaceserver(model, tokenizer, max_length, prompt)
        assert served == _transformers_greedy(student, prompt), prompt


def test_a_student_without_its_tokenizer_does_not_load(release: Path, tmp_path: Path) -> None:
    student = shutil.copytree(release / "student", tmp_path / "student")
    (student / "tokenizer.json").unlink()
    argv = ["--model_name=m", "--backend=huggingface", "--dtype=float32", "--task=text_generation"]
    with pytest.raises(ValueError, match="Couldn't instantiate the backend tokenizer"):
        _load_as_huggingfaceserver(student, argv)


def test_a_student_without_architectures_is_refused_by_the_stage_and_fails_the_runtime(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    student = shutil.copytree(tiny_model_dir, tmp_path / "student")
    config = json.loads((student / "config.json").read_text())
    del config["architectures"]
    (student / "config.json").write_text(json.dumps(config))
    write_manifest(student, "model")
    with pytest.raises(TypeError):  # the runtime's config.architectures[0] on None
        _load_as_huggingfaceserver(student, ["--model_name=m", "--backend=huggingface"])
    release = _release(student, tmp_path / "r", "no-arch")
    with pytest.raises(InputDataError, match="no architectures; kserve-huggingfaceserver infers the model's task"):
        _serve(release, tmp_path / "serving")
    assert not (tmp_path / "serving").exists()
