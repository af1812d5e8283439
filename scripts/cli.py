"""What the commands of scripts/ share: bad input answers in one line (``error: ...`` on
stderr, exit status 2), as ``argparse`` does for its own errors."""

from __future__ import annotations

import sys
from typing import Any, NoReturn


def fail(message: Any) -> NoReturn:
    """Print ``error: message`` on stderr and exit with status 2 (bad input). Also an
    ``ArgumentParser.error``: ``parser.error = fail`` drops argparse's usage lines."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)
