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

