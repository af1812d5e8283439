"""Command-line tools of fl_accel (importable so tests can use scripts.netemu)."""
