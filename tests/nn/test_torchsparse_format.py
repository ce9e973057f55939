"""numba_sc.nn.torchsparse_format: TorchSparse's weights (its kernel-offset order) to ours and back,
and rename= (numba_sc.nn.checkpoint_keys) for checkpoints whose module names differ, in both
converters. NumPy only: runs without PyTorch."""
import numpy as np
import pytest

import numba_sc as ns
from numba_sc.nn import models
from numba_sc.nn.checkpoint_keys import rename_keys
from numba_sc.nn.spconv_format import state_dict_from_spconv, state_dict_to_spconv
from numba_sc.nn.torchsparse_format import (conv_weight_from_torchsparse, conv_weight_to_torchsparse,
                                            state_dict_from_torchsparse, state_dict_to_torchsparse,
                                            torchsparse_offsets)


def _rows_follow_offsets(ours, ts, kernel_size):
    """True when every row of ``ours`` is TorchSparse's row of the same offset."""
    mine, theirs = ns.kernel_offsets(kernel_size).tolist(), torchsparse_offsets(kernel_size).tolist()
    return all(np.array_equal(ours[i], ts[theirs.index(off)]) for i, off in enumerate(mine))


def test_torchsparse_offsets_are_its_documented_order():
    # get_kernel_offsets(3): x fastest; (2): x slowest, values 0..1 per axis
    assert torchsparse_offsets(3).tolist()[:4] == [[-1, -1, -1], [0, -1, -1], [1, -1, -1], [-1, 0, -1]]
    assert torchsparse_offsets(2).tolist()[:3] == [[0, 0, 0], [0, 0, 1], [0, 1, 0]]
    assert sorted(map(tuple, torchsparse_offsets(3).tolist())) == sorted(map(tuple, ns.kernel_offsets(3).tolist()))


@pytest.mark.parametrize("ks", [3, 2, (1, 3, 1), (3, 1, 3), 5, 1])
def test_each_row_lands_on_the_same_offset_and_back(ks):
    K = int(np.prod(np.broadcast_to(ks, 3)))
    ts = np.random.default_rng(0).standard_normal((K, 2, 3)).astype(np.float32)
    ours = conv_weight_from_torchsparse(ts, ks)
    assert _rows_follow_offsets(ours, ts, ks)
    np.testing.assert_array_equal(conv_weight_to_torchsparse(ours, ks, pointwise=False), ts)
    if K % 2 and sum(k > 1 for k in np.broadcast_to(ks, 3)) > 1:
        # an odd kernel over two axes or more is a real permutation: a copy would be wrong, and the
        # check above sees it (a (1, 3, 1) or 1x1x1 kernel is the same in both orders)
        assert not _rows_follow_offsets(ts, ts, ks)


def test_the_worked_example_and_the_pointwise_shape():
    ts = np.arange(27, dtype=np.float32).reshape(27, 1, 1)
    assert conv_weight_from_torchsparse(ts, 3)[1, 0, 0] == 9  # the module docstring's example
    one = np.ones((4, 5), np.float32)  # TorchSparse's (C_in, C_out) for a 1x1x1 kernel
    assert conv_weight_from_torchsparse(one, 1).shape == (1, 4, 5)
    assert conv_weight_to_torchsparse(np.ones((1, 4, 5)), 1).shape == (4, 5)
    with pytest.raises(ValueError, match=r"\(27, C_in, C_out\)"):
        conv_weight_from_torchsparse(np.ones((8, 2, 3)), 3)


def test_a_whole_network_round_trips_and_a_renamed_checkpoint_loads():
    model = models.MinkUNet42(4, 5, width=0.125, seed=1)
    ts = state_dict_to_torchsparse(model)
    assert "stem.0.kernel" in ts and "stem.0.weight" not in ts and ts["classifier.weight"].shape == (5, 12)
    # a training script's names: a prefix, and another name for the stem
    theirs = {("net." + k).replace("net.stem.", "net.conv_in."): v for k, v in ts.items()}
    theirs["net.optimizer_step"] = np.zeros(())  # something the model has no place for
    with pytest.raises(KeyError, match="no 'stem.0.weight'.*rename="):
        state_dict_from_torchsparse(model, theirs)
    rename = {r"^net\.": "", r"^conv_in\.": "stem.", r"^optimizer_step$": "drop"}
    with pytest.raises(KeyError, match="no place for: \\['drop'\\]"):
        state_dict_from_torchsparse(model, theirs, rename=rename)
    state = state_dict_from_torchsparse(
        model, theirs, rename=lambda k: None if k.endswith("optimizer_step") else
        k.removeprefix("net.").replace("conv_in.", "stem."))
    fresh = models.MinkUNet42(4, 5, width=0.125, seed=7)
    fresh.load_state_dict(state)
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(fresh.state_dict()[k], v, err_msg=k)


def test_spconv_converter_takes_rename_too():
    model = models.SparseResNet21(4, width=0.25, seed=1)
    theirs = {"backbone." + k: v for k, v in state_dict_to_spconv(model).items()}
    with pytest.raises(KeyError, match="rename="):
        state_dict_from_spconv(model, theirs)
    state = state_dict_from_spconv(model, theirs, rename={r"^backbone\.": ""})
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(state[k], v, err_msg=k)


def test_rename_keys_refuses_collisions_and_bad_rules():
    with pytest.raises(ValueError, match="maps both 'a.x' and 'b.x' to 'x'"):
        rename_keys({"a.x": 1, "b.x": 2}, {r"^\w\.": ""})
    with pytest.raises(ValueError, match="not a regular expression"):
        rename_keys({"a": 1}, {"(": ""})
    with pytest.raises(TypeError, match="callable .* or a dict"):
        rename_keys({"a": 1}, ["a"])
    assert rename_keys({"a": 1, "b": 2}, lambda k: None if k == "a" else k + "!") == {"b!": 2}
