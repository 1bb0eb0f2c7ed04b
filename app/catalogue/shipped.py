"""Where the files specdeck ships live: models.yaml and assets/.

Knows: the two layouts, a source checkout (editable installs, the tests) with the files at the
project root, and a wheel install, which puts them under <prefix>/share/specdeck (pyproject's
data-files). Must not know: what the files hold.
"""

from __future__ import annotations

import sys
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parents[2]
_INSTALLED = Path(sys.prefix) / "share" / "specdeck"


def shipped_path(relative: str) -> Path:
    """The shipped file or folder at relative (like "assets/prompts"), wherever it was installed.

    Falls back to the checkout path, so a missing file is reported where it was expected.
    """
    for root in (_CHECKOUT, _INSTALLED):
        if (root / relative).exists():
            return root / relative
    return _CHECKOUT / relative
