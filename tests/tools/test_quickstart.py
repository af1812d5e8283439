"""scripts/quickstart.sh (dry run, three environments) and what the README says about it;
the launch scripts' allocator setting."""

import os
import subprocess

from _launch import REPO_ROOT


# =========================================================================== README and scripts (issue 18 item 7)
def test_readme_describes_the_model_families_and_the_quickstart_a_virtual_environment(tmp_path):
    """The README says which models the recipe trains; the quickstart installs into the active
    virtual environment or creates ./.venv (no third command for the user); the launch
    scripts set PYTORCH_ALLOC_CONF."""
    readme = (REPO_ROOT / "README.md").read_text()
    assert "trains `transformers.LlamaForCausalLM`" not in readme
    assert "_no_split_modules" in readme and "Qwen2" in readme and "Mistral" in readme
    script = str(REPO_ROOT / "scripts" / "quickstart.sh")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CONDA_PREFIX")}
    for extra, expected in (({}, "[quickstart] installing into ./.venv"),
                            ({"VIRTUAL_ENV": str(tmp_path)}, f"installing into the active environment {tmp_path}"),
                            ({"QUICKSTART_VENV": "none"}, "(QUICKSTART_VENV=none)")):
        out = subprocess.run(["bash", script], env={**env, **extra, "QUICKSTART_DRY_RUN": "1"}, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0 and expected in out.stdout, (out.stdout, out.stderr)
    for name in ("quickstart.sh", "slurm_pretrain.sh"):
        assert "PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True}" in \
            (REPO_ROOT / "scripts" / name).read_text(), name



def test_quickstart_bad_input_ends_with_the_one_line_error(tmp_path):
    """Issue 42: a bad argument to the quickstart (passed on to its accelerate launch of the
    recipe, 4 processes, through scripts.launch_guard) ends the script with the recipe's
    one-line error as the last line and the rank's status (2), no launcher traceback. The
    install step runs a stand-in ``python -m pip`` (a real one here would re-point the shared
    environment's editable install at this checkout); everything else is real."""
    import re
    import sys

    from _launch import launch_env

    shim = tmp_path / "bin" / "python"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\n[ "$1 $2" = "-m pip" ] && exit 0\nexec {sys.executable} "$@"\n')
    shim.chmod(0o755)
    env = launch_env({"PATH": f"{shim.parent}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(tmp_path)})
    proc = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "quickstart.sh"), "--output_dir", str(tmp_path / "out"),
                           "--max_steps", "-3"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600)
    out = proc.stdout
    assert proc.returncode == 2, out[-4000:]
    last = [line for line in out.splitlines() if line.strip()][-1]
    assert re.fullmatch(r"\[fl_accel\] error \(rank \d\): --max_steps must be >= 1, got -3", last), out[-4000:]
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-4000:]
    assert not (tmp_path / "out").exists()
