"""scripts/cost_model.py run as a command (``python -m scripts.cost_model``): the paper
setting's table and the one-line errors with exit code 2. The in-process parts of the CLI
(``--json``) and the model itself: tests/unit/test_cost_model.py."""

import json
import subprocess
import sys

import pytest

from _launch import assert_one_line_error


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "scripts.cost_model", *args], capture_output=True, text=True,
                          timeout=60)


def test_cli_prints_the_paper_setting():
    proc = _cli("--compute-s", "1", "--intra-node-gbs", "100", "--inter-node-gbs", "12.5")
    assert proc.returncode == 0, proc.stderr
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]]
            for r in proc.stdout.splitlines() if r.startswith("| ") and "setting" not in r}
    assert list(rows) == ["FSDP", "FL+FSDP fp32, blocking", "fragmented fp32", "fragmented int8", "fragmented sparse"]
    # sparse is an all-gather: at F = 128 groups it moves 128 x 0.0046 of fp32's bytes, more than int8
    assert 0.55 * 1.992 < float(rows["fragmented sparse"][3]) < 0.65 * 1.992
    assert rows["FSDP"][3] == "47.049" and rows["FL+FSDP fp32, blocking"][3] == "1.992"
    assert rows["fragmented fp32"][3] == "1.992" and float(rows["fragmented int8"][3]) < 0.26 * 1.992
    assert float(rows["fragmented fp32"][5]) < 0.3 * float(rows["FL+FSDP fp32, blocking"][5])  # peak per sync
    assert float(rows["fragmented fp32"][8]) < float(rows["FL+FSDP fp32, blocking"][8])  # exposed sync s


BAD = [["--group-size", "3"], ["--shard-size", "3"], ["--compute-s", "1"], ["--world-size", "x"],
       ["--llama-config", "/nonexistent.json"], ["--params", "nope"], ["--params", "0"]]


def test_cli_bad_input_as_a_command_is_one_line_and_exit_2():
    proc = _cli(*BAD[-1])
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("error: ")


@pytest.mark.parametrize("args", BAD)
def test_cli_bad_input_one_line_exit_2(args, capsys):
    """The command's ``main`` in this process (the command line itself: the test above)."""
    from scripts import cost_model

    assert_one_line_error(cost_model.main, args, capsys)



def test_params_takes_the_link_guides_presets(capsys):
    """``--params llama-8b`` (a recipe preset, as scripts.link_guide takes it) models the same
    Llama-3.1-8B shapes as the default; a number stays a parameter count."""
    from scripts import cost_model

    tables = []
    for args in ([], ["--params", "llama-8b"], ["--params", "8.03e9"]):
        assert cost_model.main([*args, "--json"]) == 0
        tables.append(capsys.readouterr().out)
    default, preset, count = (json.loads(t) for t in tables)
    assert preset == default and [r["params"] for r in preset] == [8030261248] * len(preset)
    assert count != default  # equal units of a bare count, not the 8B's shapes
