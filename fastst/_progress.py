"""Progress bars over bytes, drawn by tqdm (the `progress` extra) on a terminal."""
from __future__ import annotations

import sys
from typing import Any, Optional


def byte_bar(total: int, desc: str) -> Optional[Any]:
    """A tqdm bar over `total` bytes, whose ``update(nbytes)`` counts work done;
    None when stderr is not a terminal or tqdm is not installed."""
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm  # type: ignore[import-untyped, unused-ignore]
    except ImportError:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                leave=False)
