"""scripts/test.sh warns when the machine is busy, as scripts/quickstart.sh does, through
``python -m scripts.busy``: run under a real load of busy processes. scripts/test.sh
itself runs with a stand-in ``python`` on PATH whose ``-m pip`` and ``-m pytest`` do nothing
(a real install here would re-point the shared environment's editable install at this
checkout), every other command going to this Python; .ci/run still calls exactly
``bash scripts/test.sh``. The line itself: tests/unit/test_busy.py."""

import os
import subprocess
import sys
import time

from _launch import REPO_ROOT


def _burners(n):
    """``n`` processes that keep a CPU busy each (killed by the caller)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def test_test_script_warns_when_the_machine_is_busy(tmp_path):
    shim = tmp_path / "bin" / "python"
    shim.parent.mkdir()
    shim.write_text(f"""#!/bin/sh
case "$1 $2" in
  "-m pip") exit 0 ;;
  "-m pytest") echo "pytest ran: $*"; exit 0 ;;
esac
exec {sys.executable} "$@"
""")
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{shim.parent}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(tmp_path),
           "PYTHONPATH": str(REPO_ROOT), "FL_ACCEL_TEST_WORKERS": "0"}
    burners = _burners(os.cpu_count() or 2)
    try:
        time.sleep(0.5)
        proc = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "test.sh"), "-m", "unit"], env=env,
                              capture_output=True, text=True, timeout=120)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    warning = next((line for line in lines if line.startswith("[test] warning: other processes keep ")), None)
    assert warning is not None, proc.stdout + proc.stderr
    assert "the test suite will take longer than roughly 7 to 15 minutes on 2 CPU cores" in warning \
        and "a time that assumes idle cores" in warning, warning
    assert lines.index(warning) < next(i for i, line in enumerate(lines) if line.startswith("pytest ran: ")), lines
    ci = (REPO_ROOT / ".ci" / "run").read_text().splitlines()
    assert "bash scripts/test.sh" in ci, ci  # the README's command, on its own line


def test_quickstart_checks_the_same_way():
    """The quickstart runs the same check before its two runs (its own time, 2 to 5 minutes)."""
    text = (REPO_ROOT / "scripts" / "quickstart.sh").read_text()
    check = 'python -m scripts.busy --prefix "[quickstart] " --job "the two runs" --expect "2 to 5 minutes'
    assert check in text and text.index(check) < text.index("accelerate launch")
