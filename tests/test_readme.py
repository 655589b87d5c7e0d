"""The manual's Python API block (docs/python-api.md) runs as written (the embedded model) and stops at the end of
the answer."""

import contextlib
import io
import re
from pathlib import Path


def test_the_api_block_runs_and_stops_at_the_end_of_the_answer():
    page = (Path(__file__).parent.parent / "docs" / "python-api.md").read_text()
    section = page[page.index("# The Python API"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: dict = {}
    with contextlib.redirect_stdout(io.StringIO()) as out:
        exec(compile(code, "docs/python-api.md", "exec"), scope)
    stats = scope["engine"].stats
    assert scope["tokens"][-1] in scope["stop"] and stats.generated == len(scope["tokens"]) < 128
    assert out.getvalue().strip()
