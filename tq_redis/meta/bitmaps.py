"""Redis bitmaps (``GET`` of a key written with SETBIT/BITFIELD) as numpy arrays and id lists.

Bit ``i`` of a Redis bitmap is the ``i % 8``-th most significant bit of byte ``i // 8``, which is
numpy's ``unpackbits`` order.
"""

from __future__ import annotations

import numpy as np


def unpack(raw: bytes | None) -> np.ndarray:
    """The bitmap as a bool array (empty for a missing key)."""
    if not raw:
        return np.zeros(0, dtype=bool)
    return np.unpackbits(np.frombuffer(raw, dtype=np.uint8)).astype(bool)


def set_ids(raw: bytes | None) -> list[int]:
    """The positions of the set bits, ascending."""
    return np.flatnonzero(unpack(raw)).tolist()
