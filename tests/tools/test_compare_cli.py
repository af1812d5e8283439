"""scripts/compare.py run as a command (``python scripts/compare.py``, ``python -m scripts.compare``):
a missing or empty folder is one error line with exit code 2. Its tables and verdicts in-process:
tests/unit/test_compare.py."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("how", ["script", "module"])
def test_missing_or_empty_folder_is_one_error_line(tmp_path, how):
    (tmp_path / "empty").mkdir()
    cmd = [sys.executable, "scripts/compare.py"] if how == "script" else [sys.executable, "-m", "scripts.compare"]
    env = dict(os.environ, PYTHONPATH=REPO)
    for target, what in ((tmp_path / "missing", "no such folder"), (tmp_path / "empty", "no runs")):
        proc = subprocess.run(cmd + [str(target)], capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and what in proc.stderr
        assert "Traceback" not in proc.stderr

