"""recipes.plots: real matplotlib figures (Agg), inspected before they are closed."""


import pytest

from recipes import plots

pytest.importorskip("matplotlib")


@pytest.fixture
def figures(monkeypatch):
    """Every figure a plot function saves, kept for inspection (the PNG is still written)."""
    saved = []
    real = plots._save

    def keep(fig, path):
        saved.append(fig)
        fig.canvas.draw()  # render tick labels
        return real(fig, path)

    monkeypatch.setattr(plots, "_save", keep)
    return saved


def _records(scale=1.0, groups=0, scored=None):
    recs = []
    for s in range(1, 9):
        recs.append({"step": s, "tokens": s * 4096, "time_s": 1.5 * s, "train/loss": scale * (9 - 0.3 * s),
                     "tokens_per_s": 2000.0 + 10 * s})
        if s % 4 == 0:
            r = {"step": s, "tokens": s * 4096, "time_s": 1.5 * s, "eval/perplexity": scale * 5000 / s}
            if scored:
                r["eval/scored"] = scored if s < 8 else "synchronized"
            r.update({f"eval/perplexity_group{f}": scale * (5000 + 100 * f) / s for f in range(groups)})
            recs.append(r)
    return recs


def test_styles_differ():
    styles = [plots.style(i) for i in range(8)]
    assert len({(s["marker"], s["linestyle"]) for s in styles}) == 8
    assert len({s["color"] for s in styles}) == 8


def test_run_curves_with_group_perplexities(tmp_path, figures):
    """Three panels (loss, perplexity, tokens/s); the legend says what each evaluation scored
    (mid-run: each rank's own group model under fragments; the synchronized model at the
    end; each group's own model before the sync), and every panel marks the syncs."""
    from matplotlib.ticker import EngFormatter

    path = plots.plot_run_curves(_records(groups=2, scored="own group per rank"), tmp_path / "sub" / "curves.png",
                                 "fl_fsdp F=2", sync_every=4, num_fragments=2)
    assert (tmp_path / "sub" / "curves.png").stat().st_size > 1000 and path.endswith("curves.png")
    loss_ax, ppl_ax, rate_ax = figures[0].axes
    assert len(loss_ax.get_lines()[0].get_xdata()) == 8
    labels = [ln.get_label() for ln in ppl_ax.get_lines() if not ln.get_label().startswith(("_", "fragment"))]
    assert labels == ["each rank's own group model, synchronized model at the end",
                      "group 0, own model before each sync", "group 1, own model before each sync"], labels
    # one fragment syncs every H/P = 2 steps: steps 2, 4, 6, 8 at 4096 tokens per step, in every panel
    for ax in (loss_ax, ppl_ax, rate_ax):
        marks = sorted(ln.get_xdata()[0] for ln in ax.get_lines() if list(ln.get_xdata()) == [ln.get_xdata()[0]] * 2)
        assert marks == [2 * 4096, 4 * 4096, 6 * 4096, 8 * 4096], marks
    assert "fragment sync (1 of P=2 every 2 steps)" in [t.get_text() for t in ppl_ax.get_legend().get_texts()]
    rate = [ln for ln in rate_ax.get_lines() if ln.get_label() == "tokens/s"][0]
    assert list(rate.get_ydata()) == [2000.0 + 10 * s for s in range(1, 9)]
    assert ppl_ax.get_yscale() == "log" and isinstance(ppl_ax.xaxis.get_major_formatter(), EngFormatter)
    assert figures[0]._suptitle.get_text() == "fl_fsdp F=2"


def test_sync_marks_of_a_blocking_sync_and_of_a_baseline():
    recs = _records()
    assert plots.sync_marks(recs, 4) == ([4 * 4096, 8 * 4096], "sync (every H=4 steps)")
    assert plots.sync_marks(recs, None) == ([], "")


def test_run_curves_without_evaluations(tmp_path, figures):
    recs = [r for r in _records() if "train/loss" in r]
    plots.plot_run_curves(recs, tmp_path / "c.png")
    assert (tmp_path / "c.png").exists() and figures[0].axes[1].get_lines() == []
    assert figures[0].axes[1].get_legend() is None


def test_comparison_identical_runs_stay_visible(tmp_path, figures):
    runs = [{"name": n, "records": _records(), "tokens_per_s": 2500.0} for n in ("fl_fsdp", "fl_hsdp")]
    plots.plot_comparison(runs, tmp_path / "comparison.png", "exp")
    tok_ax, time_ax, bar_ax = figures[0].axes
    a, b = tok_ax.get_lines()
    assert list(a.get_ydata()) == list(b.get_ydata())  # identical numbers ...
    assert (a.get_marker(), a.get_linestyle()) != (b.get_marker(), b.get_linestyle())  # ... drawn differently
    assert [t.get_text() for t in bar_ax.texts] == ["2,500", "2,500"]
    ticks = {t.get_text(): t.get_position()[1] for t in bar_ax.get_yticklabels()}
    assert ticks["fl_fsdp"] > ticks["fl_hsdp"]  # the first run is the top bar


def test_panels_and_bars(tmp_path, figures):
    panels = {"1gbit": [plots.Series("FSDP", [1, 2], [10, 5])], "100mbit": [plots.Series("FSDP", [1, 2], [11, 6])]}
    plots.plot_panels(panels, tmp_path / "p.png", xlabel="tokens", ylabel="ppl", hlines={"100mbit": 6.0})
    assert [ax.get_title() for ax in figures[0].axes] == ["1gbit", "100mbit"]
    assert len(figures[0].axes[1].get_lines()) == 2  # the series and the target line
    plots.plot_bars({"1gbit": [("FSDP", 2300.0, 2310.0), ("FL+FSDP", 2700.0, None)],
                     "100mbit": [("FSDP", 970.0, 1200.0), ("FL+FSDP", 2480.0, 2530.0)]},
                    tmp_path / "b.png", ylabel="tokens/s")
    ax = figures[1].axes[0]
    assert sorted(t.get_text() for t in ax.texts) == sorted(["2,300", "2,700", "970", "2,480"])
    assert sorted(t.get_text() for t in ax.get_legend().get_texts()) == ["FL+FSDP", "FSDP", "prediction"]
    with pytest.raises(ValueError, match="x values"):
        plots.plot_panels({"a": [plots.Series("s", [1, 2], [1])]}, tmp_path / "x.png", xlabel="x", ylabel="y")
    with pytest.raises(ValueError, match="at least one"):
        plots.plot_bars({}, tmp_path / "y.png", ylabel="y")
