"""The clock of bench/loader.py's rows a second, shared with the peers it runs in
environments of their own (bench/peers/): it imports nothing beyond the standard
library."""
from __future__ import annotations

import time
from typing import Any, Iterable


def timed_rows(batches: Iterable[Any], batch: int, rows: int, warmup: int = 2) -> float:
    """Rows a second of an iterable of batches, from the end of the first `warmup`
    (start-up not timed; 0: from the start, start-up included) until `rows` rows more
    have come."""
    received, start = 0, time.perf_counter()
    for k, _ in enumerate(batches):
        if k < warmup:
            if k + 1 == warmup:
                start = time.perf_counter()
            continue
        received += batch
        if received >= rows:
            break
    return received / (time.perf_counter() - start)
