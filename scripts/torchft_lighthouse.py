"""torchft's Lighthouse, started without importing torch: ``python scripts/torchft_lighthouse.py --bind HOST:PORT ...``.

The ``torchft_lighthouse`` entry point that torchft installs (0.2.0, and the 0.3-API nightly builds) runs ``from
torchft._torchft import lighthouse_main``, which imports the ``torchft`` package first, and
its ``__init__`` imports torch and torchft's Python side (about 3 CPU-s per Lighthouse). The
Lighthouse itself is Rust code in the ``torchft._torchft`` extension, which links against no
part of torch: this script loads that extension straight from torchft's folder (found with
``importlib.util.find_spec``, which does not run the package) and calls the same
``lighthouse_main`` with the same options (a tenth of a second). Where the extension is not
where torchft puts it, it falls back to the entry point's import. It is the installed build's
Lighthouse: the groups must run the same build (a 0.3 replica cannot talk to a 0.2 Lighthouse).

Run it as a file, not with ``-m`` or ``-c``: ``lighthouse_main`` parses the process's own
command line (Rust's ``std::env::args``), skipping its first element, so the script's path
must stand where the entry point's does (``scripts/ft_launch.py`` ``lighthouse_argv``).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def _extension() -> str | None:
    """The path of torchft's ``_torchft`` extension module, or None."""
    spec = importlib.util.find_spec("torchft")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = os.path.join(folder, "_torchft" + suffix)
            if os.path.isfile(path):
                return path
    return None


def main() -> int:
    path = _extension()
    if path is None:
        from torchft._torchft import lighthouse_main  # the entry point's way (imports torch)
    else:
        spec = importlib.util.spec_from_file_location("torchft._torchft", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        lighthouse_main = module.lighthouse_main
    sys.argv[0] = "torchft_lighthouse"
    return lighthouse_main()


if __name__ == "__main__":
    sys.exit(main())
