__version__ = "0.2.0"  # the one version: pyproject.toml, --version and CHANGELOG.md agree (tests/test_version.py)
