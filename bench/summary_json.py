"""The ending the bench scripts share: print a summary, optionally save it with its rows."""
from __future__ import annotations

import json
from typing import Any


def emit(summary: dict[str, Any], rows: Any, path: str | None) -> None:
    """Print `summary` as indented JSON; with `path`, also write {"summary", "rows"} there."""
    print(json.dumps(summary, indent=2))
    if path:
        with open(path, "w") as f:
            json.dump({"summary": summary, "rows": rows}, f, indent=1)
