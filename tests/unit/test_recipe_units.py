"""The recipe's pure-Python parts, in-process: its shape, argument and launcher checks, model
checks, the accounting of figures, the banner and the test hooks.

Everything here runs before (or without) a process group, so no launch is needed: a bad
input that these functions reject is rejected identically on every rank before any
collective. Launched runs (tests/recipe/test_recipe*.py) check the same code end to end.
"""

from __future__ import annotations

import ast
import json
import os
from types import SimpleNamespace

import pytest
import torch

from _launch import REPO_ROOT
from fl_accel import FLConfig
from fl_accel.mesh import FLLayout
from recipes import banner, metrics, testing_hooks
from recipes.args import RecipeError, parse_args
from recipes.modeling import build_optimizer, resolve_config
from recipes.run_folder import check_launcher, plan_run, resolve_activation_checkpointing, resolve_compile, \
    resolve_mixed_precision

ENV = {"WORLD_SIZE": "4"}


# =========================================================================== shape (issue 19 item 8)
def _function(tree, name):
    return next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)


def test_main_and_training_loop_are_short_and_hook_free():
    """main() <= 150 lines, the training loop's body <= 30 (run_clm_no_trainer's shape), and
    no test hook in the loop: fault injection and block recording are callbacks that
    recipes/testing_hooks.py installs from FL_ACCEL_TEST_* variables."""
    source = (REPO_ROOT / "recipes" / "pretrain.py").read_text()
    tree = ast.parse(source)
    main = _function(tree, "main")
    assert main.end_lineno - main.lineno + 1 <= 150
    loops = [n for n in ast.walk(tree) if isinstance(n, ast.For) and isinstance(n.iter, ast.Attribute)
             and n.iter.attr == "batches"]
    assert len(loops) == 1
    body = loops[0].body
    assert body[-1].end_lineno - body[0].lineno + 1 <= 30
    loop_text = ast.get_source_segment(source, loops[0])
    for word in ("FAULT", "Fault", "fault", "RECORD", "Recorder", "recorder", "environ"):
        assert word not in loop_text, word
    assert testing_hooks.FAULT_ENV == "FL_ACCEL_TEST_FAULT_INJECT"
    assert testing_hooks.RECORD_ENV == "FL_ACCEL_TEST_RECORD_BLOCKS"
    assert "FL_FAULT_INJECT" not in source and "FL_RECORD_BLOCKS" not in source


def test_each_concern_lives_in_one_named_module():
    """Data, the run folder and preflight, and the accounting of figures each have one module."""
    from recipes import inputs, run_folder

    assert callable(inputs.build_data) and callable(run_folder.preflight) and callable(run_folder.save_checkpoint)
    assert callable(metrics.Meter) and callable(metrics.Clock)
    source = (REPO_ROOT / "recipes" / "pretrain.py").read_text()
    for name in ("\ndef preflight", "\ndef build_data", "\ndef evaluate(", "tokenize_and_pack_cached"):
        assert name not in source, name


def test_every_bad_yaml_key_is_reported_at_once_with_did_you_mean(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("max_step: 3\nlr: 0.1\nsync_every: 4\nfl:\n  num_group: 2\n  seq_len: 64\n")
    with pytest.raises(RecipeError) as err:
        parse_args(["--config", str(cfg)], environ={})
    text = str(err.value)
    assert text.startswith(f"5 bad keys in --config {cfg}")
    for part in ("unknown key 'max_step' (did you mean 'max_steps'?)",
                 "unknown key 'lr' (did you mean 'learning_rate'?)",
                 "key 'sync_every' is an FLConfig field: it belongs under 'fl:'",
                 "unknown FLConfig field 'num_group' under 'fl:' (did you mean 'num_groups'?)",
                 "key 'seq_len' under 'fl:' is a recipe option: put it at the top level"):
        assert part in text, part


def test_every_bad_yaml_key_and_value_is_reported_in_one_error(tmp_path):
    """Bad keys and bad values (type or range, top level and under 'fl:') in one ValueError naming the
    file; a value that only conflicts with another field's default is no problem of the file."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text("max_step: 3\nseq_len: 0\nmicro_batch_size: four\nfl:\n  num_groups: '2'\n  num_fragments: 3\n")
    with pytest.raises(ValueError) as err:
        parse_args(["--config", str(cfg)], environ={})
    text = str(err.value)
    assert text.startswith(f"1 bad key and 3 bad values in --config {cfg}: unknown key 'max_step'"), text
    for part in ("seq_len must be >= 1, got 0", "micro_batch_size must be an integer, got 'four' (str)",
                 "FLConfig.num_groups must be an integer, got '2' (str)"):
        assert part in text, part
    assert "num_fragments" not in text  # 3 does not divide the default sync_every 8: the merge's business
    cfg.write_text("streaming: true\nfl:\n  num_fragments: 4\n")  # max_steps and sync_every from flag and env
    parsed = parse_args(["--config", str(cfg), "--max_steps", "5"], environ={"FL_ACCEL_SYNC_EVERY": "4"})
    assert parsed.args.streaming and parsed.fl.num_fragments == 4


@pytest.mark.parametrize("how", ["flag", "env", "yaml"])
def test_a_bad_merged_value_names_the_source_that_set_it(tmp_path, how):
    """num_fragments 3 against sync_every 8 from a --config file: the error names where each value was
    set (the flag, the variable or the file), not "check --config" whatever the source; the same for
    a range error and for a layout error found by plan_run."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text("fl:\n  sync_every: 8\n" + ("  num_fragments: 3\n" if how == "yaml" else ""))
    argv, env = ["--config", str(cfg)], {}
    if how == "flag":
        argv += ["--num_fragments", "3"]
    elif how == "env":
        env["FL_ACCEL_NUM_FRAGMENTS"] = "3"
    with pytest.raises(ValueError) as err:
        parse_args(argv, environ=env)
    where = {"flag": "--num_fragments", "env": "FL_ACCEL_NUM_FRAGMENTS", "yaml": f"num_fragments under 'fl:' in {cfg}"}
    text = str(err.value)
    assert "must be a multiple of FLConfig.num_fragments=3" in text and where[how] in text, text
    assert f"sync_every under 'fl:' in {cfg}" in text and "check --config" not in text
    with pytest.raises(ValueError, match=r"num_groups must be >= 1, got 0 \(values from FL_ACCEL_NUM_GROUPS\)"):
        parse_args(["--config", str(cfg)], environ={"FL_ACCEL_NUM_GROUPS": "0"})
    cfg.write_text("fl:\n  num_groups: 3\n")
    with pytest.raises(ValueError, match=f"does not divide the world size 4.*values from num_groups under 'fl:' in {cfg}"):
        plan_run(["--config", str(cfg), "--output_dir", str(tmp_path / "out")], environ=ENV)


def test_unknown_flag_and_environment_variable_say_did_you_mean():
    """A misspelt --flag or FL_ACCEL_* variable is still refused (RecipeError), now with the
    closest known name."""
    with pytest.raises(RecipeError) as err:
        parse_args(["--num_fragmnts", "2", "--sync_evry=4"], environ={})
    text = str(err.value)
    assert ("unrecognized arguments: --num_fragmnts 2 --sync_evry=4; --num_fragmnts (did you mean --num_fragments?), "
            "--sync_evry (did you mean --sync_every?)") in text
    with pytest.raises(RecipeError, match=r"unrecognized arguments: --num_frag 3; --num_frag \(did you mean --num_fragments\?\)"):
        parse_args(["--num_frag", "3"], environ={})  # no prefix matching: argparse would take it silently
    with pytest.raises(RecipeError) as err:
        parse_args([], environ={"FL_ACCEL_NUM_FRAGMNTS": "2"})
    assert "unknown environment variable FL_ACCEL_NUM_FRAGMNTS (did you mean FL_ACCEL_NUM_FRAGMENTS?)" in str(err.value)
    with pytest.raises(RecipeError, match=r"variable FL_ACCEL_ZZZ; known: \['FL_ACCEL_ALGORITHM'"):
        parse_args([], environ={"FL_ACCEL_ZZZ": "1"})  # nothing close: no guess


@pytest.mark.parametrize("how", ["flag", "env", "yaml"])
def test_group_sizes_are_checked_against_the_world_first(tmp_path, how):
    """--group_sizes 1,2 on 4 ranks: the sum is the first thing said (not "unequal groups need
    fl_hsdp", whose advice would still fail), naming where the sizes were set."""
    argv, env = [], dict(ENV)
    if how == "flag":
        argv = ["--group_sizes", "1,2"]
    elif how == "env":
        env["FL_ACCEL_GROUP_SIZES"] = "1,2"
    else:
        (tmp_path / "r.yaml").write_text("fl:\n  group_sizes: [1, 2]\n")
        argv = ["--config", str(tmp_path / "r.yaml")]
    with pytest.raises(RecipeError, match="sums to 3 ranks, but 4 were launched") as err:
        parse_args(argv, environ=env)
    where = {"flag": "--group_sizes 1,2", "env": "FL_ACCEL_GROUP_SIZES 1,2",
             "yaml": f"group_sizes under 'fl:' in {tmp_path / 'r.yaml'} 1,2"}[how]
    assert str(err.value).startswith(where)


def test_new_flags_parse_and_check_their_values():
    parsed = parse_args(["--activation_checkpointing", "full", "--compile", "--reduce_dtype", "bf16",
                         "--peak_tflops", "989"], environ={})
    args = parsed.args
    assert (args.activation_checkpointing, args.compile, args.reduce_dtype, args.peak_tflops) == \
        ("full", True, "bf16", 989.0)
    assert parse_args([], environ={}).args.activation_checkpointing is None
    with pytest.raises(RecipeError, match="invalid choice: 'half'"):
        parse_args(["--activation_checkpointing", "half"], environ={})
    with pytest.raises(RecipeError, match="--peak_tflops must be > 0"):
        parse_args(["--peak_tflops", "0"], environ={})


def test_test_hook_variables_are_not_flconfig_fields():
    parsed = parse_args([], environ={"FL_ACCEL_TEST_FAULT_INJECT": "kill:1:2", "FL_ACCEL_TEST_RECORD_BLOCKS": "/x"})
    assert parsed.sources == {}


def test_default_run_name_has_no_h_for_fsdp_and_hsdp(tmp_path):
    """H (sync_every) means nothing without a federation: fsdp-F1-G4-S4, not ...-H0."""
    def name(*argv):
        return plan_run([*argv, "--output_dir", str(tmp_path / "out")], environ=ENV).run_name

    assert name("--algorithm", "fsdp") == "fsdp-F1-G4-S4"
    assert name("--algorithm", "hsdp", "--hsdp_shard_size", "2") == "hsdp-F1-G4-S2"
    assert name("--algorithm", "fl_fsdp", "--num_groups", "2", "--sync_every", "8") == "fl_fsdp-F2-G2-S2-H8"


# =========================================================================== launcher settings (issue 18 items 2, 3)
def test_fsdp_version_1_is_one_line_naming_fsdp2(tmp_path):
    with pytest.raises(RecipeError) as err:
        plan_run(["--output_dir", str(tmp_path)], environ={**ENV, "FSDP_VERSION": "1", "ACCELERATE_USE_FSDP": "true"})
    text = str(err.value)
    assert "fl_accel needs FSDP2" in text and "fsdp_version: 2" in text and "FSDP_VERSION=1" in text
    assert "\n" not in text


def test_fp16_from_the_accelerate_config_names_the_config_key():
    """Refused by the launcher check, which planning runs first (before it imports torch), and
    by resolve_mixed_precision, with the same message."""
    env = {"ACCELERATE_MIXED_PRECISION": "fp16"}
    texts = []
    for check in (lambda: check_launcher(env), lambda: resolve_mixed_precision("auto", env)):
        with pytest.raises(RecipeError) as err:
            check()
        texts.append(str(err.value))
    text = texts[0]
    assert texts[1] == text
    assert "does not support fp16" in text and "its config's mixed_precision" in text
    assert "ACCELERATE_MIXED_PRECISION=fp16" in text
    check_launcher({"ACCELERATE_MIXED_PRECISION": "bf16"})


def test_whole_model_compile_from_the_accelerate_config_is_refused():
    with pytest.raises(RecipeError, match="dynamo_use_regional_compilation: true"):
        check_launcher({"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR",
                        "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "False"})
    check_launcher({"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR", "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "True"})
    check_launcher({"ACCELERATE_DYNAMO_BACKEND": "NO", "FSDP_VERSION": "2"})


def test_activation_checkpointing_and_compile_follow_the_accelerate_config_unless_a_flag_says():
    args = parse_args([], environ={}).args
    assert resolve_activation_checkpointing(args, {}) == (False, "default")
    assert resolve_activation_checkpointing(args, {"FSDP_ACTIVATION_CHECKPOINTING": "true"}) == \
        (True, "fsdp_activation_checkpointing in the Accelerate config")
    args = parse_args(["--activation_checkpointing", "none"], environ={}).args
    assert resolve_activation_checkpointing(args, {"FSDP_ACTIVATION_CHECKPOINTING": "true"}) == \
        (False, "--activation_checkpointing")
    assert resolve_compile(parse_args(["--compile"], environ={}).args, {}) == (True, "--compile")
    assert resolve_compile(args, {"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR"})[0] is True


# =========================================================================== models (issue 18 item 1, issue 17 item 8)
def _config_dir(tmp_path, name, config):
    path = tmp_path / name
    config.save_pretrained(path)
    return str(path)


def test_a_model_vocabulary_other_than_the_tokenizers_is_an_error_or_an_explicit_resize(tmp_path):
    from transformers import MistralConfig

    model = _config_dir(tmp_path, "mistral", MistralConfig(vocab_size=32000, hidden_size=64, intermediate_size=128,
                                                           num_hidden_layers=2, num_attention_heads=4,
                                                           num_key_value_heads=2))
    with pytest.raises(RecipeError) as err:
        resolve_config(model, 64, 8192)
    assert "vocab_size is 32000 but the tokenizer has 8192 tokens" in str(err.value)
    assert "--resize_vocab" in str(err.value)
    config, note = resolve_config(model, 64, 8192, resize_vocab=True)
    assert config.vocab_size == 8192 and note == "resized from the model config's 32000 to the tokenizer's 8192 " \
                                                 "(--resize_vocab)"
    config, note = resolve_config(model, 64, 31900)  # 100 padding rows: < 1% of the model's vocabulary
    assert config.vocab_size == 32000 and note == "32000 rows for the tokenizer's 31900 tokens (100 padding rows)"
    assert resolve_config(model, 64, 32000) == (resolve_config(model, 64, 32000)[0], "")
    with pytest.raises(RecipeError, match="vocab_size is 128256 but the tokenizer has 8192"):
        resolve_config("llama3.2-1b", 64, 8192)


def test_unsupported_models_get_one_line(tmp_path):
    """A config that is not a causal LM's (ViT), and a causal LM class that declares no
    ``_no_split_modules`` (BERT as a decoder): one line each, before any data work."""
    from transformers import BertConfig, ViTConfig

    vit = _config_dir(tmp_path, "vit", ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                 intermediate_size=64))
    bert = _config_dir(tmp_path, "bert", BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                    intermediate_size=64))
    for model, expected in ((vit, "is a ViTConfig (vit), not a causal language model"),
                            (bert, "BertLMHeadModel declares no _no_split_modules")):
        with pytest.raises(RecipeError) as err:
            plan_run(["--model", model, "--algorithm", "fsdp", "--output_dir", str(tmp_path / "o")], environ={})
        assert expected in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(RecipeError, match="neither a preset"):
        plan_run(["--model", str(tmp_path / "nope"), "--algorithm", "fsdp", "--output_dir", str(tmp_path / "o")],
                 environ={})


def test_qwen2_and_mistral_configs_pass_the_checks(tmp_path):
    from transformers import MistralConfig, Qwen2Config

    for name, cls in (("qwen2", Qwen2Config), ("mistral", MistralConfig)):
        model = _config_dir(tmp_path, name, cls(vocab_size=8192, hidden_size=64, intermediate_size=128,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                max_position_embeddings=256))
        plan = plan_run(["--model", model, "--algorithm", "fsdp", "--output_dir", str(tmp_path / name)], environ={})
        assert plan.args.model == model
        with pytest.raises(RecipeError, match="max_position_embeddings 256"):
            plan_run(["--model", model, "--algorithm", "fsdp", "--seq_len", "512", "--output_dir",
                      str(tmp_path / name)], environ={})


def test_adamw_is_fused_on_cuda_only():
    with torch.device("meta"):
        model = torch.nn.Linear(4, 4)
    args = parse_args([], environ={}).args
    cuda = build_optimizer(model, args, "cuda")
    cpu = build_optimizer(model, args, "cpu")
    assert cuda.defaults["fused"] is True and not cpu.defaults["fused"]
    assert cuda.defaults["lr"] == args.learning_rate and cuda.defaults["betas"] == (0.9, 0.95)


# =========================================================================== figures (issue 18 item 4, issue 17 item 4)
def test_time_parts_add_up_to_the_wall_time():
    import time

    clock = metrics.Clock(time.perf_counter(), {"startup_seconds": 1.0, "train_seconds": 2.0,
                                                "eval_and_checkpoint_seconds": 3.0, "wall_seconds": 6.0})
    clock.start_training()
    clock.tick("train_seconds")
    clock.tick("eval_and_checkpoint_seconds")
    totals = clock.totals()
    assert totals["wall_seconds"] == pytest.approx(totals["startup_seconds"] + totals["train_seconds"]
                                                   + totals["eval_and_checkpoint_seconds"], rel=1e-12)
    assert totals["train_seconds"] >= 2.0 and totals["wall_seconds"] >= 6.0


def test_traffic_covers_every_group_not_rank_0_alone():
    """Unequal groups [2, 4] with S=2: group 0 has one replica (no dp_replicate traffic),
    group 1 two (an all-reduce every step). Rank 0's view was 0; the run's figures give the
    busiest rank, the sum over ranks and each group's busiest rank."""
    layout = FLLayout.from_config(FLConfig(algorithm="fl_hsdp", group_sizes=[2, 4], hsdp_shard_size=2), 6)
    buckets = ("fl", "dp_replicate", "dp_shard", "world")
    rows = []
    for rank in range(6):
        replicate = 0.0 if layout.group_of(rank) == 0 else 1000.0
        rows.append([500.0 + rank, -1.0, 0.1 * rank, 0.01 * rank,
                     64.0, 2, 0.01, replicate, 3 if replicate else 0, 0.02, 200.0, 6, 0.03, 8.0, 1, 0.0])
    run = metrics.aggregate(rows, layout, buckets)
    assert run["comm"]["dp_replicate"]["bytes"] == 1000 and run["comm_sum"]["dp_replicate"]["bytes"] == 4000
    assert [g["dp_replicate"]["bytes"] for g in run["comm_by_group"]] == [0, 1000]
    assert run["comm"]["dp_replicate"]["calls"] == 3 and run["comm_sum"]["dp_shard"]["calls"] == 36
    assert run["host_mb"] == 505.0 and run["accelerator_mb"] is None
    assert run["sync_wait_seconds"] == pytest.approx(0.5)
    assert run["sync_arrival_by_group"] == [pytest.approx(0.01), pytest.approx(0.05)]  # the busiest rank of each


def test_evaluations_say_what_they_scored():
    assert metrics.scored(FLConfig(algorithm="fsdp"), final=False) == "single group"
    assert metrics.scored(FLConfig(), final=False) == "synchronized"
    fragments = FLConfig(num_fragments=2, sync_every=8)
    assert metrics.scored(fragments, final=False) == "own group per rank"
    assert metrics.scored(fragments, final=True) == "synchronized"
    assert metrics.scored(FLConfig(fragment_update_alpha=0.5), final=False) == "own group per rank"
    assert metrics.scored(FLConfig(num_groups=2), final=True, groups_in_last_sync=2) == "synchronized"
    assert metrics.scored(FLConfig(num_groups=2), final=True, groups_in_last_sync=1) == "own group"  # torchft quorum of 1
    assert set(metrics.SCORED) == {"synchronized", "single group", "own group per rank", "own group"}


def test_model_flops_through_the_recipe_match_the_formula_for_an_untied_llama():
    """6 (N - N_emb) + 12 L h d_head T, N counted from the recipe's own model."""
    from fl_accel.planning.flops import model_flops_per_token
    from recipes.modeling import build_model, embedding_params, model_config

    config = model_config("tiny", 256, 8192)
    model = build_model(config, "meta")
    n = sum(p.numel() for p in model.parameters())
    by_hand = 6 * (n - 8192 * 128) + 12 * 4 * 4 * 32 * 256
    assert model_flops_per_token(config, 256, num_params=n, embedding_params=embedding_params(model)) == \
        pytest.approx(by_hand, rel=1e-2)


# =========================================================================== banner (issue 18 item 5)
def test_banner_marks_ignored_settings_explains_letters_and_shows_weights(tmp_path):
    (tmp_path / "b.yaml").write_text("fl:\n  algorithm: fsdp\n  num_groups: 2\n  sync_every: 8\n")
    parsed = parse_args(["--config", str(tmp_path / "b.yaml")], environ={})
    line = banner.fl_line(parsed)
    assert f"num_groups=2 ({tmp_path / 'b.yaml'}; ignored by fsdp)" in line  # the default value, still marked
    assert f"sync_every=8 ({tmp_path / 'b.yaml'}; ignored by fsdp)" in line
    assert f"algorithm='fsdp' ({tmp_path / 'b.yaml'})" in line
    assert "F federation groups of G ranks" in banner.LETTERS and "a block is seq_len tokens" in banner.LETTERS
    for letter in ("R replicas", "S shards", "H optimizer steps", "P fragments"):
        assert letter in banner.LETTERS
    assert metrics.weights_text([1 / 3, 2 / 3]) == "1/3, 2/3"
    assert metrics.weights_text([0.5, 0.5]) == "1/2, 1/2"
    assert FLConfig().ignored_fields().keys() >= {"outer_lr", "outer_momentum", "error_feedback", "hsdp_shard_size"}
    assert "num_groups" not in FLConfig().ignored_fields()
    assert not hasattr(banner, "ignored_fields") and not hasattr(banner, "FL_ONLY")  # the library's rule only


def test_banner_marks_a_leftover_group_index_ignored_outside_torchft():
    """FL_ACCEL_GROUP_INDEX (or lighthouse_addr) left in the environment of a plain run: shown,
    and marked ignored; in torchft mode it is read, so not marked."""
    env = {"FL_ACCEL_GROUP_INDEX": "1", "FL_ACCEL_LIGHTHOUSE_ADDR": "http://h:1", "WORLD_SIZE": "2"}
    line = banner.fl_line(parse_args([], environ=env))
    assert "group_index=1 (FL_ACCEL_GROUP_INDEX; ignored outside torchft mode)  <- environment variable" in line
    assert "lighthouse_addr='http://h:1' (FL_ACCEL_LIGHTHOUSE_ADDR; ignored outside torchft mode)" in line
    line = banner.fl_line(parse_args(["--fault_tolerance", "torchft"], environ=env))
    assert "group_index=1 (FL_ACCEL_GROUP_INDEX)  <- environment variable" in line and "ignored" not in line


def test_fl_accel_origin_is_the_imported_package():
    import fl_accel

    origin = metrics.fl_accel_origin()
    assert origin["path"] == os.path.dirname(os.path.abspath(fl_accel.__file__)) and origin["version"]


# =========================================================================== test hooks (issue 19 item 8)
class _TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(3, 1)

    def forward(self, input_ids=None):
        return SimpleNamespace(loss=self.w(input_ids.float()).pow(2).mean())


def test_hooks_act_from_the_environment_only(tmp_path):
    model = _TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert testing_hooks.install(model, opt, rank=0, start_step=0, environ={}) == []
    env = {"FL_ACCEL_TEST_FAULT_INJECT": "nan:0:3", "FL_ACCEL_TEST_RECORD_BLOCKS": str(tmp_path / "blocks")}
    handles = testing_hooks.install(model, opt, rank=0, start_step=1, environ=env)
    losses = []
    for i in range(3):  # steps 2, 3, 4 (resumed after step 1)
        loss = model(input_ids=torch.full((2, 3), float(i))).loss
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert [str(x) == "nan" for x in losses[:2]] == [False, True]  # (the NaN then stays in the weights)
    recs = [json.loads(line) for line in (tmp_path / "blocks" / "rank0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [2, 3, 4] and recs[0]["input_ids"] == [[0, 0, 0], [0, 0, 0]]
    for h in handles:
        h.remove()
    assert testing_hooks.install(model, opt, rank=1, start_step=0,
                                 environ={"FL_ACCEL_TEST_FAULT_INJECT": "nan:0:3"}) == []  # another rank's fault
    with pytest.raises(RecipeError, match="FL_ACCEL_TEST_FAULT_INJECT kind must be kill, stop or nan"):
        testing_hooks.install(model, opt, rank=0, start_step=0, environ={"FL_ACCEL_TEST_FAULT_INJECT": "boom:0:1"})


def test_evaluation_notes_follow_the_banner_and_round_eval_every():
    """With fragments the note on what a mid-run evaluation scores is among the notes printed
    after the banner (main prints banner + notes in one block); eval_every becomes a multiple of H."""
    from recipes.pretrain import plan_evaluations

    args = parse_args(["--eval_every", "5"], environ={}).args
    every, notes = plan_evaluations(args, FLConfig(num_fragments=2, sync_every=8), max_steps=48)
    assert every == 8 and notes[0].startswith("eval_every rounded up to 8")
    assert "own group per rank" in notes[1] and "fragments" in notes[1]
    source = (REPO_ROOT / "recipes" / "pretrain.py").read_text()
    assert 'for line in banner + notes' in source


def test_outer_lr_schedule_spans_the_run_and_its_warmup_must_be_shorter(tmp_path):
    """--outer_lr_schedule cosine without --outer_lr_decay_steps decays over --max_steps (left
    out of the run identity, like max_steps); a warmup as long as the run is a RecipeError
    naming the field and the run's steps, raised by the planning every rank does."""
    flags = ["--algorithm", "fl_fsdp", "--num_groups", "2", "--outer_optimizer", "nesterov",
             "--outer_lr_schedule", "cosine", "--output_dir", str(tmp_path / "o")]
    plan = plan_run(flags + ["--max_steps", "40", "--outer_lr_warmup_steps", "8"], environ=ENV)
    assert plan.fl.outer_lr_decay_steps == 40 and plan.identity["fl"]["outer_lr_decay_steps"] is None
    with pytest.raises(RecipeError, match=r"outer_lr_warmup_steps=40 must be shorter than the run.*40 optimizer steps"):
        plan_run(flags + ["--max_steps", "40", "--outer_lr_warmup_steps", "40"], environ=ENV)


def test_rounds_by_time_or_speed_take_the_lr_schedules_the_recipe_builds(tmp_path):
    """Under --sync_trigger time/speed the inner LR follows the federation's progress
    (fl_accel.lr_schedule.lr_multiplier): --lr_scheduler_type must be one of the names it
    builds, else a RecipeError naming the flag and those names, raised by the planning every
    rank does before any collective; under "steps" any transformers name goes."""
    from recipes.run_folder import ROUNDS_LR_SCHEDULES

    flags = ["--algorithm", "fl_fsdp", "--num_groups", "2", "--max_steps", "8", "--output_dir", str(tmp_path / "o")]
    with pytest.raises(RecipeError) as err:
        plan_run(flags + ["--sync_trigger", "speed", "--lr_scheduler_type", "polynomial"], environ=ENV)
    text = str(err.value)
    assert text.startswith("--lr_scheduler_type 'polynomial' is not supported with sync_trigger='speed'"), text
    assert "constant, constant_with_warmup, linear, cosine" in text and "(values from --sync_trigger)" in text
    assert set(ROUNDS_LR_SCHEDULES) == {"constant", "constant_with_warmup", "linear", "cosine"}
    for name in ROUNDS_LR_SCHEDULES:
        plan_run(flags + ["--sync_trigger", "speed", "--lr_scheduler_type", name], environ=ENV).lock.release()
    plan_run(flags + ["--lr_scheduler_type", "polynomial"], environ=ENV).lock.release()


def test_help_of_a_no_flag_says_what_it_does(capsys):
    """``--no_save_final_model`` (HfArgumentParser's negative of a flag on by default) is
    described as turning it off, without the positive flag's text or a "(default: False)"."""
    with pytest.raises(SystemExit):
        parse_args(["--help"], environ=ENV)
    out = capsys.readouterr().out
    block = out.split("  --no_save_final_model, --no-save-final-model", 1)[1].split("\n  --", 1)[0]
    assert " ".join(block.split()) == "turn --save_final_model off (it is on by default)", block
    assert parse_args(["--algorithm", "fsdp", "--no_save_final_model"], environ=ENV).args.save_final_model is False
    assert parse_args(["--algorithm", "fsdp"], environ=ENV).args.save_final_model is True


def test_resume_refusal_names_the_flconfig_field_that_differs():
    """A checkpoint of another run is refused naming the FLConfig field ("fl.sync_every"),
    not the whole "fl" settings (a newcomer had to diff two 25-field dicts)."""
    from recipes.run_folder import _check_resume

    identity = {"seed": 42, "fl": {"sync_every": 8, "num_groups": 2}}
    meta = {"run_identity": {"seed": 42, "fl": {"sync_every": 100, "num_groups": 2}}, "completed_steps": 2,
            "max_steps": 10}
    with pytest.raises(RecipeError, match=r"\['fl.sync_every'\] differ \(e.g. fl.sync_every=100 there, 8 here\)"):
        _check_resume("ckpt", meta, SimpleNamespace(max_steps=10, output_dir="x"), identity)
    _check_resume("ckpt", {**meta, "run_identity": identity}, SimpleNamespace(max_steps=10, output_dir="x"), identity)


def test_an_int8_checkpoint_from_before_sync_collectives_resumes_only_on_its_own_collectives():
    """Run identity records what a "bf16"/"int8" exchange ran ("auto" resolved: one all-gather at
    F = 2), nothing for "fp32"; a checkpoint written before the field existed ran all-to-all, so
    it resumes with ``--sync_collectives all_to_all`` and is refused under "auto", naming the field."""
    from recipes.args import run_identity
    from recipes.run_folder import _check_resume

    def identity(*argv):
        parsed = parse_args(["--algorithm", "fl_fsdp", *argv], environ=ENV)
        return run_identity(parsed.args, parsed.fl)

    auto, a2a = identity("--sync_dtype", "int8"), identity("--sync_dtype", "int8", "--sync_collectives", "all_to_all")
    assert auto["fl"]["sync_collectives"] == "all_gather" and a2a["fl"]["sync_collectives"] == "all_to_all"
    assert "sync_collectives" not in identity("--sync_collectives", "all_gather")["fl"]  # fp32: not read
    args = SimpleNamespace(max_steps=10, output_dir="x")
    for new in (auto, a2a):
        old = {**new, "fl": {k: v for k, v in new["fl"].items() if k != "sync_collectives"}}
        meta = {"run_identity": old, "completed_steps": 2, "max_steps": 10}
        if new is a2a:
            _check_resume("ckpt", meta, args, new)
        else:
            with pytest.raises(RecipeError, match=r"fl.sync_collectives='all_to_all' there, 'all_gather' here"):
                _check_resume("ckpt", meta, args, new)


def test_a_new_run_into_a_folder_with_checkpoints_gets_advice_that_works(tmp_path):
    """An unfinished run's checkpoints: continue it with --resume_from_checkpoint latest; a
    finished run's: only --overwrite_output_dir or another folder (resuming it would be
    refused as "the end of a finished run"; the launched case: tests/recipe/test_recipe_lifecycle.py)."""
    from fl_accel.checkpoint import FORMAT_VERSION, META_FILE

    def folder(name, steps):
        ckpt = tmp_path / name / "checkpoints" / f"step_{steps}"
        ckpt.mkdir(parents=True)
        (ckpt / ".metadata").write_bytes(b"")
        (ckpt / META_FILE).write_text(json.dumps({"format_version": FORMAT_VERSION, "completed_steps": steps,
                                                  "max_steps": 10}))
        return str(tmp_path / name)

    with pytest.raises(RecipeError, match=r"already holds checkpoints \['step_4'\] .* --resume_from_checkpoint latest"):
        plan_run(["--algorithm", "fsdp", "--max_steps", "10", "--output_dir", folder("unfinished", 4)], environ=ENV)
    with pytest.raises(RecipeError, match=r"holds a finished run \(its checkpoint step_10 is step 10 of 10\)") as exc:
        plan_run(["--algorithm", "fsdp", "--max_steps", "10", "--output_dir", folder("finished", 10)], environ=ENV)
    assert "--resume_from_checkpoint" not in str(exc.value) and "--overwrite_output_dir" in str(exc.value)
    # a checkpoint of another layout (this stand-in's metadata has none): what sets it, and the way out
    with pytest.raises(RecipeError, match=r"written by a different setup.*group_sizes=None vs \[4\].* the number of "
                                          r"processes launched, .*--overwrite_output_dir"):
        plan_run(["--algorithm", "fsdp", "--max_steps", "10", "--output_dir", str(tmp_path / "unfinished"),
                  "--resume_from_checkpoint", "latest"], environ=ENV)
    # an interrupted save (step_N.partial) is refused before any data is prepared, naming complete ones
    partial = tmp_path / "unfinished" / "checkpoints" / "step_6.partial"
    partial.mkdir()
    (partial / META_FILE).write_text(json.dumps({"format_version": FORMAT_VERSION, "completed_steps": 6,
                                                 "max_steps": 10}))
    with pytest.raises(RecipeError, match=r"step_6.partial/ is an unfinished save .* \(step_4\) or with "
                                          r"--resume_from_checkpoint latest"):
        plan_run(["--algorithm", "fsdp", "--max_steps", "10", "--output_dir", str(tmp_path / "unfinished"),
                  "--resume_from_checkpoint", str(partial) + "/"], environ=ENV)


def test_fp16_refusal_names_where_the_launcher_got_it(tmp_path, monkeypatch):
    """fp16 from accelerate launch is refused naming its source: the Accelerate config's
    key, or the launch flag that overrode the file (a newcomer's `--mixed_precision fp16`
    was blamed on a file saying 'no'), or the flag/default when the file does not set it."""
    from recipes import run_folder

    cfg = tmp_path / "accelerate.yaml"
    monkeypatch.setattr(run_folder, "launcher_config_file", lambda environ: str(cfg))
    env = {"ACCELERATE_MIXED_PRECISION": "fp16"}
    for text, message in [
        ("mixed_precision: fp16\n", f"requested by mixed_precision: fp16 in the Accelerate config {cfg}"),
        ("mixed_precision: 'no'\n", f"requested by --mixed_precision fp16 given to accelerate launch (the "
                                    f"Accelerate config {cfg} says mixed_precision: no)"),
        ("distributed_type: FSDP\n", f"mixed_precision: fp16 from accelerate launch (its --mixed_precision flag or "
                                     f"default; the Accelerate config {cfg} does not set it"),
    ]:
        cfg.write_text(text)
        with pytest.raises(RecipeError) as exc:
            run_folder.resolve_mixed_precision("auto", env)
        assert message in str(exc.value), str(exc.value)


def test_one_process_with_two_groups_says_how_to_launch_or_what_to_pass():
    """num_groups=2 in a single process: the library's sentence (num_groups=1), then the recipe's
    flags and launch commands, each said once."""
    from recipes.run_folder import plan_config

    with pytest.raises(RecipeError) as exc:
        plan_config(FLConfig(num_groups=2), 1)
    text = str(exc.value)
    assert "a single process (no launcher) is one group: num_groups=1. In the recipe: pass --num_groups 1" in text
    assert text.count("single process") == 1 and "torchrun --nproc_per_node N" in text


def test_one_line_messages_start_on_a_new_line_while_a_progress_bar_is_drawn(capsys):
    """tqdm leaves its bar's line open (it ends with a carriage return, not a newline), so
    a rank's "stopped by the launcher" line shared the bar's line in captured logs; with a
    bar open the message now starts a line of its own, and without one adds no blank line."""
    import io

    from tqdm.auto import tqdm

    from recipes.process import say as _say

    _say("[fl_accel] before")
    bar = tqdm(total=3, file=io.StringIO())
    try:
        _say("[fl_accel] rank 0: during")
    finally:
        bar.close()
    _say("[fl_accel] after")
    assert capsys.readouterr().err == "[fl_accel] before\n\n[fl_accel] rank 0: during\n[fl_accel] after\n"


def test_banner_prints_the_effective_sparse_density():
    """"sparse" rounds the density up to whole bytes of codes (at least 16 of 4096 values at 2
    bits): the banner says the k actually sent beside the density asked for, and the recipe's
    settings of the exchange (aggregation, decay, final sync)."""
    from fl_accel import FLConfig
    from recipes.banner import sparse_text

    text = sparse_text(FLConfig(sync_dtype="sparse", error_feedback=True, sync_density=0.001))
    assert text.startswith("k=16 of every 4096 values = density 0.003906 (asked 0.001)")
    assert "mean over the senders" in text and "decay 0.95" in text and "final sync exact" in text
    assert sparse_text(FLConfig(sync_dtype="sparse", error_feedback=True, sync_value_bits=8,
                                sync_density=0.5)).startswith("k=2048 of every 4096")


def test_closing_lines_of_rounds_and_arrival():
    """The closing lines: each group's wait for the others to arrive (federated runs with 2+
    groups only) and, under a trigger, each group's steps, steps per round and time at syncs
    with the federation's share of the standalone sum."""
    from recipes.results import arrival_line, rounds_line

    res = {"sync_arrival_share_by_group": [0.31, 0.012]}
    assert arrival_line(res, True) == ("\n[fl_accel] waiting for the other groups at syncs (exchange excluded): "
                                       "group 0 31%, group 1 1% of training time")
    assert arrival_line(res, False) == "" and arrival_line({"sync_arrival_share_by_group": [0.5]}, True) == ""
    assert arrival_line({"sync_arrival_share_by_group": [0.1, None]}, True) == ""
    rounds = {"trigger": "speed", "num_rounds": 4, "group_steps": [40, 20], "wait_share": [0.05, 0.02],
              "tokens_per_s": 900.0, "of_standalone_sum": 0.93}
    assert rounds_line(rounds) == ("\n[fl_accel] 4 rounds by speed: group 0: 40 steps (10.0/round), in syncs 5%; "
                                   "group 1: 20 steps (5.0/round), in syncs 2%; 900 tokens/s = 93% of the groups' "
                                   "standalone sum")
    assert rounds_line(None) == ""


# =========================================================== checkpoints and tokenizer in the banner (issue 42)
def test_checkpoint_retention_defaults_to_the_newest_two_and_zero_keeps_all():
    """``--checkpoints_total_limit`` keeps the newest 2 checkpoints unless told otherwise (0:
    all of them); a negative limit is one line naming the flag. The pruning itself:
    tests/recipe/test_recipe_lifecycle.py (a run with the default keeps its last two)."""
    assert parse_args([], environ={}).args.checkpoints_total_limit == 2
    assert parse_args(["--checkpoints_total_limit", "0"], environ={}).args.checkpoints_total_limit == 0
    with pytest.raises(RecipeError, match=r"^--checkpoints_total_limit must be >= 0, got -1$"):
        parse_args(["--checkpoints_total_limit", "-1"], environ={})


def test_checkpoint_size_estimate_counts_each_stored_copy():
    """fl_accel/checkpoint.py stores the model once after a full sync and once per group
    mid-round, AdamW's two moments per group, the anchor and the outer momentum once, the
    error-feedback residuals per group; a torchft group stores only its own state. Measured
    against real checkpoints: tests/recipe/test_recipe_lifecycle.py."""
    from recipes.run_folder import checkpoint_bytes, checkpoints_mid_round

    n, b = 1000, 4
    fl = FLConfig(algorithm="fl_fsdp", num_groups=2, sync_every=2)
    assert checkpoint_bytes(n, b, 2, fl, mid_round=False) == n * b * (1 + 2 * 2)
    assert checkpoint_bytes(n, b, 2, fl, mid_round=True) == n * b * (2 + 2 * 2)
    assert checkpoint_bytes(n, b, 1, FLConfig(algorithm="fsdp"), mid_round=True) == n * b * 3
    diloco = FLConfig(algorithm="fl_fsdp", num_groups=4, outer_optimizer="nesterov", average_optimizer_state=True)
    assert checkpoint_bytes(n, b, 4, diloco, mid_round=False) == n * b * (1 + 2) + 2 * 4 * n
    int8 = FLConfig(algorithm="fl_fsdp", num_groups=2, sync_dtype="int8", error_feedback=True)
    assert checkpoint_bytes(n, 2, 2, int8, mid_round=False) == n * 2 * (1 + 4) + 4 * n + 4 * n * 2
    ft = FLConfig(algorithm="fl_fsdp", num_groups=2, fault_tolerance="torchft", group_index=1)
    assert checkpoint_bytes(n, b, 2, ft, mid_round=True) == n * b * 3
    assert checkpoints_mid_round(fl, 2, 3) and not checkpoints_mid_round(fl, 2, 4)
    assert not checkpoints_mid_round(FLConfig(algorithm="fsdp"), 1, 3) and not checkpoints_mid_round(fl, 2, 0)
    assert checkpoints_mid_round(FLConfig(algorithm="fl_fsdp", num_groups=2, sync_every=4, num_fragments=2), 2, 4)


def test_banner_says_where_checkpoints_go_how_large_and_how_many_are_kept(tmp_path):
    """The banner's checkpoint line (the folder, the estimate at a sync and mid-round, how many
    are kept, the final export) and its tokenizer line (the recipe's BPE trained on the run's
    text and its cache folder, or the named tokenizer)."""
    parsed = parse_args(["--checkpoint_every", "3", "--sync_every", "2", "--output_dir", str(tmp_path)], environ=ENV)
    line = banner.storage_line(parsed.args, parsed.fl, 2, 2_884_736, 4)
    assert line == (f"checkpoints: every 3 steps to {tmp_path}/checkpoints/step_<step>, about 57.7 MB each (69.2 MB "
                    f"mid-round), the newest 2 kept (--checkpoints_total_limit; 0 keeps all); final model: "
                    f"{tmp_path}/final_model (about 11.5 MB)"), line
    parsed = parse_args(["--checkpoints_total_limit", "0", "--checkpoint_every", "1", "--algorithm", "fsdp",
                         "--save_final_model", "false", "--output_dir", str(tmp_path)], environ=ENV)
    line = banner.storage_line(parsed.args, parsed.fl, 1, 2_884_736, 4)
    assert line.startswith("checkpoints: every step to ") and "about 34.6 MB each, every one kept" in line, line
    assert line.endswith("final model: not exported (--save_final_model false)"), line
    parsed = parse_args(["--output_dir", str(tmp_path)], environ=ENV)
    none = banner.storage_line(parsed.args, parsed.fl, 2, 10, 4)
    assert none.startswith("checkpoints: none (--checkpoint_every 0)"), none
    tok = type("Tok", (), {"name_or_path": "/cache/bpe8192-0123", "__len__": lambda self: 8192})()
    assert banner.tokenizer_line(parsed.args, tok) == (
        "tokenizer: a byte-level BPE of 8192 tokens trained on this run's training text (--tokenizer bpe; a hub "
        "tokenizer: --tokenizer <name>), cached in /cache/bpe8192-0123")
    hub = parse_args(["--tokenizer", "meta-llama/Llama-3.1-8B"], environ=ENV).args
    tok = type("Tok", (), {"name_or_path": "meta-llama/Llama-3.1-8B", "__len__": lambda self: 128256})()
    assert banner.tokenizer_line(hub, tok) == ("tokenizer: meta-llama/Llama-3.1-8B (128256 tokens), loaded from "
                                               "meta-llama/Llama-3.1-8B")


# =========================================================== counters after a resume or restart (issue 42)
def test_torchft_counters_add_the_checkpoints_and_the_scope_is_said():
    """Control flow only (real resumes: tests/recipe/test_recipe_lifecycle.py, the restarted
    torchft group: tests/ft/test_ft_launch.py): a torchft group resumed from its checkpoint
    adds this session's heals, heal records and torchft seconds to those stored there, and
    all_results.json's ``counters`` say what the counters cover, with a closing line."""
    import types

    from recipes.results import counters_line, counters_scope, ft_counters

    transport = types.SimpleNamespace(heals=1, heal_sources=[{"source_group": 0, "step": 9, "bytes": 10,
                                                              "seconds": 0.5, "transfer_seconds": 0.4,
                                                              "load_seconds": 0.1, "quorum_id": 3}],
                                      seconds={"quorum": 2.0, "commit": 1.0, "quorums": 4})
    federation = types.SimpleNamespace(heals=transport.heals, heal_log=transport.heal_sources,
                                       membership_seconds=transport.seconds)  # accelerator.federation's views
    acc = types.SimpleNamespace(run_config=types.SimpleNamespace(fault_tolerant=True), federation=federation)
    before = {"heals": 1, "heal_log": [{"source_group": 1, "step": 4}],
              "torchft_seconds": {"quorum": 1.0, "commit": 0.5, "quorums": 2}}
    got = ft_counters(acc, {"fault_tolerance": before})
    assert got["heals"] == 2 and [h["step"] for h in got["heal_log"]] == [4, 9]
    assert got["heal_log"][1] == {"source_group": 0, "step": 9, "bytes": 10, "wire_bytes": None, "seconds": 0.5,
                                  "transfer_seconds": 0.4, "load_seconds": 0.1}
    assert got["torchft_seconds"] == {"quorum": 3.0, "commit": 1.5, "quorums": 6}
    one_world = types.SimpleNamespace(run_config=types.SimpleNamespace(fault_tolerant=False))
    assert ft_counters(acc, {})["heals"] == 1 and ft_counters(one_world, {}) == {}

    def run(restored, resume_path):
        return types.SimpleNamespace(meter=types.SimpleNamespace(restored=restored, data_steps=6),
                                     plan=types.SimpleNamespace(resume_path=resume_path))

    fresh = counters_scope(run({}, None))
    assert fresh == {"since": "the run's start", "carried_over_from": None, "steps_counted": 6}
    assert counters_line(fresh) == ""
    resumed = counters_scope(run({"train_seconds": 3.0}, "out/checkpoints/step_4"))
    assert counters_line(resumed) == ("\n[fl_accel] tokens, time and traffic cover the whole run: the sessions "
                                      "before out/checkpoints/step_4 carried over from it")
    lost = counters_scope(run({"earlier_session_lost": True}, None))
    assert lost["since"] == "this process's start"
    assert counters_line(lost).startswith("\n[fl_accel] note: tokens, time and traffic count since this process "
                                          "started (6 steps)")
