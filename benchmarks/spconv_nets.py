"""spconv 2.3.8 twins of :mod:`numba_sc.nn.models`: the same layers, the same parameter names.

Needs PyTorch and spconv (the GPU machine; never CI). A twin's ``state_dict()``
has exactly the names of the numba-sc model, so weights move between the two
with :func:`numba_sc.nn.spconv_format.state_dict_to_spconv` /
``state_dict_from_spconv``.

How each layer is written, as a spconv user who wants speed would write it:

* submanifold convolutions share one ``indice_key`` per level (``subm0``, ...),
  so a level builds its indice pairs once, encoder and decoder alike;
* the strided convolution of level i has the key ``down{i}``, and the
  ``SparseInverseConv3d`` that inverts it names the same key (its pairs, read
  backwards);
* 1x1x1 convolutions (the residual shortcuts) are ``SubMConv3d(kernel_size=1)``,
  which spconv runs as a plain matrix product (no pairs);
* BatchNorm and ReLU are PyTorch's, applied to the features by
  ``SparseSequential``.

Downsampling. numba-sc follows the Minkowski convention: a stride-2 layer's
outputs are ``floor(P / 2) * 2``. For kernel 2 (MinkUNet42) spconv's outputs
with padding 0 are exactly those. For kernel 3 with padding 1 (SparseResNet21)
spconv produces more: every output whose 3-wide window holds an input, a
superset. The values it computes at the shared coordinates are the same sums
(output ``o`` reads inputs ``2o - 1 .. 2o + 1`` either way), so :class:`Select`
keeps the rows at this library's coordinates: spconv then runs the same network,
plus the selection (a few library calls per strided layer), and its strided
layers compute the extra outputs too (178k where ours has 69k on
SemanticKITTI's first one): the price of that layer in spconv.
"""
from __future__ import annotations

import numpy as np
import torch
import spconv.pytorch as spconv
from spconv.core import ConvAlgo
from torch import nn


def _subm(cin, cout, k, key, algo):
    return spconv.SubMConv3d(cin, cout, k, bias=False, indice_key=key, algo=algo)


class ConvBlock(spconv.SparseSequential):
    def __init__(self, conv, cout):
        super().__init__(conv, nn.BatchNorm1d(cout), nn.ReLU(inplace=True))


class ResidualBlock(spconv.SparseModule):  # (a SparseModule gets the tensor, not its features)
    def __init__(self, cin, cout, k, key, algo):
        super().__init__()
        self.main = spconv.SparseSequential(
            _subm(cin, cout, k, key, algo), nn.BatchNorm1d(cout), nn.ReLU(inplace=True),
            _subm(cout, cout, k, key, algo), nn.BatchNorm1d(cout))
        self.shortcut = (spconv.SparseSequential() if cin == cout else
                         spconv.SparseSequential(spconv.SubMConv3d(cin, cout, 1, bias=False, algo=algo),
                                                 nn.BatchNorm1d(cout)))

    def forward(self, x):
        out = self.main(x)
        sc = self.shortcut(x)
        return out.replace_feature(torch.relu(out.features + sc.features))


class Select(spconv.SparseModule):
    """After a strided conv: keep the rows of spconv's output at ``floor(P / s)``, P the
    conv's input (the Minkowski outputs), in lexicographic order. Worked out at every
    call, from the indices alone (spconv's output order is not the same from call to
    call): a unique, a sort and a binary search of the keys, a row gather."""

    def __init__(self, stride):
        super().__init__()
        self.register_buffer("stride", torch.tensor(stride, dtype=torch.int32), persistent=False)

    def forward(self, y, fine_indices):
        want = fine_indices.clone()
        want[:, 1:] = torch.div(want[:, 1:], self.stride, rounding_mode="floor")
        kw = torch.unique(_keys(want))  # sorted
        ko = _keys(y.indices)
        order = torch.argsort(ko)
        rows = order[torch.searchsorted(ko[order], kw)]
        t = spconv.SparseConvTensor(y.features[rows], y.indices[rows], y.spatial_shape, y.batch_size)
        t.indice_dict = y.indice_dict  # (the maps built so far travel on, as in any layer)
        return t


class SparseResNet21(nn.Module):
    """``select=False``: spconv's own downsampling (every output its kernel-3 windows
    reach), a different network with more voxels, timed for context only."""

    def __init__(self, in_channels=4, width=1.0, algo=ConvAlgo.Native, select=True):
        super().__init__()
        self.select = select
        cs = [max(1, int(round(c * width))) for c in (16, 32, 64, 128)]
        c = in_channels
        for i, (out, stride) in enumerate(zip(cs, (1, 2, 2, 2))):
            if stride == 1:
                conv = _subm(c, out, 3, "subm0", algo)
            else:
                conv = spconv.SparseConv3d(c, out, 3, 2, padding=1, bias=False, indice_key=f"down{i}",
                                           algo=algo)
            stage = spconv.SparseSequential(ConvBlock(conv, out),
                                            ResidualBlock(out, out, 3, f"subm{i}", algo),
                                            ResidualBlock(out, out, 3, f"subm{i}", algo))
            setattr(self, ["stem", "stage1", "stage2", "stage3"][i], stage)
            c = out
        self.stage4 = ConvBlock(spconv.SparseConv3d(c, c, (1, 3, 1), (1, 2, 1), padding=(0, 1, 0), bias=False,
                                                    indice_key="down4", algo=algo), c)
        self.selects = nn.ModuleList([Select(s) for s in ((2, 2, 2),) * 3 + ((1, 2, 1),)])

    def forward(self, x):
        x = self.stem(x)
        for i, stage in enumerate((self.stage1, self.stage2, self.stage3)):
            block = stage[0]  # strided conv, BatchNorm, ReLU
            x = self._cut(i, block[0](x), x)  # spconv's superset, cut to the Minkowski outputs
            x = _bn_relu(block, x)
            x = stage[2](stage[1](x))
        x = self._cut(3, self.stage4[0](x), x)
        return _bn_relu(self.stage4, x)

    def _cut(self, i, y, x):
        return self.selects[i](y, x.indices) if self.select else y


def _bn_relu(block, x):
    """A ConvBlock's BatchNorm and ReLU on x's features."""
    return x.replace_feature(block[2](block[1](x.features)))


class MinkUNet42(nn.Module):
    def __init__(self, in_channels=4, num_classes=19, width=1.0, algo=ConvAlgo.Native):
        super().__init__()
        cs = [max(1, int(round(c * width))) for c in (32, 32, 64, 128, 256, 256, 128, 96, 96)]
        self.stem = spconv.SparseSequential(
            _subm(in_channels, cs[0], 3, "subm0", algo), nn.BatchNorm1d(cs[0]), nn.ReLU(inplace=True),
            _subm(cs[0], cs[0], 3, "subm0", algo), nn.BatchNorm1d(cs[0]), nn.ReLU(inplace=True))
        for i in range(4):
            down = spconv.SparseConv3d(cs[i], cs[i], 2, 2, bias=False, indice_key=f"down{i + 1}", algo=algo)
            setattr(self, f"stage{i + 1}", spconv.SparseSequential(
                ConvBlock(down, cs[i]), ResidualBlock(cs[i], cs[i + 1], 3, f"subm{i + 1}", algo),
                ResidualBlock(cs[i + 1], cs[i + 1], 3, f"subm{i + 1}", algo)))
        skips = [cs[3], cs[2], cs[1], cs[0]]
        for i in range(4):
            level = 3 - i  # the level this up layer returns to
            inv = spconv.SparseInverseConv3d(cs[i + 4], cs[i + 5], 2, indice_key=f"down{level + 1}",
                                             bias=False, algo=algo)
            setattr(self, f"up{i + 1}", ConvBlock(inv, cs[i + 5]))
            setattr(self, f"dec{i + 1}", spconv.SparseSequential(
                ResidualBlock(cs[i + 5] + skips[i], cs[i + 5], 3, f"subm{level}", algo),
                ResidualBlock(cs[i + 5], cs[i + 5], 3, f"subm{level}", algo)))
        self.classifier = nn.Linear(cs[8], num_classes)

    def forward(self, x):
        x0 = self.stem(x)
        x1 = self.stage1(x0)
        x2 = self.stage2(x1)
        x3 = self.stage3(x2)
        y = self.stage4(x3)
        for i, skip in enumerate((x3, x2, x1, x0)):
            up = getattr(self, f"up{i + 1}")(y)
            y = getattr(self, f"dec{i + 1}")(up.replace_feature(torch.cat([up.features, skip.features], 1)))
        return y.replace_feature(self.classifier(y.features))


# ------------------------------------------------------------------ inputs
LEVELS = 64  # coordinates shifted to a multiple of this, so that floor(i / 2) agrees at every level


def spconv_input(coords, feats):
    """(indices (N, 4) int32 torch on the GPU, spatial shape) of int32 coords (N, 3),
    shifted to non-negative indices whose origin is a multiple of LEVELS."""
    lo = (coords.min(0) // LEVELS) * LEVELS
    idx = coords - lo
    spatial = (((idx.max(0) + 1) // LEVELS + 1) * LEVELS).tolist()
    ind = np.concatenate([np.zeros((len(idx), 1), np.int32), idx.astype(np.int32)], 1)
    return torch.from_numpy(ind).cuda(), spatial, lo


def _keys(ind):
    """One int64 per (batch, x, y, z) row, in lexicographic order."""
    t = ind.long()
    return ((t[:, 0] << 14 | t[:, 1]) << 14 | t[:, 2]) << 14 | t[:, 3]
