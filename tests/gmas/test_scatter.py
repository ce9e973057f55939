"""The scatter (stage 10). Every tile size, bit for bit against the reference, is
checked beside the gather in test_gather.py (``test_every_tile_size``); the word
views it reads are checked in test_words.py."""
import numpy as np

from numba_sc.core.backend import to_host


def test_public_scatter_leaves_init_untouched():
    from numba_sc.gmas.scatter import scatter

    obuf = np.arange(12, dtype=np.float32).reshape(6, 2)
    table = np.array([[0, 3], [1, -1], [2, 5]], dtype=np.int32)
    init = np.ones((3, 2), np.float32)
    for backend in ("cuda", "reference"):
        out = to_host(scatter(obuf, table, init, backend=backend))
        assert np.array_equal(init, np.ones((3, 2), np.float32))
        assert np.array_equal(out, 1 + np.array([[6, 8], [2, 3], [14, 16]], np.float32))
