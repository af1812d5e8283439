"""scripts/busy.py's line (what scripts/test.sh and scripts/quickstart.sh print before their
long job): a warning above scripts.compare's background limit, else the load; either way the
expected time and that it assumes idle cores (issue 42). Run as a command under real load, and
from scripts/test.sh: tests/tools/test_busy_cli.py."""

import pytest

from _launch import assert_one_line_error
from scripts import busy
from scripts.compare import BACKGROUND_LIMIT


def test_busy_machine_warns_and_an_idle_one_says_what_the_time_assumes():
    kw = dict(job="the test suite", expect="roughly 7 to 15 minutes on 2 CPU cores", prefix="[test] ")
    loaded = busy.report(0.63, 2, 2.0, **kw)
    assert loaded == ("[test] warning: other processes keep 63% of the 2 CPUs busy (measured over 2 s): the test "
                      "suite will take longer than roughly 7 to 15 minutes on 2 CPU cores, a time that assumes idle "
                      "cores, and the timings it measures are not its own")
    idle = busy.report(0.01, 2, 2.0, **kw)
    assert idle == ("[test] other processes keep 1% of the 2 CPUs busy (measured over 2 s): expected time of the test "
                    "suite: roughly 7 to 15 minutes on 2 CPU cores (a time that assumes idle cores)")
    # one wording for a singular and a plural job ("the two runs takes" was the old line's grammar)
    assert "expected time of the two runs: 2 to 5 minutes" in busy.report(0.01, 2, 2.0, job="the two runs",
                                                                          expect="2 to 5 minutes")
    assert "warning" not in busy.report(BACKGROUND_LIMIT, 2, 2.0, **kw)  # the limit itself is quiet, as in compare
    assert "warning" in busy.report(BACKGROUND_LIMIT + 0.01, 2, 2.0, **kw)
    assert busy.report(None, None, 2.0, **kw).startswith("[test] note: could not measure the machine's load")


@pytest.mark.parametrize("args", [["--job", "x"], ["--job", "x", "--expect", "y", "--seconds", "0"],
                                  ["--job", "x", "--expect", "y", "--seconds", "nope"]])
def test_bad_arguments_are_one_line(args, capsys):
    assert_one_line_error(busy.main, args, capsys)
