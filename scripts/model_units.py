"""The FSDP units of a model now live in :mod:`fl_accel.planning.units`; this name stays only
for ``scripts/cost_model.py``'s import until that CLI moves to ``fl_accel.planning`` (then it
goes). New code imports :mod:`fl_accel.planning.units`."""

from fl_accel.planning.units import LLAMA_3_1_8B, config_value, llama_units, units_from_module  # noqa: F401
