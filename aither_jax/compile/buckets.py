"""Shape buckets: every step call is padded to one of a few sizes, so sequences join and leave
between steps without recompiling."""

from __future__ import annotations

import math


def bucket(n: int, minimum: int, maximum: int) -> int:
    """Smallest power of two >= n, clamped to [minimum, maximum]."""
    return max(minimum, min(maximum, 1 << max(0, math.ceil(math.log2(max(n, 1))))))


def page_bucket(n: int, minimum: int, maximum: int) -> int:
    """Smallest of 1, 2, 4, 6, 8, 12, 16, 24, 32, 48, ... (powers of two and, from 6 up, the
    halfway points 3 * 2^k) >= n, clamped to [minimum, maximum]: how many pages a step reads per row.

    Attention reads every page of the bucket, masked or not. Power-of-two steps read up to
    twice the pages the longest row needs, a third more on average over context lengths;
    halfway steps bring that to 1.5x and a sixth, for twice as many compiled decode shapes.
    """
    power = bucket(n, 1, 1 << 62)
    if power >= 8 and 4 * max(n, 1) <= 3 * power:
        power = 3 * power // 4
    return max(minimum, min(maximum, power))
