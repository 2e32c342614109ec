"""The plan before the GPUs: per training stage, parameters, tokens, FLOPs, memory per GPU, hours and GPU-hours.

Parameters are counted exactly, on models built on PyTorch's ``meta`` device (no memory, no weights) from the same
``transformers`` config, LoRA wrapping and student shape the stages build. The rest is arithmetic:

* tokens = ``max_steps · batch_size · grad_accum · seq_len · data-parallel ranks`` (tensor-parallel peers share
  a batch);
* FLOPs per token (PaLM appendix B, as :mod:`lmforge.train.mfu` measures MFU): ``6·N + 12·L·H·Q·T`` for training
  every weight; LoRA trains no base weight, so its frozen weights cost the forward and the input-gradient
  products only (``4·N``); distillation adds the teacher's forward (``2·N_teacher + 4·L·H·Q·T``);
* memory per GPU: weights, gradients and AdamW states (16 bytes per trained parameter in lmforge's fp32-master
  loop, fsdp2 sharding all of it over every rank; DeepSpeed's bf16: 2 + 2 + 12, ZeRO-1/2/3 dividing the
  optimizer / gradient / weight parts by the ranks, Rajbhandari et al. 2020), frozen weights (4 bytes, the teacher
  in bf16: 2; a teacher sharded with ``distill.teacher_sharding: fsdp2`` holds 1/ranks of its weights plus, gathered
  during its forward pass, the root's (embeddings, final norm, head) and one block's), activations (Korthikanti et
  al. 2022: ``34·s·b·h`` bytes per layer in 16-bit with a fused attention that keeps no ``s²`` scores, of which keys
  and values ``4·s·b·h`` and the MLP's hidden layer ``16·s·b·h`` scale with their own widths; with gradient
  checkpointing ``2·s·b·h`` per layer plus one layer recomputed), and the fp32 logits and their gradient
  (``8·s·b·V``); with pipeline stages, those of the busiest stage (the first keeps the activations of the most
  micro-batches in flight, the last the logits);
* hours = FLOPs / (ranks · peak · MFU), with the accelerator's dense bf16 peak from
  :data:`lmforge.train.mfu.PEAK_FLOPS_BF16` and an assumed MFU.

A plan whose memory exceeds the accelerator's, less :data:`HEADROOM`, is refused with what to change. A stage's MFU
may instead be one it measured in an earlier run (:class:`Utilization`): preflight takes it from MLflow.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

from lmforge.config import LaunchConfig, ModelConfig
from lmforge.errors import ConfigError
from lmforge.launch import world_size
from lmforge.train.mfu import (
    GPU_MEMORY_GB,
    PEAK_FLOPS_BF16,
    distillation_flops_per_token,
    flops_per_token,
    lora_flops_per_token,
)

HEADROOM = 0.10
"""Fraction of the accelerator's memory a plan leaves free (allocator fragmentation, CUDA context, NCCL buffers)."""
DEFAULT_MFU = 0.40
"""Assumed model FLOPs utilization when none is given: what well-tuned bf16 training of this size reaches."""
PEAK_SOURCE = "vendor data sheets: dense bf16 tensor-core peak of the SXM part (lmforge.train.mfu.PEAK_FLOPS_BF16)"
"""Where :class:`Accelerator`'s peak FLOP/s and memory come from."""
ASSUMED = "assumed"
TRAINING_STAGES = ("pretrain", "finetune_lora", "distill")
# per trained parameter: weights, gradients, optimizer states (fsdp2 keeps fp32 masters, sharded like ZeRO-3)
_ADAM_BYTES = {"torch": (4, 4, 8), "deepspeed": (2, 2, 12), "fsdp2": (4, 4, 8)}
_CHECKPOINTED_BYTES = 2  # the saved layer input (16-bit) per token and unit of width
_LOGIT_BYTES = 8  # fp32 logits and their gradient, per token and vocabulary entry
_TEACHER_BYTES = 2.0  # the distillation teacher's weights in bf16, per parameter


@dataclass(frozen=True)
class StagePlan:
    """What one training stage will cost."""

    stage: str
    parameters: int
    trained_parameters: int
    tokens: int
    flops: float
    memory_gb_per_gpu: float
    gpus: int
    hours: float
    gpu_hours: float
    mfu: float
    mfu_source: str
    """``assumed``, or ``run <id>``: the pipeline run whose measured MFU the hours use."""

    def as_dict(self) -> dict[str, Any]:
        """The plan as plain data (console, KFP Metrics, JSON)."""
        return asdict(self)


@dataclass(frozen=True)
class Utilization:
    """A model FLOPs utilization and where it comes from: ``assumed`` or ``run <id>`` (measured there)."""

    mfu: float
    source: str = ASSUMED


@dataclass(frozen=True)
class Accelerator:
    """An accelerator type: its name, dense bf16 peak FLOP/s and memory."""

    name: str
    peak_flops: float
    memory_gb: float

    @classmethod
    def named(cls, name: str) -> Accelerator:
        """A known accelerator by name (``H100``, ``A100``, ...)."""
        if name not in PEAK_FLOPS_BF16:
            raise ConfigError(f"unknown accelerator {name!r}; known: {', '.join(PEAK_FLOPS_BF16)}")
        return cls(name, PEAK_FLOPS_BF16[name], GPU_MEMORY_GB[name])


def count_parameters(model: ModelConfig, vocab_size: int) -> tuple[int, int]:
    """(all parameters, those without a matrix multiply: GPT-2's learned positions) of a model shape."""
    model_obj = _meta_model(model, vocab_size)
    total = sum(p.numel() for p in model_obj.parameters())
    lookup = sum(p.numel() for name, p in model_obj.named_parameters() if name.endswith("wpe.weight"))
    return total, lookup


def _meta_model(model: ModelConfig, vocab_size: int) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    from lmforge.model.build import hf_config

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config(model, vocab_size, eos_id=0, pad_id=1))


def lora_trainable_parameters(cfg: Any, model: ModelConfig, vocab_size: int) -> int:
    """Parameters the ``finetune_lora`` stage trains on ``model``: the adapters (and any ``modules_to_save``)."""
    import peft

    from lmforge.model.lora import peft_config, target_modules

    base = _meta_model(model, vocab_size)
    with warnings.catch_warnings():  # peft asks transformers a deprecated question; not the user's concern
        warnings.simplefilter("ignore", FutureWarning)
        wrapped = peft.get_peft_model(base, peft_config(cfg, base, target_modules(base, cfg.target_modules)))
    return sum(p.numel() for p in wrapped.parameters() if p.requires_grad)


def sharded_frozen_bytes(model: ModelConfig, vocab_size: int, *, ranks: int, bytes_per_parameter: float) -> float:
    """Bytes per GPU of a frozen model sharded by FSDP2 over ``ranks`` (:mod:`lmforge.train.frozen_shard`): its
    share of every weight, plus the root's weights (embeddings, final norm, head) and one block's, gathered while
    a forward pass runs through them."""
    from lmforge.train.fsdp2 import transformer_blocks

    meta = _meta_model(model, vocab_size)
    total = sum(p.numel() for p in meta.parameters())
    blocks = transformer_blocks(meta)
    root = total - sum(p.numel() for block in blocks for p in block.parameters())
    block = sum(p.numel() for p in blocks[0].parameters())
    return bytes_per_parameter * (total / ranks + root + block)


def model_state_bytes(*, backend: str, zero_stage: int, ranks: int, trained: int) -> float:
    """Bytes per GPU of the trained parameters' weights, gradients and AdamW moments (ZeRO shards them by stage)."""
    weight_b, grad_b, optim_b = _ADAM_BYTES[backend]
    stage = {"deepspeed": zero_stage, "fsdp2": 3}.get(backend, 0)
    weights = trained * weight_b / (ranks if stage >= 3 else 1)
    grads = trained * grad_b / (ranks if stage >= 2 else 1)
    optimizer = trained * optim_b / (ranks if stage >= 1 else 1)
    return weights + grads + optimizer


def layer_activation_bytes(model: ModelConfig, tensor_parallel: int = 1) -> float:
    """Bytes one layer keeps per token for the backward pass on one rank (16-bit, fused attention; Korthikanti et
    al. 2022).

    A GPT block keeps ``34·h``: attention ``11·h`` (its input, Q, K, V, the projection's input, a dropout mask),
    the MLP ``19·h`` (its input, the hidden layer before and after the activation, a dropout mask) and the norms
    ``4·h``. Keys and values are kept at their own width ``k`` (KV heads · head size; ``h`` without grouped-query
    attention) and the hidden layer at the MLP's width ``i`` (``4·h`` by default): ``14·h + 4·k + 4·i``. Tensor
    parallelism over ``t`` ranks splits what lies between a column- and a row-parallel matrix (Q, K, V, the
    projection's input, the MLP's hidden layer: ``4·h + 4·k + 4·i``). The rest (``10·h``: block and norm inputs,
    dropout masks) is split by sequence on a Llama (sequence parallelism, :mod:`lmforge.train.fsdp2`), so all of
    it is divided by ``t``; a GPT-2 keeps it whole on every rank.
    """
    kv_width = model.kv_heads * (model.n_embd // model.n_head)
    whole, between = 10 * model.n_embd, 4 * model.n_embd + 4 * kv_width + 4 * model.mlp_width
    if model.arch == "llama":
        return (whole + between) / tensor_parallel
    return whole + between / tensor_parallel


def _memory_bytes(
    *,
    backend: str,
    zero_stage: int,
    ranks: int,
    trained: int,
    frozen_bytes: float,
    model: ModelConfig,
    micro_batch: int,
    seq_len: int,
    vocab_size: int,
    checkpointing: bool,
    tensor_parallel: int,
    in_flight: int = 1,
    with_logits: bool = True,
) -> float:
    """Bytes on one GPU; ``in_flight``: micro-batches whose activations (and logits) are kept at once (a pipeline
    stage's), ``with_logits``: whether this rank computes the logits (a pipeline's last stage)."""
    tokens = seq_len * micro_batch
    layer = layer_activation_bytes(model, tensor_parallel)
    if checkpointing:  # each micro-batch keeps its layer inputs; one layer at a time is recomputed
        activations = tokens * (_CHECKPOINTED_BYTES * model.n_embd * model.n_layer * in_flight + layer)
    else:
        activations = tokens * layer * model.n_layer * in_flight
    # whole on every rank: the TP head gathers them
    logits = _LOGIT_BYTES * tokens * vocab_size * in_flight if with_logits else 0.0
    state = model_state_bytes(backend=backend, zero_stage=zero_stage, ranks=ranks, trained=trained)
    return state + frozen_bytes + activations + logits


def pipeline_stage_parameters(model: ModelConfig, vocab_size: int, parameters: int, stages: int) -> int:
    """Parameters of the largest of ``stages`` pipeline stages: ``ceil(n_layer / stages)`` blocks' share of the
    non-embedding ``parameters`` and the embeddings (on the first stage; their size again on the last, whose head
    is a copy of the tied embedding)."""
    layers = -(-model.n_layer // stages)
    embeddings = vocab_size * model.n_embd + (model.block_size * model.n_embd if model.arch == "gpt2" else 0)
    return round((parameters - embeddings) * layers / model.n_layer) + embeddings


def _pipeline_memory_bytes(stages: int, schedule: str, grad_accum: int, **memory: Any) -> float:
    """Bytes on the busiest GPU of a pipeline of ``stages`` stages: the first stage (the embeddings and the most
    micro-batches in flight: ``stages`` with 1F1B, all with GPipe) or the last (the head — a copy of a tied
    embedding — and the logits: of one micro-batch with 1F1B, all with GPipe). Each stage holds
    ``ceil(n_layer / stages)`` blocks at most, its weights sharded over its own ranks."""
    model: ModelConfig = memory.pop("model")
    layers = -(-model.n_layer // stages)
    trained = pipeline_stage_parameters(model, memory["vocab_size"], memory.pop("trained"), stages)
    memory |= {"model": model.model_copy(update={"n_layer": layers}), "trained": trained}
    memory["ranks"] //= stages
    gpipe = schedule == "gpipe"
    first = _memory_bytes(**memory, in_flight=grad_accum if gpipe else min(stages, grad_accum), with_logits=False)
    last = _memory_bytes(**memory, in_flight=grad_accum if gpipe else 1, with_logits=True)
    return max(first, last)


def plan_training(
    config: Any,
    *,
    vocab_size: int,
    launch: LaunchConfig | None = None,
    accelerator: Accelerator | None = None,
    mfu: float = DEFAULT_MFU,
    measured: Mapping[str, Utilization] | None = None,
) -> list[StagePlan]:
    """The plan of every training stage of a resolved pipeline config (``resolve_config``'s result).

    A stage's hours use its ``measured`` utilization when given, else ``mfu`` (assumed).
    """
    launch = launch or LaunchConfig()
    accelerator = accelerator or Accelerator.named("H100")
    ranks = world_size(launch)
    teacher = config.pretrain.model
    n_teacher, lookup = count_parameters(teacher, vocab_size)
    student = teacher.model_copy(update={"n_layer": _student_layers(config.distill, teacher)})
    n_student, student_lookup = count_parameters(student, vocab_size)
    n_lora = lora_trainable_parameters(config.finetune_lora, teacher, vocab_size)

    def stage_plan(name: str, train: Any, model: ModelConfig, total: int, trained: int, frozen_bytes: float,
                   flops_token: float) -> StagePlan:  # fmt: skip
        data_ranks = _data_ranks(name, train.distributed, ranks)
        mesh = train.distributed.mesh
        tensor_parallel = mesh.tensor_parallel if train.distributed.backend == "fsdp2" else 1
        tokens = train.max_steps * train.batch_size * train.grad_accum * train.seq_len * data_ranks
        memory_of = _memory_bytes
        if mesh.pipeline_parallel > 1:
            memory_of = partial(_pipeline_memory_bytes, mesh.pipeline_parallel, mesh.pipeline_schedule,
                                train.grad_accum)  # fmt: skip
        memory = memory_of(
            backend=train.distributed.backend,
            zero_stage=train.distributed.deepspeed.zero.stage,
            ranks=ranks,
            trained=trained,
            frozen_bytes=frozen_bytes,
            model=model,
            micro_batch=train.batch_size,
            seq_len=train.seq_len,
            vocab_size=vocab_size,
            checkpointing=train.grad_checkpointing,
            tensor_parallel=tensor_parallel,
        )
        flops = tokens * flops_token
        utilization = (measured or {}).get(name, Utilization(mfu))
        hours = flops / (ranks * accelerator.peak_flops * utilization.mfu) / 3600
        return StagePlan(
            name, total, trained, tokens, flops, memory / 1e9, ranks, hours, hours * ranks, utilization.mfu,
            utilization.source,
        )  # fmt: skip

    pretrain, lora, distill = config.pretrain.train, config.finetune_lora.train, config.distill.train
    matmul_teacher = n_teacher - lookup
    teacher_bytes = _TEACHER_BYTES * n_teacher
    if config.distill.teacher_sharding == "fsdp2":
        teacher_bytes = sharded_frozen_bytes(teacher, vocab_size, ranks=ranks, bytes_per_parameter=_TEACHER_BYTES)
    shape = teacher.n_layer, teacher.n_head, teacher.n_embd // teacher.n_head
    student_shape = student.n_layer, student.n_head, student.n_embd // student.n_head
    return [
        stage_plan(
            "pretrain", pretrain, teacher, n_teacher, n_teacher, 0.0,
            flops_per_token(matmul_teacher, *shape, pretrain.seq_len),
        ),
        stage_plan(
            "finetune_lora", lora, teacher, n_teacher + n_lora, n_lora, 4.0 * n_teacher,
            lora_flops_per_token(matmul_teacher, n_lora, *shape, lora.seq_len),
        ),
        stage_plan(
            "distill", distill, student, n_student, n_student, teacher_bytes,
            distillation_flops_per_token(
                flops_per_token(n_student - student_lookup, *student_shape, distill.seq_len), matmul_teacher, *shape,
                distill.seq_len,
            ),
        ),
    ]  # fmt: skip


def _data_ranks(stage: str, distributed: Any, ranks: int) -> int:
    """Ranks that read their own part of the batch: all but tensor-parallel peers; refuses an fsdp2 mesh whose
    degrees do not multiply to the launch's ranks."""
    if distributed.backend != "fsdp2":
        return ranks
    try:
        return distributed.mesh.degrees(ranks)[0]
    except ValueError as exc:
        raise ConfigError(f"{stage}.train.{exc} (launch: num_nodes × gpus_per_node)") from None


def _student_layers(distill: Any, teacher: ModelConfig) -> int:
    from lmforge.model.student import student_layers

    return len(student_layers(teacher.n_layer, distill.student_layer_fraction))


def refuse_oversized(plans: list[StagePlan], accelerator: Accelerator) -> None:
    """Raise ``ConfigError`` naming each stage whose memory estimate exceeds the accelerator less the headroom."""
    limit = accelerator.memory_gb * (1 - HEADROOM)
    over = [plan for plan in plans if plan.memory_gb_per_gpu > limit]
    if over:
        lines = "; ".join(
            f"{plan.stage}: {plan.memory_gb_per_gpu:.1f} GB per GPU, over {limit:.1f} GB "
            f"({accelerator.name} {accelerator.memory_gb:.0f} GB less {HEADROOM:.0%} headroom)"
            for plan in over
        )
        raise ConfigError(
            f"{lines}. Lower train.batch_size (raise grad_accum to keep the batch), turn on "
            "train.grad_checkpointing, use distributed.backend deepspeed with a higher zero.stage, or add GPUs"
        )


def plan_record(plans: list[StagePlan], accelerator: Accelerator, *, preset: str) -> dict[str, Any]:
    """The plan as preflight records it (its ``plan`` output, as JSON): the accelerator with its figures' source and
    every stage's plan."""
    return {
        "preset": preset,
        "accelerator": {**asdict(accelerator), "source": PEAK_SOURCE},
        "headroom": HEADROOM,
        "stages": [plan.as_dict() for plan in plans],
    }


def plan_line(plan: StagePlan, accelerator: Accelerator) -> str:
    """One console line of a stage's plan: size, tokens, FLOPs, memory per GPU, hours and the MFU behind them."""
    return (
        f"{plan.stage}: {plan.parameters / 1e6:.3g}M parameters ({plan.trained_parameters / 1e6:.3g}M trained), "
        f"{plan.tokens:.3g} tokens, {plan.flops:.3g} FLOPs, {plan.memory_gb_per_gpu:.3g} GB per GPU of "
        f"{accelerator.memory_gb:.0f}, {plan.hours:.3g} h on {plan.gpus}x {accelerator.name} = "
        f"{plan.gpu_hours:.3g} GPU-h at MFU {plan.mfu:.0%} ({plan.mfu_source})"
    )
