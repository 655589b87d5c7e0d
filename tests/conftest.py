import sys
from pathlib import Path

import mlx_engine  # noqa: F401  (loads OpenBLAS before mlx)

sys.path.insert(0, str(Path(__file__).parent))
