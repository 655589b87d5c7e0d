"""The package keeps the design's floors: no import cycle, no arrow from a lower floor to a higher one
(commands -> core -> drafters -> target -> kernels/models/sampling -> base), read from the source by
scripts/import_graph.py (every import counts, at module level or inside a function)."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "import_graph.py"


def _graph_module():
    spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_no_import_cycle():
    ig = _graph_module()
    assert ig.cycles(ig.graph()) == []


def test_imports_run_down_the_floors():
    ig = _graph_module()
    g = ig.graph()
    assert all(ig.layer_of(m) is not None for m in g if m.startswith("mlx_engine")), \
        [m for m in g if m.startswith("mlx_engine") and ig.layer_of(m) is None]
    assert ig.upward(g) == []
