"""Compute per token and the accelerator's peak: what model FLOPs utilization (MFU) is.

Model FLOPs per token follow torchtitan (``models/utils.py`` ``get_nparams_and_flops``;
PaLM, Chowdhery et al. 2022, App. B): a dense matmul costs 6 FLOPs per parameter per
token in forward + backward, and causal self-attention adds 12 L h d_head T (scores and
values, forward + backward, over a sequence of T tokens)::

    flops_per_token = 6 (N - N_emb) + 12 L h d_head T

N counts every parameter once; N_emb is the input embedding, a lookup and not a
matmul. The output projection (lm_head) is a matmul and counts; when it is tied to the
input embedding it is absent from N - N_emb, so it is added back: the count is the same
for a tied and an untied model of one shape. Llama-3.1-8B at T = 2048: 48.25 GFLOP per
token.

MFU = flops_per_token x tokens/s per process / peak FLOPS of one device (dense bf16,
no sparsity), as torchtitan reports it. The recipe reports it (recipes/metrics.py).
"""

from __future__ import annotations

from typing import Any

from fl_accel.planning.cost import _int
from fl_accel.planning.units import config_value, llama_units

PEAK_BF16_TFLOPS = {
    # dense bf16 tensor-core peaks from the vendors' data sheets (as torchtitan's
    # ``get_peak_flops``); the first key contained in the device name wins.
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,  # SXM (and NVL per GPU)
    "A100": 312.0,
    "L40S": 362.0,
    "A10G": 70.0,
}
"""Dense bf16 peak TFLOPS (1e12 FLOP/s) per device, by a substring of its name."""


def peak_tflops(device_name: str | None) -> float | None:
    """Dense bf16 peak of a device, in TFLOPS (1e12 FLOP/s), from its name.

    Args:
        device_name: ``torch.cuda.get_device_name()``, e.g. "NVIDIA H100 80GB HBM3"; None or
            "" for none.

    Returns:
        The first :data:`PEAK_BF16_TFLOPS` value whose key the name contains, or None when
        the name is unknown (e.g. a CPU). Never raises.
    """
    if not device_name:
        return None
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in device_name:
            return value
    return None


def model_flops_per_token(config: Any, seq_len: int, num_params: int | None = None,
                          embedding_params: int | None = None) -> float:
    """Training FLOPs per token (forward + backward) of a decoder-only transformer.

    Args:
        config: a ``transformers`` config (or a mapping of its fields): ``vocab_size``,
            ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``, optional
            ``head_dim`` (default hidden / heads), ``tie_word_embeddings``.
        seq_len: T, tokens per sequence.
        num_params: N, the model's parameters counted once (a tied weight once);
            default: counted by :func:`fl_accel.planning.units.llama_units` from a
            Llama-shaped config (then ``intermediate_size`` is needed too).
        embedding_params: N_emb, the input embedding's parameters; default vocab x hidden.

    Returns:
        FLOPs per token, ``6 (N - N_emb + tied lm_head) + 12 L h d_head T``.

    Raises:
        ValueError: a missing or non-positive field, or ``seq_len < 1``.
    """
    T = _int("seq_len", seq_len)
    V, H, L, h = (_int(f"config.{k}", config_value(config, k)) for k in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"))
    d_head = _int("config.head_dim", config_value(config, "head_dim", H // h))
    if num_params is None:
        num_params = sum(u.numel for u in llama_units(config))
    n_emb = V * H if embedding_params is None else embedding_params
    matmul = num_params - n_emb + (V * H if config_value(config, "tie_word_embeddings", False) else 0)
    return 6.0 * matmul + 12.0 * L * h * d_head * T


def mfu(flops_per_token: float, tokens_per_s_per_process: float, peak: float | None) -> float | None:
    """Model FLOPs utilization of one process, a fraction in [0, 1] when the peak is right.

    Args:
        flops_per_token: :func:`model_flops_per_token` (FLOPs).
        tokens_per_s_per_process: training tokens per second of one process.
        peak: its device's peak in TFLOPS (:func:`peak_tflops`); None or 0 when unknown.

    Returns:
        achieved FLOP/s / (``peak`` x 1e12), or None when the peak is unknown. Never raises.
    """
    if not peak:
        return None
    return flops_per_token * tokens_per_s_per_process / (peak * 1e12)
