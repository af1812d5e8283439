"""fl_accel.memory_model: model FLOPs per token (torchtitan's formula) and MFU."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fl_accel import cost_model as cm
from fl_accel import memory_model as mm


def test_llama_3_1_8b_at_2048_is_48_25_gflop_per_token():
    flops = mm.model_flops_per_token(cm.LLAMA_3_1_8B, 2048)
    # 6 x (8,030,261,248 - 128,256 x 4,096) + 12 x 32 layers x 32 heads x 128 x 2048
    assert flops == 6 * (8_030_261_248 - 128_256 * 4_096) + 12 * 32 * 32 * 128 * 2048
    assert flops / 1e9 == pytest.approx(48.25, abs=0.01)


@pytest.mark.parametrize("tied", [False, True])
def test_counts_a_real_model_and_tied_lm_head_costs_the_same(tied):
    cfg = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    n = sum(p.numel() for p in model.parameters())  # a tied weight once
    from_config = mm.model_flops_per_token(cfg, 128)
    assert mm.model_flops_per_token(cfg, 128, num_params=n) == from_config
    non_embedding = n - 1000 * 64 + (1000 * 64 if tied else 0)  # lm_head is a matmul either way
    assert from_config == 6 * non_embedding + 12 * 3 * 4 * 16 * 128


def test_peak_table_and_mfu():
    assert mm.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert mm.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert mm.peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert mm.peak_tflops("NVIDIA H200") == 989.0
    assert mm.peak_tflops("cpu") is None and mm.peak_tflops(None) is None
    # torchtitan's published Llama-3.1-8B eager figure: 5,762 tokens/s/GPU at seq 8192 on H100 = 33.7% MFU
    flops = mm.model_flops_per_token(cm.LLAMA_3_1_8B, 8192)
    assert mm.mfu(flops, 5762, 989.0) == pytest.approx(0.337, abs=0.003)
    assert mm.mfu(flops, 5762, None) is None


def test_bad_values_name_the_field():
    with pytest.raises(ValueError, match="seq_len"):
        mm.model_flops_per_token(cm.LLAMA_3_1_8B, 0)
    with pytest.raises(ValueError, match="num_attention_heads"):
        mm.model_flops_per_token({**cm.LLAMA_3_1_8B, "num_attention_heads": None}, 16)
