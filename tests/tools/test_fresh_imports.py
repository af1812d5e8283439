"""Imports that must stay light, checked in a fresh interpreter (one subprocess each): what a
module pulls in can only be seen where nothing was imported before it."""

import subprocess
import sys

import pytest


def test_importing_config_and_mesh_does_not_load_accelerate():
    """``import fl_accel`` stays light: FLConfig/FLLayout without Accelerate or torch.distributed setup."""
    code = "import sys, fl_accel; fl_accel.FLConfig(); print('accelerate' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_plots_import_is_lazy():
    """``scripts.plots`` imports matplotlib only when a figure is drawn."""
    pytest.importorskip("matplotlib")
    out = subprocess.run([sys.executable, "-c", "import sys, scripts.plots; print('matplotlib' in sys.modules)"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
