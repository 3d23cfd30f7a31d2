"""Records the arguments each rank was started with: argv_job.py OUT_DIR ARGS...

Every rank writes OUT_DIR/argv{RANK}.json, the list of ARGS exactly as it received them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
(out / f"argv{os.environ['RANK']}.json").write_text(json.dumps(sys.argv[2:]))
