"""Unit tests of scripts/link_guide.py's pure functions and of the two cost-model helpers it
adds (fl_accel.planning.cost.share_of_limit, link_for_share). The command itself:
tests/tools/test_link_guide_cli.py."""

import math

import pytest

from fl_accel.mesh import FLLayout
from fl_accel.planning import cost as cm
from scripts import link_guide as lg


def _shares(row):
    return {r["short"]: r["share"] for r in row["results"]}


def test_parse_link_units_and_refusals():
    assert lg.parse_link("10mbit") == 1e7
    assert lg.parse_link("100Mbit/s") == 1e8
    assert lg.parse_link("2.5gbit") == 2.5e9
    assert lg.parse_link("1Gbps") == 1e9
    assert lg.parse_link("500kbit") == 5e5
    for bad in ("fast", "10", "10 MB/s", "0mbit", "-1gbit", ""):
        with pytest.raises(ValueError, match="--link"):
            lg.parse_link(bad)
    assert lg.link_text(1e7) == "10 Mbit/s" and lg.link_text(2.5e9) == "2.5 Gbit/s"


def test_resolve_model_presets_and_counts():
    tiny = lg.resolve_model("tiny")  # the recipe's tiny Llama at its default BPE vocabulary (8,192)
    assert tiny.params == 2_884_736
    assert lg.resolve_model("llama-8b").params == lg.resolve_model("llama3.1-8b").params == 8_030_261_248
    assert lg.resolve_model("llama-1b").params == 1_235_814_400
    assert lg.resolve_model("llama-8b").flops_per_token == pytest.approx(48.25e9, rel=1e-3)  # flops.py's figure
    counted = lg.resolve_model("8e9")
    assert counted.params == 8_000_000_000 and counted.flops_per_token == 6 * 8e9
    for bad in ("llama-70b", "0", "-3", "nan", "inf"):
        with pytest.raises(ValueError, match="--params"):
            lg.resolve_model(bad)


def test_compute_seconds_is_flops_over_peak_times_mfu():
    assert lg.compute_seconds(48e9, 16384, 989, 0.4) == pytest.approx(48e9 * 16384 / (989e12 * 0.4))
    for kw in ({"mfu": 0}, {"mfu": 1.5}, {"peak_tflops": 0}, {"tokens_per_gpu": -1}):
        args = {"flops_per_token": 1e9, "tokens_per_gpu": 1, "peak_tflops": 1, "mfu": 0.5, **kw}
        with pytest.raises(ValueError):
            lg.compute_seconds(**args)


def test_issue_31_exchange_seconds_at_8b_and_64_gpus_per_site():
    """The issue's figures: Llama-8B, 64 GPUs per site, 10 Mbit/s, H=32: about 804 s of exchange
    per step in fp32, 205 s in int8 and 8 s sparse (the cost model's, all at H=32)."""
    model = lg.resolve_model("llama-8b")
    by = {}
    for dtype in ("fp32", "int8", "sparse"):
        s = lg.Setting(dtype, dtype, 32, 1, 0, dtype, ())
        by[dtype] = lg.evaluate(model, s, groups=2, gpus_per_group=64, link_bits_per_s=1e7, compute_s=2.0)
    assert by["fp32"]["exchange_s"] == pytest.approx(804, rel=0.01)
    assert by["int8"]["exchange_s"] == pytest.approx(205, rel=0.01)
    assert 7 < by["sparse"]["exchange_s"] < 8.5


def test_8b_at_10mbit_only_sparse_keeps_the_limit_given_a_minute_of_compute():
    """8e9 parameters, 64 GPUs per group, 10 Mbit/s: with 60 s of compute per step (e.g. a large
    batch per GPU) only sparse keeps 0.95; with the default compute (about 2 s) nothing does,
    and the guide says which link sparse would need."""
    model = lg.resolve_model("8e9")
    [row] = lg.guide([model], [1e7], groups=2, gpus_per_group=64, compute_s=60)
    assert [r["short"] for r in row["results"] if r["keeps"]] == ["sparse"]
    assert lg.keeps_text(row) == "sparse"
    [row] = lg.guide([model], [1e7], groups=2, gpus_per_group=64)
    assert row["compute_s"] == pytest.approx(6 * 8e9 * 16384 / (989e12 * 0.4))
    assert not any(r["keeps"] for r in row["results"])
    sparse = row["results"][-1]
    assert sparse["short"] == "sparse" and sparse["share"] == max(_shares(row).values())
    need = sparse["link_for_threshold_bits_per_s"]
    assert 1e8 < need < 1e9 and lg.keeps_text(row) == \
        f"none (best here: sparse {sparse['share']:.3f}; sparse needs {lg.link_text(need)})"
    # at the link it names, sparse keeps the threshold; 1% slower it does not
    [at] = lg.guide([model], [need], groups=2, gpus_per_group=64)
    [below] = lg.guide([model], [need * 0.99], groups=2, gpus_per_group=64)
    assert at["results"][-1]["keeps"] and not below["results"][-1]["keeps"]


def test_tiny_model_as_measured_here_blocking_h32_is_near_the_limit_at_1gbit():
    """The tiny model in the benchmark's regime (2 groups x 2 processes, 0.514 s per step without
    sync): blocking fp32 H=32 is within 1% of the limit at 1 Gbit/s; at 10 Mbit/s blocking fp32
    H=8 is at about 0.30 of it, as measured (bench/results/2026-12-01-streaming: 0.30)."""
    tiny = lg.resolve_model("tiny", seq_len=256)
    fast, slow = lg.guide([tiny], [1e9, 1e7], groups=2, gpus_per_group=2, compute_s=0.514)
    assert _shares(fast)["fp32 H=32"] > 0.99
    assert all(r["keeps"] for r in fast["results"])
    assert _shares(slow)["fp32 H=8"] == pytest.approx(0.30, abs=0.02)


def test_share_grows_with_link_compute_and_h():
    model = lg.resolve_model("llama-1b")
    rows = lg.guide([model], [1e8, 1e9, 1e10], groups=4, gpus_per_group=8, compute_s=1.0)
    for setting in ("fp32 H=8", "int8", "sparse"):
        shares = [_shares(r)[setting] for r in rows]
        assert shares == sorted(shares) and 0 < shares[0] <= 1
    for r in rows:
        s = _shares(r)
        assert s["fp32 H=8"] <= s["fp32 H=16"] <= s["fp32 H=32"]
    [slow] = lg.guide([model], [1e8], groups=4, gpus_per_group=8, compute_s=0.1)
    assert _shares(slow)["fp32 H=8"] < _shares(rows[0])["fp32 H=8"]


def test_bad_layouts_and_threshold_are_refused():
    model = lg.resolve_model("tiny")
    for kw, match in (({"groups": 1}, "--groups"), ({"gpus_per_group": 0}, "--gpus-per-group"),
                      ({"threshold": 0}, "--threshold"), ({"threshold": 1.5}, "--threshold"),
                      ({"compute_s": -1.0}, "--compute-s")):
        with pytest.raises(ValueError, match=match):
            lg.guide([model], [1e9], **{"groups": 2, "gpus_per_group": 2, **kw})


def test_settings_name_grid_rows_that_exist_with_their_labels_and_sync_settings():
    """Each setting points at rows of bench/plan.py's convergence grid, under the label the grid's
    table prints, and each row trains the setting's exchange (H, P, tau, dtype) with no other flag."""
    from bench import plan as bp

    assert lg.QUALITY_TABLE == "bench/results/2026-12-03-grid/table.md"
    runs = {r.id: r for r in bp.local_runs({"suites": ["convergence"], "seed": 42, **bp.LOCAL_FULL["convergence"],
                                            "report_to": "none"})}
    for s in lg.SETTINGS:
        assert s.quality_rows
        for rid, label in s.quality_rows:
            spec = runs[rid]
            assert spec.label == label
            assert (spec.sync_every, spec.num_fragments, spec.sync_delay, spec.sync_dtype) == \
                (s.sync_every, s.num_fragments, s.sync_delay, s.sync_dtype)
            assert spec.sync_dtype == "fp32" or spec.error_feedback
            # FLConfig's defaults otherwise (sparse: 1/64, 2 bits); the LR of the setting's FSDP reference
            lr = ("--learning_rate", "1e-3") if s.fsdp_row == "fsdp-lr1e-3" else ()
            keep = ("--delayed_local_steps", "keep") if s.delayed_local_steps == "keep" else ()
            assert spec.extra_flags == lr + keep, rid
            assert runs[s.fsdp_row].algorithm == "fsdp"


def test_quality_lines_give_each_settings_loss_and_gap_to_fsdp_at_its_lr(tmp_path):
    """The guide prints measured figures, not row ids alone: mean +- sd over the seeds where the grid
    trained several, the one run otherwise, and the gap to the FSDP row of the same LR; a row the
    grid has not finished says so."""
    import json

    results = {"rows": {"fsdp-lr1e-3": {"eval_loss": 4.7}, "fl_fsdp-h16-lr1e-3": {"eval_loss": 4.91},
                        "fl_fsdp-h32": {"eval_loss": 5.4}, "fsdp": {"eval_loss": 5.2}},
               "seeds": {"configs": {"fl_fsdp-h8-lr1e-3": {"n": 3, "mean": 4.9, "sd": 0.008}}}}
    (tmp_path / "bench/results/2026-12-03-grid").mkdir(parents=True)
    (tmp_path / lg.QUALITY_JSON).write_text(json.dumps({"results": results}))
    measured = lg.measured_quality(str(tmp_path))
    assert measured["fl_fsdp-h8-lr1e-3"] == {"mean": 4.9, "sd": 0.008, "n": 3}
    lines = lg.quality_lines(measured)
    text = "\n".join(lines)
    assert "fp32 H=8: 4.900 \u00b1 0.008 (3 seeds), +0.200 nats against FSDP's 4.700 (fsdp-lr1e-3)" in text
    assert "fp32 H=16: 4.910 (1 seed), +0.210 nats" in text
    assert "fp32 H=32: 5.400 (1 seed), +0.200 nats against FSDP's 5.200 (fsdp)" in text
    assert "int8+EF H=16 P=2 tau=2 keep: not finished" in text
    assert lg.measured_quality(str(tmp_path / "nowhere")) == {}
    # the committed grid: the blocking rows have their figures
    committed = lg.measured_quality()
    assert committed["fl_fsdp-h8-lr1e-3"]["n"] == 3 and committed["fsdp-lr1e-3"]["n"] == 3


def test_share_of_limit_and_link_for_share_on_a_hand_case():
    """2 groups of 1 rank, 1e6 fp32 values, H=1: 2 (F-1)/F 4n = 4 MB per step on "fl"; at 4 MB/s the
    sync takes 1 s against 1 s of compute: half the limit; 0.8 of it needs 16 MB/s."""
    est = cm.estimate(FLLayout.equal(2, 1, 1), 1e6, sync_every=1, ranks_per_node=1)
    t = cm.predict_step_time(est, compute_s=1.0, intra_node_bw=1e12, inter_node_bw=4e6)
    assert cm.share_of_limit(t) == pytest.approx(0.5, rel=1e-5)
    bw = cm.link_for_share(est, 0.8, compute_s=1.0, intra_node_bw=1e12)
    assert bw == pytest.approx(16e6, rel=2e-3) and bw >= 16e6 * (1 - 1e-9)
    # latency-bound: no link speed reaches it
    assert cm.link_for_share(est, 0.99, compute_s=1.0, intra_node_bw=1e12, latency_s=0.5) is None
    with pytest.raises(ValueError, match="share"):
        cm.link_for_share(est, 0, compute_s=1.0, intra_node_bw=1e12)
    assert math.isclose(cm.share_of_limit(cm.StepTime(0.0, 0.0, {}, 0.0, None)), 1.0)
