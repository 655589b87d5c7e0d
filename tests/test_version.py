"""One version: pyproject.toml, `python -m mlx_engine --version` and the newest release in CHANGELOG.md."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_version_agrees_everywhere(capsys):
    from mlx_engine._version import __version__

    pyproject = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    releases = re.findall(r"^## \[(\d[^\]]*)\] - \d{4}-\d\d-\d\d$", (REPO / "CHANGELOG.md").read_text(), re.M)
    assert pyproject == __version__ == releases[0]
    from mlx_engine.__main__ import main

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"mlx-engine {__version__}"
