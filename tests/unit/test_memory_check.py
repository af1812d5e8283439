"""recipes/memory_check.py without processes or GPUs: the verdict and the fixes as recipe flags
for the paper's run on GPUs of a given size, and the check skipped off CUDA or with ``off``
(the CLI: tests/unit/test_memory_model.py; on a GPU: tests/gpu/test_cuda.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fl_accel import FLConfig
from fl_accel.planning.units import LLAMA_3_1_8B
from recipes.args import RecipeError
from recipes.memory_check import check_memory, fix_flags, judge, settings

GIB = 2**30
ARGS = SimpleNamespace(seq_len=2048, micro_batch_size=2, reduce_dtype="fp32", gradient_accumulation_steps=1,
                       memory_check="refuse")
PAPER = FLConfig(algorithm="fl_fsdp", num_groups=128)


def test_the_paper_run_fits_80_gib_and_not_40_where_the_fixes_are_recipe_flags():
    kw = settings(ARGS, "bf16", activation_checkpointing=False)
    assert judge(LLAMA_3_1_8B, PAPER, 512, 80 * GIB, kw)[0] == "fits"
    answer, text = judge(LLAMA_3_1_8B, PAPER, 512, 40 * GIB, kw)
    # fused AdamW (the recipe's on CUDA): checkpointing alone is enough; or 4x larger groups
    assert answer == "does not fit" and "it fits with --activation_checkpointing full (" in text, text
    assert "; or --num_groups 8 (" in text and "--memory_check warn" in text
    assert fix_flags({"micro_batch": 1, "gradient_accumulation_steps": 2}, 512) == \
        "--micro_batch_size 1 --gradient_accumulation_steps 2"
    assert fix_flags({"shards": 8}, 512) == "--hsdp_shard_size 8"


def test_a_fix_to_one_group_says_it_is_no_federation():
    """2 groups of 4 on 40 GiB: the fix with groups of 8 is ``--num_groups 1``, said to be no federation."""
    kw = settings(ARGS, "bf16", activation_checkpointing=False)
    answer, text = judge(LLAMA_3_1_8B, FLConfig(algorithm="fl_fsdp", num_groups=2), 8, 40 * GIB, kw)
    assert answer == "does not fit" and "--num_groups 1 (" in text, text
    assert all("GiB; one group: no federation)" in part for part in text.split("; or ") if "--num_groups 1" in part)
    assert "no federation" not in judge(LLAMA_3_1_8B, PAPER, 512, 40 * GIB, kw)[1]


def test_off_cuda_or_off_nothing_is_checked():
    cpu = SimpleNamespace(device=SimpleNamespace(type="cpu"))
    check_memory(cpu, ARGS, LLAMA_3_1_8B, "bf16", False)  # no GPU memory to exceed: returns, no collective
    cuda = SimpleNamespace(device=SimpleNamespace(type="cuda"))
    check_memory(cuda, SimpleNamespace(**{**vars(ARGS), "memory_check": "off"}), LLAMA_3_1_8B, "bf16", False)


def test_a_refusal_is_a_recipe_error(monkeypatch):
    """The refusal path with the GPU query replaced (no CUDA here): RecipeError naming the fix."""
    import recipes.memory_check as mc

    acc = SimpleNamespace(device=SimpleNamespace(type="cuda"), fl_config=PAPER,
                          layout=SimpleNamespace(world_size=512), is_main_process=True)
    monkeypatch.setattr(mc, "_gpu_memory", lambda accelerator: 40.0 * GIB)
    with pytest.raises(RecipeError, match="does not fit; it fits with"):
        check_memory(acc, ARGS, LLAMA_3_1_8B, "bf16", False)
    with pytest.warns(UserWarning, match="does not fit"):
        check_memory(acc, SimpleNamespace(**{**vars(ARGS), "memory_check": "warn"}), LLAMA_3_1_8B, "bf16", False)
