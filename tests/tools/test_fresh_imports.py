"""Imports that must stay light, checked in a fresh interpreter (one subprocess each): what a
module pulls in can only be seen where nothing was imported before it."""

import subprocess
import sys

import pytest
from _launch import REPO_ROOT


def test_importing_config_and_mesh_does_not_load_accelerate():
    """``import fl_accel`` stays light: FLConfig/FLLayout without Accelerate or torch.distributed setup."""
    code = "import sys, fl_accel; fl_accel.FLConfig(); print('accelerate' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"



@pytest.mark.parametrize("module", ["fl_accel.planning.memory", "fl_accel.planning.cost", "fl_accel.planning.flops",
                                    "fl_accel.planning.units", "fl_accel.planning.links", "fl_accel.wire"])
def test_the_planning_package_loads_no_torch(module):
    """The analytic models and the wire constants they share with the codecs run without torch
    (issue 41 item 5): ``import sys, <module>; assert 'torch' not in sys.modules``. The static
    check of the same closure, in the unit tier: tests/unit/test_layering.py."""
    code = f"import sys, {module}; assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]

def test_plots_import_is_lazy():
    """``recipes.plots`` imports matplotlib only when a figure is drawn."""
    pytest.importorskip("matplotlib")
    out = subprocess.run([sys.executable, "-c", "import sys, recipes.plots; print('matplotlib' in sys.modules)"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_psutil_and_matplotlib_are_optional_for_the_recipe():
    """Importing the recipe needs neither psutil nor matplotlib (made unimportable here);
    without psutil the host-load meter raises ModuleNotFoundError at construction, which
    main() turns into a null ``host``; without matplotlib write_results skips curves.png."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('psutil', 'matplotlib'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import recipes.pretrain, recipes.host_load, recipes.plots, recipes.metrics\n"
        "assert 'psutil' not in sys.modules and 'matplotlib' not in sys.modules\n"
        "assert recipes.metrics.launch_seconds() is None\n"
        "try:\n"
        "    recipes.host_load.HostLoad()\n"
        "except ModuleNotFoundError:\n"
        "    print('no psutil: no meter')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "no psutil: no meter", out.stderr[-2000:]
    source = (REPO_ROOT / "recipes" / "results.py").read_text()  # the recipe's final phase
    assert 'results["host"] = host.stop() if host is not None else None' in source
    assert "import matplotlib  # noqa: F401  (optional" in source


# =========================================================================== arguments (issue 18 item 3)
