"""numba_sc.core.words: word views and the lane unpacking the scatter uses.

The scatter test in gmas/test_gather.py (``test_every_tile_size``) checks the kernel end to end on every tile; these
check the pieces by hand, with the worked example of the module docstring.
"""
import numpy as np
import pytest

from numba_sc.core.device import simulating
from numba_sc.core.words import lane_codec, lanes, pack_reference, row_words, unpack_reference, word_view


def test_word_view_picks_the_widest_word():
    assert word_view(2, 8) == (np.int64, 2)  # 16 bytes: two 8-byte words
    assert word_view(2, 6) == (np.int32, 3)  # 12 bytes: three 4-byte words
    assert word_view(2, 3) == (None, 3)  # 6 bytes: channel by channel
    assert word_view(4, 3) == (np.int32, 3)
    assert word_view(4, 2) == (np.int64, 1)
    assert row_words(2, 8, 128) == (np.int64, 2, 32)  # a 256-byte row is 32 words
    assert row_words(2, 3, 33) == (None, 3, 33)
    assert lanes(np.int64, 2) == 4 and lanes(np.int32, 4) == 1 and lanes(None, 2) == 1


@pytest.mark.skipif(not simulating(), reason="device functions are called from Python only under the simulator")
def test_lanes_of_the_docstring_example_and_round_trips():
    lane, packed = lane_codec(np.int64, 2)
    word = np.int64(0x0000_3800_C000_3C00)
    assert [float(lane(word, np.uint64(m))) for m in range(4)] == [1.0, -2.0, 0.5, 0.0]
    assert unpack_reference(np.array([word]), 2).tolist() == [1.0, -2.0, 0.5, 0.0]
    rng = np.random.default_rng(0)
    for word_t, item, dt in ((np.int64, 2, np.float16), (np.int32, 2, np.float16),
                             (np.int64, 4, np.float32), (np.int32, 4, np.float32)):
        lane, packed = lane_codec(word_t, item)
        n = lanes(word_t, item)
        vals = np.concatenate([rng.standard_normal(n - 1) * 100, [-6e-8]]).astype(np.float32)
        w = packed(vals, np.uint64(0))
        assert np.asarray(w).dtype == word_t
        want = pack_reference(vals, word_t, item)  # rounded to the channels' dtype (nearest even)
        assert want.shape == (1,) and want.dtype == word_t
        assert np.asarray(w).tobytes() == want.tobytes()  # lane 0 is the lowest address
        assert np.asarray(w).tobytes() == vals.astype(dt).tobytes()  # ... and the reference is NumPy's bytes
        got = np.array([lane(w, np.uint64(m)) for m in range(n)], dtype=np.float32)
        np.testing.assert_array_equal(got, unpack_reference(want, item))
        np.testing.assert_array_equal(got, vals.astype(dt).astype(np.float32))
