"""The dashboard's and /docs's browser assets ship in the package, exactly as npm has them
(``scripts/vendor-ui --check``), and the page names only assets of its own."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from corral._ui.routes import STATIC

ROOT = Path(__file__).resolve().parents[2]


def test_vendored_assets_match_the_manifest() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "scripts/vendor-ui"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_the_page_loads_nothing_from_elsewhere() -> None:
    for name in ("index.html", "app.js", "app.css"):
        # SVG's namespace is a name, never fetched.
        text = (STATIC / name).read_text().replace("http://www.w3.org/2000/svg", "")
        assert not re.search(r"https?://", text), f"{name} names a URL off this service"
