"""bench/recompute.py: every figure of a README's results table recomputed from committed files,
on a small fixture (tests/fixtures/recompute-readme.md citing tests/fixtures/results/) and on
the real README against the committed bench/results (in process)."""

import os
from pathlib import Path

from bench import recompute as rc

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
README = os.path.join(FIXTURES, "recompute-readme.md")
B, G = "baselines-100mbit", "convergence-grid"
ROW, LOSS = "tokens/s at 100 Mbit/s between nodes", "final eval loss, lr 1e-3, three seeds"
FIGURES = (
    rc.Figure(ROW, "1,227", rc.N0, rc.tokens_per_s(B, "rate-100mbit/fsdp")),
    rc.Figure(ROW, "6,272", rc.N0, rc.tokens_per_s(B, "rate-100mbit/fl_fsdp")),
    rc.Figure(ROW, "5.11x", rc.X2, rc.ratio(rc.tokens_per_s(B, "rate-100mbit/fl_fsdp"),
                                            rc.tokens_per_s(B, "rate-100mbit/fsdp"))),
    rc.Figure(ROW, "0.79", rc.F2, rc.ratio(rc.tokens_per_s(B, "rate-100mbit/fl_fsdp"),
                                           rc.tokens_per_s(B, "rate-100mbit/fl_fsdp-limit"))),
    rc.Figure(ROW, "11.0", rc.num(".1f"), rc.fl_mib(B, "rate-100mbit/fl_fsdp")),
    rc.Figure(LOSS, "5.250", rc.F3, rc.final_loss(G, "fsdp-lr1e-3")),
    rc.Figure(LOSS, "5.270", rc.F3, rc.final_loss(G, "fsdp-lr1e-3-seed43")),
    rc.Figure(LOSS, "5.230", rc.F3, rc.final_loss(G, "fsdp-lr1e-3-seed44")),
)


def _run(tmp_path, capsys, figures=FIGURES, edit=None):
    readme = tmp_path / "README.md"
    text = Path(README).read_text(encoding="utf-8")
    readme.write_text(edit(text) if edit else text)
    rc_ = rc.main(["--readme", str(readme), "--results", os.path.join(FIXTURES, "results")], figures=figures)
    out = capsys.readouterr()
    return rc_, out.out, out.err


def test_the_fixture_readme_reproduces(tmp_path, capsys):
    code, out, err = _run(tmp_path, capsys)
    assert code == 0 and err == "" and "8 of 8 figures reproduce" in out
    assert f"from {B}/bench.json runs[rate-100mbit/fsdp]: train_tokens / train_seconds" in out
    assert f"from {G}/curves.csv: last eval/loss of fsdp-lr1e-3-seed44" in out
    assert rc.readme_rows(Path(README).read_text())[ROW].startswith("FSDP 1,227;")


def test_a_figure_that_does_not_reproduce_fails(tmp_path, capsys):
    # the README changed one figure: the old text is no longer there, the new one is covered by nothing
    code, _, err = _run(tmp_path, capsys, edit=lambda t: t.replace("6,272", "6,300"))
    assert code == 1 and "NOT IN README: 'tokens/s at 100 Mbit/s between nodes': '6,272'" in err
    assert "NOT COVERED: 'tokens/s at 100 Mbit/s between nodes' cites 6,300" in err
    # a figure whose computation gives another value than the README prints
    wrong = FIGURES[:2] + (rc.Figure(ROW, "5.11x", rc.X2, rc.tokens_per_s(B, "rate-100mbit/fsdp")),) + FIGURES[3:]
    code, _, err = _run(tmp_path, capsys, figures=wrong)
    assert code == 1
    assert "MISMATCH: 'tokens/s at 100 Mbit/s between nodes': '5.11x' (FIGURES), recomputed '1227.33x'" in err
    # a number of the table that no entry recomputes
    code, _, err = _run(tmp_path, capsys, figures=FIGURES[:-1])
    assert code == 1 and "NOT COVERED" in err and "5.230" in err
    # settings and link text are not figures; a figure inside a longer number is not cited
    settings = "H=16 lr 1e-3 at 10 Mbit/s, 2:1, `int8` [a](b/2026.md)"
    assert rc.IGNORED.sub(" ", settings).split() == ["at", ",", ",", "[a"]
    assert rc._cited("0.3", "0.30 of it") is None and rc._cited("0.3", "0.3 MiB") is not None


def test_the_readme_results_table_reproduces_from_the_committed_results(capsys):
    """Every figure of README.md's results table, recomputed from bench/results (bench.recompute.FIGURES)."""
    code = rc.main([])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert f"{len(rc.FIGURES)} of {len(rc.FIGURES)} figures reproduce" in out.out
