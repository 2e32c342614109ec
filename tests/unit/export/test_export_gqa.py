"""A Llama with grouped-query attention and its own MLP width, from pretraining to served KV-cache generation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lmforge.config import ExportConfig, ModelConfig, PretrainConfig, QuantizeConfig, TensorRTConfig, TrainConfig
from lmforge.export import export_onnx, quantize_int8
from lmforge.export.build_tensorrt import graph_inputs, optimization_profiles
from lmforge.export.quantize_int8 import PastWindowReader
from lmforge.model.build import load_causal_lm, load_tokenizer
from lmforge.onnx_runtime import WITH_PAST_FILE, OrtDecoderWithPast
from lmforge.serve.generate import GenerationRequest, generate_batch
from lmforge.train import pretrain

GQA = ModelConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=96, block_size=64)
PROMPTS = [(5, 17, 99, 3), (42,), (7, 7, 7, 7, 7, 7, 7, 8, 9), (300, 301)]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_shards_dir, tiny_tokenizer_dir):
    out = tmp_path_factory.mktemp("gqa") / "model"
    train = TrainConfig(max_steps=4, batch_size=4, seq_len=32, lr=1e-2, warmup_steps=1, precision="fp32",
                        eval_interval=4, eval_batches=1)  # fmt: skip
    config = PretrainConfig(model=GQA, train=train)
    pretrain.run(config, shards=tiny_shards_dir, tokenizer=tiny_tokenizer_dir, model=out)
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory, trained):
    out = tmp_path_factory.mktemp("gqa-export") / "onnx"
    export_onnx.run(ExportConfig(), model=trained, onnx_model=out)
    return out


def _transformers_greedy(model_dir, prompt: tuple[int, ...]) -> list[int]:
    tok = load_tokenizer(model_dir)
    with torch.no_grad():
        ids = load_causal_lm(model_dir).generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=tok.pad_token_id,
        )
    return ids[0, len(prompt) :].tolist()


def test_the_trained_model_has_the_configured_key_value_heads_and_mlp_width(trained):
    config = json.loads((trained / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["intermediate_size"]) == (4, 2, 96)
    k_proj = load_causal_lm(trained).model.layers[0].self_attn.k_proj
    assert tuple(k_proj.weight.shape) == (2 * 16, 64)  # 2 KV heads of head size 16


def test_the_onnx_cache_has_the_key_value_heads_not_the_attention_heads(exported):
    manifest = json.loads((exported / "manifest.json").read_text())
    assert (manifest["with_past"]["kv_heads"], manifest["with_past"]["head_dim"]) == (2, 16)
    assert OrtDecoderWithPast(exported).empty_past(3)[0].shape == (3, 2, 0, 16)


def test_quantize_calibration_feeds_the_cache_graph_its_key_value_heads(exported):
    decoder = OrtDecoderWithPast(exported, threads=1)
    windows = np.arange(5, 5 + 2 * 8, dtype=np.int64).reshape(2, 8)
    (feeds,) = iter(PastWindowReader(windows, decoder).get_next, None)
    assert feeds["past_key_values.0.key"].shape == (2, 2, 4, 16)  # half of each window is the past
    decoder.session.run(None, feeds)


def test_both_int8_models_of_the_grouped_query_export_pass_the_quantize_gate(tmp_path, exported, tiny_shards_dir):
    cfg = QuantizeConfig(calibration_sequences=12, calibration_seq_len=32, gate_eval_tokens=2048)
    result = quantize_int8.run(
        cfg, onnx_model=exported, shards=tiny_shards_dir, int8_dynamic=tmp_path / "dynamic", int8_qdq=tmp_path / "qdq"
    )
    assert (result.metrics["dynamic_accepted"], result.metrics["qdq_accepted"]) == (1.0, 1.0)


def test_tensorrt_profiles_size_the_cache_by_its_key_value_heads(exported):
    cfg = TensorRTConfig()
    profiles = optimization_profiles(cfg, graph_inputs(exported / WITH_PAST_FILE))
    assert profiles["past_key_values.1.value"][2] == (cfg.max_batch, 2, cfg.max_past, 16)


def test_served_greedy_generation_equals_transformers(trained, exported):
    decoder = OrtDecoderWithPast(exported, threads=1)
    requests = [GenerationRequest(prompt, max_tokens=NEW_TOKENS) for prompt in PROMPTS]
    results = generate_batch(decoder, requests, eos_token_id=None, pad_token_id=1)
    expected = [_transformers_greedy(trained, prompt) for prompt in PROMPTS]
    assert [result.token_ids for result in results] == expected
    assert len({tuple(tokens) for tokens in expected}) > 1  # the prompts steer the decoding
