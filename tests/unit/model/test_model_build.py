"""``build_model``: Hugging Face's initialization, with values that depend on the seed and nothing else."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.initialization import no_init_weights

from lmforge.config import ModelConfig
from lmforge.model.build import _module_seed, build_model, hf_config, seeded_init

VOCAB, EOS, PAD = 300, 0, 1
SHAPES = {arch: ModelConfig(arch=arch, n_layer=2, n_head=2, n_embd=32, block_size=64) for arch in ("gpt2", "llama")}


def _build(arch: str, seed: int = 3) -> torch.nn.Module:
    return build_model(SHAPES[arch], VOCAB, eos_id=EOS, pad_id=PAD, seed=seed)


def _constructed(arch: str, **kwargs) -> torch.nn.Module:
    config = hf_config(SHAPES[arch], VOCAB, eos_id=EOS, pad_id=PAD)
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config, **kwargs)


def _assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    expected = a.state_dict()
    for key, value in b.state_dict().items():
        assert torch.equal(value, expected[key].to(value.dtype)), key


@pytest.mark.parametrize("arch", SHAPES)
def test_weights_do_not_depend_on_what_construction_drew_from_the_global_rng(arch):
    # zero.Init builds without torch's default initializers (no draws); one process runs them first
    torch.manual_seed(12345)
    with no_init_weights():
        bare = _constructed(arch)
    bare.tie_weights()
    seeded_init(bare, 3)
    _assert_same(_build(arch), bare)


@pytest.mark.parametrize("arch", SHAPES)
def test_bf16_parameters_get_the_fp32_draws_rounded(arch):
    # zero.Init with bf16 creates bf16 parameters; their values must be the fp32 model's, rounded
    half = _constructed(arch, dtype=torch.bfloat16)
    seeded_init(half, 3)
    _assert_same(_build(arch), half)


@pytest.mark.parametrize("arch", SHAPES)
def test_initial_loss_is_about_ln_vocab_and_embeddings_stay_tied(arch):
    model = _build(arch)
    ids = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
    assert abs(model(input_ids=ids, labels=ids).loss.item() - math.log(VOCAB)) < 0.1
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_gpt2_keeps_the_depth_scaled_projection_init_and_the_tie_takes_the_embedding_draw():
    model = _build("gpt2")
    block = model.transformer.h[1]
    assert block.mlp.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
    for proj in (block.attn.c_proj, block.mlp.c_proj):  # N(0, 0.02 / sqrt(2 * n_layer))
        assert proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(4), rel=0.08)
    assert torch.equal(block.ln_1.weight, torch.ones(32)) and torch.equal(block.attn.c_attn.bias, torch.zeros(96))
    wte = model.transformer.wte.weight
    drawn = torch.empty_like(wte)
    torch.manual_seed(_module_seed(3, "transformer.wte"))
    torch.nn.init.normal_(drawn, std=0.02)
    assert torch.equal(wte, drawn)  # not lm_head's draw: lm_head.weight is a tied copy of wte


def test_llama_zeroes_the_padding_embedding():
    model = _build("llama")
    assert torch.count_nonzero(model.model.embed_tokens.weight[PAD]) == 0
    assert torch.count_nonzero(model.model.embed_tokens.weight[EOS]) == 32


def test_seed_selects_the_weights_and_the_global_rng_is_left_seeded():
    a = _build("gpt2", seed=3)
    after = torch.rand(4)
    torch.manual_seed(3)
    assert torch.equal(after, torch.rand(4))
    b = _build("gpt2", seed=4)
    assert not torch.equal(a.transformer.wte.weight, b.transformer.wte.weight)


_SAVE_IN_A_FRESH_PROCESS = """
import sys
from transformers import AutoTokenizer
from lmforge.config import ModelConfig
from lmforge.model.build import build_model, save_model_dir
tok = AutoTokenizer.from_pretrained(sys.argv[1])
cfg = ModelConfig(arch="gpt2", n_layer=1, n_head=2, n_embd=16, block_size=32)
model = build_model(cfg, len(tok), eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, seed=0)
save_model_dir(model, tok, sys.argv[2])
print("deepspeed" in sys.modules)
from accelerate.utils import other
import deepspeed
print(other.is_deepspeed_available())
"""


def test_saving_a_model_does_not_import_deepspeed_until_a_stage_uses_it(tmp_path, tiny_tokenizer_dir):
    """accelerate's unwrap in save_pretrained imports DeepSpeed (2.5 s per stage) to test isinstance only."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: nothing to keep from importing")
    pytest.importorskip("accelerate", reason="accelerate is not installed: save_pretrained does not unwrap with it")
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _SAVE_IN_A_FRESH_PROCESS, str(tiny_tokenizer_dir), str(tmp_path / "model")],
        capture_output=True,
        text=True,
        timeout=300,
    )

    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()  # DeepSpeed prints a warning on stdout when imported
    assert lines[0] == "False", "save_pretrained imported DeepSpeed"
    assert lines[-1] == "True", "once imported, accelerate's own check applies again"
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "model").config.n_layer == 1


@pytest.mark.parametrize("arch", SHAPES)
def test_unset_kv_heads_mlp_width_and_rope_base_build_the_config_as_before(arch):
    config = hf_config(SHAPES[arch], VOCAB, eos_id=EOS, pad_id=PAD)
    if arch == "gpt2":
        assert config.n_inner is None  # GPT-2's own 4 × n_embd
        return
    explicit = SHAPES[arch].model_copy(update={"n_kv_head": 2, "intermediate_size": 128, "rope_theta": 10000.0})
    assert config.to_json_string() == hf_config(explicit, VOCAB, eos_id=EOS, pad_id=PAD).to_json_string()
    assert (config.num_key_value_heads, config.intermediate_size) == (2, 4 * 32)


def test_grouped_query_llama_shares_each_key_value_head_among_query_heads():
    shape = ModelConfig(arch="llama", n_layer=1, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=48, block_size=64)
    model = build_model(shape, VOCAB, eos_id=EOS, pad_id=PAD, seed=3)
    layer = model.model.layers[0]
    assert tuple(layer.self_attn.k_proj.weight.shape) == tuple(layer.self_attn.v_proj.weight.shape) == (2 * 8, 32)
    assert tuple(layer.mlp.up_proj.weight.shape) == (48, 32)
    assert model.config.rope_parameters["rope_theta"] == 10000.0


def test_gpt2_takes_an_mlp_width():
    shape = SHAPES["gpt2"].model_copy(update={"intermediate_size": 48})
    model = build_model(shape, VOCAB, eos_id=EOS, pad_id=PAD, seed=3)
    assert tuple(model.transformer.h[0].mlp.c_fc.weight.shape) == (32, 48)
