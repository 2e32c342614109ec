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


def model_flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """:func:`flops_per_token` for a Hugging Face GPT-2 or Llama model (ZeRO-3 partitioned or not)."""
    config = model.config
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    for name, param in model.named_parameters():
        if name.endswith("wpe.weight"):  # GPT-2's learned positions: a lookup, no FLOPs
            n_params -= getattr(param, "ds_numel", param.numel())
    n_layer, n_head = config.num_hidden_layers, config.num_attention_heads
    return flops_per_token(n_params, n_layer, n_head, config.hidden_size // n_head, seq_len)


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
