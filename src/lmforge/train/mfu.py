"""Model FLOPs utilization (MFU), as in the PaLM paper (Chowdhery et al. 2022, appendix B).

Training a decoder-only transformer costs, per token, ``6·N + 12·L·H·Q·T`` FLOPs: ``6·N`` for the
forward (2) and backward (4) matrix multiplies with the ``N`` parameters, plus the attention score and
value products (``L`` layers, ``H`` heads, head size ``Q``, context ``T``). Recomputation for
gradient checkpointing is *not* counted, so MFU is comparable across that switch (unlike HFU).
"""

from __future__ import annotations

import torch

# Dense bf16 tensor-core peak per device, FLOP/s (vendor data sheets; SXM parts).
PEAK_FLOPS_BF16 = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "L4": 121e12,
}
# Memory per device, GB (the same data sheets; H200 141 GB HBM3e, A100 the 80 GB part).
GPU_MEMORY_GB = {
    "H200": 141.0,
    "H100": 80.0,
    "A100": 80.0,
    "L40S": 48.0,
    "A10G": 24.0,
    "L4": 24.0,
}


def flops_per_token(n_params: int, n_layer: int, n_head: int, head_dim: int, seq_len: int) -> float:
    """PaLM-style training FLOPs per token: ``6·N + 12·L·H·Q·T``.

    ``n_params`` should exclude the position-embedding table (it does no matrix multiply); the token
    embedding counts because its transpose is the output projection.
    """
    return 6.0 * n_params + 12.0 * n_layer * n_head * head_dim * seq_len


def attention_flops(n_layer: int, n_head: int, head_dim: int, seq_len: int, units: int) -> float:
    """Attention score and value products per token, ``units · 2·L·H·Q·T``: a forward pass is 2 units, training 6."""
    return units * 2.0 * n_layer * n_head * head_dim * seq_len


def lora_flops_per_token(frozen: int, trained: int, n_layer: int, n_head: int, head_dim: int, seq_len: int) -> float:
    """LoRA training FLOPs per token: the ``frozen`` weights cost their forward and input-gradient products only
    (``4·N``), the ``trained`` adapter weights all three (``6·N``), attention as in training."""
    return 4.0 * frozen + 6.0 * trained + attention_flops(n_layer, n_head, head_dim, seq_len, 6)


def distillation_flops_per_token(
    student: float, teacher: int, n_layer: int, n_head: int, head_dim: int, seq_len: int
) -> float:
    """Distillation FLOPs per token: the ``student``'s training FLOPs plus the frozen teacher's forward pass
    (``2·N_teacher`` and its attention; ``n_layer`` … ``head_dim`` are the teacher's)."""
    return student + 2.0 * teacher + attention_flops(n_layer, n_head, head_dim, seq_len, 2)


def _shape(model: torch.nn.Module) -> tuple[int, int, int]:
    config = model.config
    n_head = config.num_attention_heads
    return config.num_hidden_layers, n_head, config.hidden_size // n_head


def matmul_parameters(model: torch.nn.Module, *, trainable: bool | None = None) -> int:
    """Parameters that take part in matrix multiplies: all but GPT-2's position table (a lookup); only the
    trainable or only the frozen ones with ``trainable`` True or False (ZeRO-3 partitioned or not)."""
    return sum(
        getattr(param, "ds_numel", param.numel())
        for name, param in model.named_parameters()
        if not name.endswith("wpe.weight") and (trainable is None or param.requires_grad == trainable)
    )


def model_flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """:func:`flops_per_token` for a Hugging Face GPT-2 or Llama model (ZeRO-3 partitioned or not)."""
    return flops_per_token(matmul_parameters(model), *_shape(model), seq_len)


def lora_model_flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """:func:`lora_flops_per_token` for a PEFT-adapted model: its trainable parameters are the adapters."""
    frozen, trained = matmul_parameters(model, trainable=False), matmul_parameters(model, trainable=True)
    return lora_flops_per_token(frozen, trained, *_shape(model), seq_len)


def distillation_model_flops_per_token(student: torch.nn.Module, teacher: torch.nn.Module, seq_len: int) -> float:
    """:func:`distillation_flops_per_token` for a student and its teacher (whole, or sharded: global shapes)."""
    return distillation_flops_per_token(
        model_flops_per_token(student, seq_len), matmul_parameters(teacher), *_shape(teacher), seq_len
    )


def device_peak_flops(device: torch.device, configured: float | None) -> float | None:
    """Peak FLOP/s of one device: the configured value, else a known GPU's bf16 peak, else None."""
    if configured is not None:
        return configured
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_FLOPS_BF16.items():
        if key in name:
            return peak
    return None


def mfu(tokens_per_sec: float, flops_token: float, peak_flops: float, world_size: int = 1) -> float:
    """Achieved FLOP/s over the peak of all ``world_size`` devices (``tokens_per_sec`` is global)."""
    return tokens_per_sec * flops_token / (peak_flops * world_size)
