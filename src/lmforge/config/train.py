"""Configs of the training stages: model shape, the shared loop, ``pretrain``, ``finetune_lora``, ``distill``."""

from __future__ import annotations

import logging
import string
from typing import Any, Literal

from pydantic import Field, model_validator

from lmforge.config.base import Precision, StrictModel
from lmforge.contracts import QA_HELDOUT_FRACTION

log = logging.getLogger("lmforge.config")

ChunkLang = Literal["en", "zh", "auto"]
CHECKPOINT_PLACEHOLDERS = ("run_root", "run_id", "stage")
"""What a templated ``checkpoint.dir`` may name (see :func:`lmforge.train.checkpoint.resolve_checkpoint_config`)."""
MIN_CHUNK_TOKENS = 8  # enough for any one character, so a chunk never has to split one


class ModelConfig(StrictModel):
    """Shape of a decoder-only transformer."""

    arch: Literal["gpt2", "llama"] = Field("gpt2", description="Architecture family (transformers class).")
    n_layer: int = Field(2, gt=0, description="Number of transformer blocks.")
    n_head: int = Field(2, gt=0, description="Attention heads per block.")
    n_embd: int = Field(64, gt=0, description="Hidden size.")
    block_size: int = Field(128, gt=0, description="Context length (maximum positions).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on residuals, attention and embeddings.")
    n_kv_head: int | None = Field(
        None,
        gt=0,
        description="Key/value heads per block (llama only): fewer than n_head is grouped-query attention, each "
        "key/value head shared by n_head / n_kv_head query heads (Llama 3: 8); a smaller KV cache. null: n_head.",
    )
    intermediate_size: int | None = Field(
        None,
        gt=0,
        description="Width of each block's MLP hidden layer (Llama 3 8B: 14336); null: 4 × n_embd.",
    )
    rope_theta: float | None = Field(
        None,
        gt=0.0,
        description="Base period of the rotary position embedding (llama only; Llama 3: 500000); null: "
        "transformers' default, 10000.",
    )

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelConfig:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        return self

    @model_validator(mode="after")
    def _llama_only_fields(self) -> ModelConfig:
        if self.arch != "llama":
            given = [name for name in ("n_kv_head", "rope_theta") if getattr(self, name) is not None]
            if given:
                raise ValueError(
                    f"{', '.join(given)}: llama only, but arch is {self.arch}; remove it or set arch: llama"
                )
        if self.n_kv_head is not None and self.n_head % self.n_kv_head:
            raise ValueError(f"n_kv_head ({self.n_kv_head}) must divide n_head ({self.n_head})")
        return self

    @property
    def kv_heads(self) -> int:
        """Key/value heads per block: ``n_kv_head``, else one per attention head."""
        return self.n_kv_head or self.n_head

    @property
    def mlp_width(self) -> int:
        """Width of the MLP hidden layer: ``intermediate_size``, else 4 × ``n_embd``."""
        return self.intermediate_size or 4 * self.n_embd


class CheckpointConfig(StrictModel):
    """Resumable training checkpoints: full state, atomic, to a local path or ``s3://``."""

    dir: str | None = Field(
        None,
        min_length=1,
        description="Where checkpoints go: a local directory or s3://bucket/prefix; null disables checkpoints. "
        "Multi-node runs need s3:// or a shared filesystem. May be a template of {run_root} ($LMFORGE_RUN_ROOT: the "
        "run's staging or release root, set by the pipeline), {run_id} ($LMFORGE_RUN_ID, the same on every retry) "
        "and {stage} (the training stage), e.g. {run_root}/checkpoints/{run_id}/{stage}, filled in when training "
        "starts.",
    )
    every_steps: int = Field(0, ge=0, description="Write a checkpoint every N optimizer steps (0: by time only).")
    every_minutes: float = Field(
        5.0, ge=0.0, description="Write a checkpoint when this many minutes passed since the last one (0: off)."
    )
    keep_last: int = Field(3, ge=1, description="Complete checkpoints kept; older ones are deleted.")
    resume: Literal["auto", "never"] = Field(
        "auto",
        description="auto: continue from the newest complete checkpoint in dir (start fresh if none); "
        "never: start fresh and refuse a dir that already holds checkpoints.",
    )
    on_sigterm: bool = Field(
        True, description="On SIGTERM (preemption) write a final checkpoint, then stop with TrainingPreempted."
    )

    @model_validator(mode="after")
    def _check_dir(self) -> CheckpointConfig:
        if self.dir is not None:
            try:
                names = {name for _, name, _, _ in string.Formatter().parse(self.dir) if name is not None}
            except ValueError as exc:
                raise ValueError(f"dir {self.dir!r}: not a valid template ({exc})") from exc
            if unknown := names - set(CHECKPOINT_PLACEHOLDERS):
                raise ValueError(
                    f"dir {self.dir!r}: unknown placeholder(s) {sorted(unknown)}; "
                    f"known: {list(CHECKPOINT_PLACEHOLDERS)}"
                )
        if self.dir is not None and self.dir.startswith("s3://") and not self.dir[len("s3://") :].strip("/"):
            raise ValueError(f"dir: s3 URI {self.dir!r} has no bucket")
        if self.dir is not None and self.every_steps == 0 and self.every_minutes == 0 and not self.on_sigterm:
            raise ValueError("dir is set but every_steps, every_minutes and on_sigterm are all off: nothing is saved")
        return self


class ZeroConfig(StrictModel):
    """DeepSpeed ZeRO settings (the ``zero_optimization`` section of the generated DeepSpeed JSON)."""

    stage: int = Field(2, ge=0, le=3, description="ZeRO stage: 0 off, 1 optimizer, 2 +gradients, 3 +parameters.")
    overlap_comm: bool = Field(True, description="Overlap gradient reduction with the backward pass.")
    contiguous_gradients: bool = Field(True, description="Copy gradients into one buffer as they are produced.")
    reduce_scatter: bool = Field(True, description="Reduce gradients with reduce-scatter instead of all-reduce.")
    reduce_bucket_size: int = Field(
        500_000_000, gt=0, description="Elements reduced at a time (an integer; booleans are rejected)."
    )
    allgather_bucket_size: int = Field(500_000_000, gt=0, description="Elements all-gathered at a time (stage 1/2).")
    stage3_prefetch_bucket_size: int = Field(50_000_000, ge=0, description="Stage 3: elements prefetched ahead.")
    stage3_param_persistence_threshold: int = Field(
        100_000, ge=0, description="Stage 3: parameters smaller than this stay unpartitioned."
    )
    stage3_max_live_parameters: int = Field(
        1_000_000_000, gt=0, description="Stage 3: most parameter elements resident at once on a rank."
    )
    stage3_max_reuse_distance: int = Field(
        1_000_000_000, ge=0, description="Stage 3: keep a parameter gathered if reused within this many elements."
    )
    offload_optimizer: Literal["none", "cpu"] = Field(
        "none", description="ZeRO-Offload: keep optimizer state in CPU memory (stage >= 1)."
    )
    offload_param: Literal["none", "cpu"] = Field(
        "none", description="ZeRO-Infinity: keep parameters in CPU memory (stage 3 only)."
    )

    @model_validator(mode="after")
    def _stage_options(self) -> ZeroConfig:
        if self.offload_param != "none" and self.stage != 3:
            raise ValueError(f"offload_param needs stage 3 (stage is {self.stage})")
        if self.offload_optimizer != "none" and self.stage == 0:
            raise ValueError("offload_optimizer needs stage >= 1 (stage is 0)")
        # Compared with the defaults, not with the keys given, so that a dumped config validates again.
        stage3_only = sorted(
            name
            for name, info in type(self).model_fields.items()
            if name.startswith("stage3_") and getattr(self, name) != info.default
        )
        if stage3_only and self.stage != 3:
            raise ValueError(f"{', '.join(stage3_only)} apply to stage 3 only (stage is {self.stage})")
        return self


class DeepSpeedFp16Config(StrictModel):
    """DeepSpeed dynamic loss scaling; only meaningful with ``precision: fp16``."""

    initial_scale_power: int = Field(16, ge=0, le=32, description="Initial loss scale is 2**this.")
    loss_scale_window: int = Field(1000, gt=0, description="Steps without overflow before the scale grows.")
    hysteresis: int = Field(2, gt=0, description="Overflows tolerated before the scale shrinks.")
    min_loss_scale: float = Field(1.0, gt=0.0, description="Lower bound of the dynamic loss scale.")


class DeepSpeedConfig(StrictModel):
    """DeepSpeed options; the DeepSpeed JSON is generated from these plus the loop settings."""

    zero: ZeroConfig = Field(default_factory=ZeroConfig, description="ZeRO sharding.")
    fp16: DeepSpeedFp16Config | None = Field(
        None, description="Loss-scaling options; allowed only with train.precision fp16 (never with bf16)."
    )
    zero3_init: bool = Field(
        True,
        description="Stage 3: construct the model under zero.Init via HfDeepSpeedConfig, so no rank holds it "
        "whole; the initial weights are the same as without it (Hugging Face initialization, from the seed).",
    )
    communication_data_type: Literal["fp32", "bf16", "fp16"] | None = Field(
        None, description="Dtype of gradient communication; null follows the training precision."
    )


class MeshConfig(StrictModel):
    """The fsdp2 device mesh: ``pipeline_parallel × data_parallel_shard × tensor_parallel`` ranks, whose product
    is WORLD_SIZE.

    Ranks are laid out row-major: the ``tensor_parallel`` ranks of one data-parallel group are adjacent (on one
    node, where the links are fastest), and each pipeline stage is a block of ``data_parallel_shard ×
    tensor_parallel`` consecutive ranks (stages talk only to their neighbours, so they may span nodes).
    """

    data_parallel_shard: int | None = Field(
        None,
        gt=0,
        description="Ranks that shard the parameters, gradients and optimizer states (FSDP2) and split each step's "
        "global batch between them; null: every rank tensor_parallel leaves (WORLD_SIZE / tensor_parallel).",
    )
    tensor_parallel: int = Field(
        1,
        gt=0,
        description="Ranks that split every block's matrices (attention heads, MLP width, embeddings and head by "
        "vocabulary) and read the same batch; must divide the attention heads, key/value heads and MLP width "
        "(llama and gpt2; keep it within one node).",
    )
    pipeline_parallel: int = Field(
        1,
        gt=0,
        description="Pipeline stages: the transformer blocks are split by layers into this many consecutive "
        "stages (the first also holds the embeddings, the last the final norm and head), each on its own "
        "data_parallel_shard × tensor_parallel ranks; each step's micro-batches (train.grad_accum, at least "
        "this many) flow through the stages on pipeline_schedule. pretrain only.",
    )
    pipeline_schedule: Literal["1f1b", "gpipe"] = Field(
        "1f1b",
        description="With pipeline_parallel > 1: 1f1b (one forward, one backward: at most pipeline_parallel "
        "micro-batches of activations in flight on the first stage) or gpipe (every forward, then every "
        "backward: all train.grad_accum micro-batches in flight).",
    )

    def degrees(self, world_size: int) -> tuple[int, int]:
        """``(data_parallel_shard, tensor_parallel)`` for ``world_size`` ranks (the rest are pipeline stages).

        Raises:
            ValueError: the three degrees' product is not ``world_size``, naming the fields and the world size.
        """
        tp, pp = self.tensor_parallel, self.pipeline_parallel
        dp = self.data_parallel_shard if self.data_parallel_shard is not None else world_size // (tp * pp)
        if pp * dp * tp != world_size:
            given = "null (the rest)" if self.data_parallel_shard is None else str(dp)
            raise ValueError(
                f"distributed.mesh: pipeline_parallel ({pp}) × data_parallel_shard ({given}) × tensor_parallel "
                f"({tp}) must equal the world size, but WORLD_SIZE is {world_size}; launch that many ranks or "
                "change the mesh"
            )
        return dp, tp


def tensor_parallel_problem(
    tensor_parallel: int, *, arch: str, heads: int, kv_heads: int, mlp_width: int
) -> str | None:
    """Why a model shape cannot be split over ``tensor_parallel`` ranks (None when it can)."""
    if tensor_parallel == 1:
        return None
    if arch not in ("llama", "gpt2"):
        return (
            f"distributed.mesh.tensor_parallel ({tensor_parallel}): llama and gpt2 only; {arch} has no "
            "tensor-parallel plan (use tensor_parallel: 1 with data_parallel_shard)"
        )
    for name, size in (("attention heads", heads), ("key/value heads", kv_heads), ("MLP width", mlp_width)):
        if size % tensor_parallel:
            return (
                f"distributed.mesh.tensor_parallel ({tensor_parallel}) must divide the model's {name} ({size}); "
                "pick a tensor_parallel that divides it"
            )
    return None


class DistributedConfig(StrictModel):
    """How the loop runs across processes (launched by ``torchrun`` or the Kubeflow Trainer)."""

    backend: Literal["torch", "deepspeed", "fsdp2"] = Field(
        "torch",
        description="torch: one process, or DistributedDataParallel when launched with WORLD_SIZE > 1; "
        "deepspeed: DeepSpeed ZeRO (needs the deepspeed extra); fsdp2: PyTorch FSDP2 (fully_shard) on the device "
        "mesh of distributed.mesh, with tensor parallelism and distributed checkpoints that resume at any mesh.",
    )
    process_group: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="Collective backend; auto picks nccl on GPU and gloo on CPU."
    )
    timeout_minutes: float = Field(
        30.0, gt=0.0, description="Collective (NCCL) timeout: a rank stuck this long fails the job."
    )
    find_unused_parameters: bool = Field(False, description="DDP: tolerate parameters that get no gradient.")
    deepspeed: DeepSpeedConfig = Field(default_factory=DeepSpeedConfig, description="DeepSpeed options.")
    mesh: MeshConfig = Field(
        default_factory=MeshConfig, description="fsdp2: data-parallel sharding and tensor-parallel degrees."
    )

    @model_validator(mode="after")
    def _deepspeed_only_with_backend(self) -> DistributedConfig:
        if self.backend != "deepspeed" and self.deepspeed != DeepSpeedConfig():
            raise ValueError(f"deepspeed options are set but backend is '{self.backend}'; set backend: deepspeed")
        if self.backend != "fsdp2" and self.mesh != MeshConfig():
            raise ValueError(f"mesh is set but backend is '{self.backend}'; set backend: fsdp2")
        return self


class TrainConfig(StrictModel):
    """Optimizer, schedule and loop settings shared by pretraining, fine-tuning and distillation."""

    max_steps: int = Field(
        200,
        ge=0,
        description="Optimizer steps. 0 is for pretrain with a base model only: the base is passed through untrained.",
    )
    batch_size: int = Field(8, gt=0, description="Sequences per micro-batch on each rank.")
    grad_accum: int = Field(1, gt=0, description="Micro-batches accumulated per optimizer step.")
    seq_len: int = Field(128, gt=1, description="Tokens per training sequence (≤ the model's block size).")
    lr: float = Field(3e-3, gt=0.0, description="Peak learning rate.")
    min_lr: float = Field(3e-4, ge=0.0, description="Learning rate at the end of cosine decay.")
    warmup_steps: int = Field(
        20, ge=0, description="Linear warmup steps; more than max_steps is clipped to max_steps (with a note)."
    )
    weight_decay: float = Field(0.1, ge=0.0, description="AdamW weight decay (not applied to norms/biases).")
    beta1: float = Field(0.9, gt=0.0, lt=1.0, description="AdamW beta1.")
    beta2: float = Field(0.95, gt=0.0, lt=1.0, description="AdamW beta2.")
    grad_clip: float = Field(1.0, ge=0.0, description="Clip the global gradient norm to this (0 disables).")
    precision: Precision = Field("bf16", description="Autocast dtype: fp32, bf16 or fp16 (GradScaler).")
    seed: int = Field(1337, ge=0, description="Random seed for initialization and batch sampling.")
    eval_interval: int = Field(50, gt=0, description="Evaluate on the validation split every N steps.")
    eval_batches: int = Field(4, gt=0, description="Validation micro-batches per evaluation.")
    log_interval: int = Field(10, gt=0, description="Log loss and throughput every N steps.")
    grad_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass (less memory, about 30% more compute)."
    )
    compile: bool = Field(
        False,
        description="torch.compile the model (inductor, on GPU and on CPU with a C++ compiler); the first step "
        "compiles and is left out of tokens/s and MFU.",
    )
    fused_optimizer: bool = Field(
        True,
        description="AdamW's fused kernel where the device has one (CPU, CUDA), which also skips non-finite steps "
        "on the device without a host sync; false uses the foreach kernels. The same update either way.",
    )
    prefetch_batches: int = Field(
        2,
        ge=0,
        description="Micro-batches built ahead in a background thread while the current step computes (0: build "
        "each batch when it is needed).",
    )
    tf32: bool = Field(True, description="Allow TF32 matmuls and convolutions on Ampere+ GPUs (no effect on CPU).")
    deterministic: bool = Field(
        False, description="torch.use_deterministic_algorithms for bitwise-reproducible runs (slower)."
    )
    max_bad_steps: int = Field(
        3,
        gt=0,
        description="Steps with a non-finite loss or gradient norm are skipped and counted; this many in a row "
        "abort the run.",
    )
    peak_flops: float | None = Field(
        None,
        gt=0.0,
        description="Peak FLOP/s of one device for MFU; null looks up known GPUs (bf16 dense) and skips MFU elsewhere.",
    )
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Resumable checkpoints.")
    distributed: DistributedConfig = Field(
        default_factory=DistributedConfig, description="Single process, DDP or DeepSpeed."
    )

    @model_validator(mode="before")
    @classmethod
    def _clip_warmup(cls, data: Any) -> Any:
        """A warmup longer than the run ends with it, so that lowering ``max_steps`` alone gives a valid config."""
        if not isinstance(data, dict):
            return data
        max_steps = data.get("max_steps", cls.model_fields["max_steps"].default)
        warmup = data.get("warmup_steps", cls.model_fields["warmup_steps"].default)
        if _is_int(max_steps) and _is_int(warmup) and 0 < max_steps < warmup:
            log.warning("warmup_steps %d exceeds max_steps %d: clipped to %d", warmup, max_steps, max_steps)
            data = {**data, "warmup_steps": max_steps}
        return data

    @model_validator(mode="after")
    def _check_schedule(self) -> TrainConfig:
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        return self

    @model_validator(mode="after")
    def _check_backend_options(self) -> TrainConfig:
        deepspeed = self.distributed.deepspeed
        if deepspeed.fp16 is not None and self.precision != "fp16":
            raise ValueError(
                f"distributed.deepspeed.fp16: loss scaling is for fp16 only, but precision is {self.precision} "
                "(fp16 and bf16 never together)"
            )
        if self.distributed.backend == "deepspeed" and deepspeed.zero.stage == 3 and self.compile:
            raise ValueError("compile: torch.compile is not supported with ZeRO stage 3 here; set compile: false")
        if self.distributed.backend == "deepspeed" and deepspeed.zero.offload_param != "none" and self.compile:
            raise ValueError("compile: not supported together with distributed.deepspeed.zero.offload_param")
        if self.distributed.backend == "fsdp2" and self.precision == "fp16":
            raise ValueError("precision fp16 needs loss scaling, which fsdp2 does not do here; use bf16 (or fp32)")
        stages = self.distributed.mesh.pipeline_parallel
        if stages > 1 and self.grad_accum < stages:
            raise ValueError(
                f"grad_accum ({self.grad_accum}) must be at least distributed.mesh.pipeline_parallel ({stages}): "
                "each step's micro-batches are what flows through the pipeline stages"
            )
        if stages > 1 and self.compile:
            raise ValueError("compile: not supported with distributed.mesh.pipeline_parallel > 1; set compile: false")
        return self


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class PretrainConfig(StrictModel):
    """The ``pretrain`` stage: model shape and training loop."""

    model: ModelConfig = Field(default_factory=ModelConfig, description="Model shape.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Training loop.")

    @model_validator(mode="after")
    def _seq_fits_model(self) -> PretrainConfig:
        if self.train.seq_len > self.model.block_size:
            raise ValueError(f"train.seq_len ({self.train.seq_len}) exceeds model.block_size ({self.model.block_size})")
        return self

    @model_validator(mode="after")
    def _tensor_parallel_divides_model(self) -> PretrainConfig:
        model = self.model
        problem = tensor_parallel_problem(
            self.train.distributed.mesh.tensor_parallel,
            arch=model.arch,
            heads=model.n_head,
            kv_heads=model.kv_heads,
            mlp_width=model.mlp_width,
        )
        if problem:
            raise ValueError(f"train.{problem}")
        stages = self.train.distributed.mesh.pipeline_parallel
        if stages > model.n_layer:
            raise ValueError(
                f"train.distributed.mesh.pipeline_parallel ({stages}) exceeds model.n_layer ({model.n_layer}): "
                "every stage needs at least one block"
            )
        return self


def _refuse_zero_steps(train: TrainConfig) -> None:
    if train.max_steps == 0:
        raise ValueError("train.max_steps must be > 0 (0 is only for pretrain passing a base model through)")


def _refuse_pipeline(train: TrainConfig) -> None:
    if train.distributed.mesh.pipeline_parallel > 1:
        raise ValueError(
            "train.distributed.mesh.pipeline_parallel: pipeline stages are for pretrain only; use "
            "data_parallel_shard (and tensor_parallel) here"
        )


# Named LoRA shapes for ``LoraConfig.preset``; fields set explicitly win over them.
LORA_PRESETS: dict[str, dict[str, Any]] = {
    "seeds": {"r": 64, "alpha": 16, "dropout": 0.1},
    "tiny": {"r": 8, "alpha": 16, "dropout": 0.05},
}


class LoraConfig(StrictModel):
    """The ``finetune_lora`` stage (peft LoRA on prompt/response or chat data, answer tokens only in the loss)."""

    preset: Literal["seeds", "tiny"] | None = Field(
        None,
        description="Named LoRA shape filling r/alpha/dropout when they are not set: seeds = r 64, alpha 16, "
        "dropout 0.1 (scaling alpha/r = 0.25); tiny = r 8, alpha 16, dropout 0.05.",
    )
    r: int = Field(8, gt=0, le=4096, description="LoRA rank of the update B·A.")
    alpha: int = Field(16, gt=0, description="LoRA alpha; the update is scaled by alpha/r (alpha/sqrt(r) with rsLoRA).")
    dropout: float = Field(0.05, ge=0.0, lt=1.0, description="Dropout on the LoRA branch's input.")
    use_rslora: bool = Field(
        False, description="Rank-stabilized LoRA: scale by alpha/sqrt(r) instead of alpha/r (Kalajdzievski 2023)."
    )
    target_modules: list[str] | None = Field(
        None,
        min_length=1,
        description="Module names (last name component) to adapt; null picks the architecture's attention and "
        "MLP projections (gpt2: c_attn, c_proj, c_fc; llama-like: q/k/v/o/gate/up/down_proj).",
    )
    layers_to_transform: list[int] | None = Field(
        None, min_length=1, description="Adapt only these transformer block indices; null adapts every block."
    )
    bias: Literal["none", "all", "lora_only"] = Field(
        "none", description="Biases trained too: none, all biases of the model, or those of adapted modules only."
    )
    modules_to_save: list[str] | None = Field(
        None,
        min_length=1,
        description="Extra modules trained in full and stored in the adapter (e.g. a norm or a new head).",
    )
    chat_template: Literal["auto", "default"] = Field(
        "auto",
        description="How chat `messages` are rendered: auto = the tokenizer's chat template when it has one, "
        "else the default 'User: …/Assistant: …' template; default = always the default template.",
    )
    packing: bool = Field(
        False,
        description="Concatenate training examples into full seq_len rows (no padding; examples may attend to "
        "the previous one). Held-out loss is always computed on unpacked examples.",
    )
    split_long_examples: bool = Field(
        True,
        description="A training example whose answer (a chat's closing assistant message) does not fit seq_len "
        "becomes several, each with the full prompt and a run of whole sentences of the answer, instead of being "
        "truncated. Held-out examples are never split.",
    )
    split_lang: ChunkLang = Field(
        "auto", description="Sentence rules for split_long_examples: en, zh, or auto (zh if mostly Han characters)."
    )
    heldout_fraction: float = Field(
        QA_HELDOUT_FRACTION,
        gt=0.0,
        lt=1.0,
        description="Fraction of examples held out for eval loss (by hash of the prompt).",
    )
    train: TrainConfig = Field(
        default_factory=lambda: TrainConfig(max_steps=60, lr=2e-3, min_lr=2e-4, warmup_steps=5),
        description="Training loop.",
    )

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("preset") in LORA_PRESETS:
            data = {**LORA_PRESETS[data["preset"]], **data}
        return data

    @model_validator(mode="after")
    def _check_modules(self) -> LoraConfig:
        for name, values in (("target_modules", self.target_modules), ("modules_to_save", self.modules_to_save)):
            if values is not None and len(set(values)) != len(values):
                raise ValueError(f"{name} lists a module twice: {values}")
        both = set(self.target_modules or []) & set(self.modules_to_save or [])
        if both:
            raise ValueError(f"modules {sorted(both)} are both LoRA targets and in modules_to_save; pick one")
        if self.layers_to_transform is not None and min(self.layers_to_transform) < 0:
            raise ValueError(f"layers_to_transform must be block indices >= 0, got {self.layers_to_transform}")
        _refuse_zero_steps(self.train)
        _refuse_pipeline(self.train)
        return self

    @property
    def scaling(self) -> float:
        """The factor applied to B·A: alpha/r, or alpha/sqrt(r) with rsLoRA."""
        return self.alpha / (self.r**0.5 if self.use_rslora else self.r)


class DistillConfig(StrictModel):
    """The ``distill`` stage: student shape and initialization, the KD loss and the training mixture."""

    student_layer_fraction: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="Student depth as a fraction of the teacher's layers (same width); not used when a student_base "
        "model is given.",
    )
    init: Literal["teacher_layers", "random"] = Field(
        "teacher_layers",
        description="Student initialization: every k-th teacher layer plus embeddings (DistilBERT-style), or "
        "random; a student_base model given to the stage replaces both.",
    )
    temperature: float = Field(2.0, gt=0.0, description="Softmax temperature T for the KL term.")
    alpha: float = Field(0.5, ge=0.0, le=1.0, description="Weight of the T²·KL term; CE gets 1 − alpha.")
    divergence: Literal["forward", "reverse"] = Field(
        "forward",
        description="forward = KL(teacher‖student) (mean-seeking, Hinton); reverse = KL(student‖teacher) "
        "(mode-seeking, MiniLLM).",
    )
    chunk_tokens: int = Field(
        256,
        gt=0,
        description="Positions per chunk of the KD loss; bounds the fp32 full-vocabulary temporaries to "
        "chunk_tokens × vocab floats.",
    )
    teacher_dtype: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="Teacher weights dtype; auto = bf16 on a GPU that supports it, else fp32."
    )
    teacher_sharding: Literal["replicated", "fsdp2"] = Field(
        "replicated",
        description="replicated: every rank holds the whole frozen teacher. fsdp2: the teacher is sharded over all "
        "ranks (FSDP2 fully_shard per block and the root), each rank holding 1/ranks of its weights and gathering "
        "one block at a time while it runs the teacher on its own batch, for a teacher that does not fit one GPU; "
        "the student stays data-parallel as train.distributed.backend says (torch DDP or fsdp2, not deepspeed). A "
        "single process without a process group holds the whole teacher either way.",
    )
    qa_fraction: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="Task-aware distillation: the share of each micro-batch's rows that are fine-tuning examples "
        "(the train split of the Q&A data LoRA used, prompt masked, the KD loss on the response tokens only; the "
        "rest are corpus windows), and the weight of their loss: (1 − qa_fraction)·loss(windows) + "
        "qa_fraction·loss(examples). 0: corpus windows only; 1: examples only. Without Q&A data (none given and "
        "none recorded in the teacher's manifest) the student learns from corpus windows only.",
    )
    train: TrainConfig = Field(default_factory=TrainConfig, description="Training loop.")

    @model_validator(mode="after")
    def _steps(self) -> DistillConfig:
        _refuse_zero_steps(self.train)
        _refuse_pipeline(self.train)
        return self

    @model_validator(mode="after")
    def _teacher_sharding_with_backend(self) -> DistillConfig:
        if self.teacher_sharding == "fsdp2" and self.train.distributed.backend == "deepspeed":
            raise ValueError(
                "teacher_sharding fsdp2 shards the teacher beside a DDP or fsdp2 student; with "
                "train.distributed.backend deepspeed use teacher_sharding replicated (or backend torch or fsdp2)"
            )
        return self
