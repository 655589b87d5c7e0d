"""One version: pyproject.toml, `python -m mlx_engine --version` and the newest release in CHANGELOG.md."""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_version_agrees_everywhere():
    from mlx_engine._version import __version__

    pyproject = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    releases = re.findall(r"^## \[(\d[^\]]*)\] - \d{4}-\d\d-\d\d$", (REPO / "CHANGELOG.md").read_text(), re.M)
    assert pyproject == __version__ == releases[0]
    out = subprocess.run([sys.executable, "-m", "mlx_engine", "--version"], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == f"mlx-engine {__version__}"
