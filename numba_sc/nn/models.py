"""The two networks of the Minuet paper's evaluation (Section 6), built from :mod:`numba_sc.nn`.

**SparseResNet21** (the paper's *ResNet*; the sparse backbone of the
CenterPoint detector, as TorchSparse's ``SparseResNet21D`` defines it): five
stages, 21 convolutions::

    stem    conv 3 (in -> 16)          + 2 residual blocks of 16      5 convolutions
    stage1  conv 3, stride 2 (-> 32)   + 2 residual blocks of 32      5
    stage2  conv 3, stride 2 (-> 64)   + 2 residual blocks of 64      5
    stage3  conv 3, stride 2 (-> 128)  + 2 residual blocks of 128     5
    stage4  conv (1, 3, 1), stride (1, 2, 1), 128 -> 128             1

**MinkUNet42** (the paper's *UNet*; the MinkowskiNet U-Net that SPVNAS and
TorchSparse use for SemanticKITTI segmentation): 42 convolutions of kernel 2
or 3 (and 7 pointwise ones in residual shortcuts), channels
``[32, 32, 64, 128, 256, 256, 128, 96, 96]``::

    stem      conv 3 (in -> 32), conv 3 (32 -> 32)                   stride 1
    stage1-4  conv 2 stride 2, then 2 residual blocks                stride 2, 4, 8, 16
    up1-4     transposed conv 2 (inverting stage4-1's strided conv)  stride 8, 4, 2, 1
    dec1-4    [up | the encoder's tensor of that level] -> 2 residual blocks
    classifier  linear, 96 -> num_classes, on every voxel

A *residual block* is ``relu(bn(conv(relu(bn(conv(x))))) + shortcut(x))``,
where the shortcut is the input itself, or a 1x1x1 convolution and a BatchNorm
when the channels change. Every convolution is followed by BatchNorm (and ReLU
but for the second of a block, whose ReLU comes after the add).

Strided convolutions follow the Minkowski convention of this library (outputs
at ``floor(P / s) * s``, as in Minuet and TorchSparse's ``"minkowski"``
downsampling). For kernel 2 and stride 2 that is also spconv's output set; a
kernel-3 stride-2 layer in spconv (padding 1) produces more output
coordinates, a superset of these (``benchmarks/spconv_nets.py`` restricts them
to compare).

Both are called on a :class:`numba_sc.SparseTensor` and return one:
SparseResNet21 its last stage (stride (8, 16, 8)), MinkUNet42 one row of
``num_classes`` logits per input voxel, on the input's coordinates.
"""
from __future__ import annotations

import numpy as np

from ..core.conventions import positive_int, whole_number
from .layers import (BatchNorm, Identity, Linear, Module, ReLU, Sequential, SparseConv3d,
                 SparseInverseConv3d, SubMConv3d, cat)


def _conv(in_ch, out_ch, kernel_size, stride, rng):
    if np.all(np.asarray(stride) == 1):
        return SubMConv3d(in_ch, out_ch, kernel_size, rng=rng)
    return SparseConv3d(in_ch, out_ch, kernel_size, stride, rng=rng)


class ConvBlock(Sequential):
    """Convolution, BatchNorm, ReLU (``[0]`` is the convolution)."""

    def __init__(self, in_ch, out_ch, kernel_size=3, stride=1, rng=None):
        super().__init__(_conv(in_ch, out_ch, kernel_size, stride, rng), BatchNorm(out_ch), ReLU())


class TransposedBlock(Sequential):
    """Transposed convolution inverting the strided convolution ``inverts``, BatchNorm, ReLU."""

    def __init__(self, in_ch, out_ch, inverts, rng=None):
        super().__init__(SparseInverseConv3d(in_ch, out_ch, inverts.kernel_size, inverts=inverts, rng=rng),
                         BatchNorm(out_ch), ReLU())


class ResidualBlock(Module):
    """``relu(main(x) + shortcut(x))``; ``main`` = conv, BN, ReLU, conv, BN (submanifold)."""

    def __init__(self, in_ch, out_ch, kernel_size=3, rng=None):
        super().__init__()
        self.main = Sequential(SubMConv3d(in_ch, out_ch, kernel_size, rng=rng), BatchNorm(out_ch), ReLU(),
                               SubMConv3d(out_ch, out_ch, kernel_size, rng=rng), BatchNorm(out_ch))
        self.shortcut = (Identity() if in_ch == out_ch else
                         Sequential(SubMConv3d(in_ch, out_ch, 1, rng=rng), BatchNorm(out_ch)))

    def forward(self, x):
        h = self.main(x, stop=4)  # conv, BN + ReLU (one kernel), conv
        # the last BatchNorm, the add and the ReLU in one kernel
        return self.main[4](h, residual=self.shortcut(x), relu=True)


def scaled_channels(base, width):
    """The channel counts ``base`` scaled by ``width`` (each at least 1)."""
    if isinstance(width, (bool, np.bool_)) or not isinstance(width, (int, float, np.integer, np.floating)) \
            or not 0 < width < float("inf"):
        raise ValueError(f"width must be a positive finite number (1.0: the paper's channels), got {width!r}")
    return [max(1, int(round(c * width))) for c in base]


def _weights_rng(seed):
    """The generator of a network's initial weights, from ``seed`` (an int >= 0)."""
    return np.random.default_rng(whole_number(seed, "seed"))


class SparseResNet21(Module):
    """The Minuet paper's *ResNet* (TorchSparse's ``SparseResNet21D``): 21 convolutions.

    ``width`` scales every channel count (0.25 gives 4, 8, 16, 32); ``seed``
    draws the initial weights (He normal; BatchNorm as the identity).
    """

    def __init__(self, in_channels=4, width=1.0, seed=0):
        super().__init__()
        rng = _weights_rng(seed)
        cs = scaled_channels([16, 32, 64, 128], width)
        self.in_channels = positive_int(in_channels, "in_channels")
        stages = []
        c = self.in_channels
        for out, stride in zip(cs, (1, 2, 2, 2)):
            stages.append(Sequential(ConvBlock(c, out, 3, stride, rng), ResidualBlock(out, out, 3, rng),
                                     ResidualBlock(out, out, 3, rng)))
            c = out
        self.stem, self.stage1, self.stage2, self.stage3 = stages
        self.stage4 = ConvBlock(c, c, (1, 3, 1), (1, 2, 1), rng)

    def forward(self, x):
        return self.stage4(self.stage3(self.stage2(self.stage1(self.stem(x)))))


class MinkUNet42(Module):
    """The Minuet paper's *UNet* (MinkowskiNet's MinkUNet as SPVNAS and TorchSparse
    define it): 42 convolutions, then a linear classifier on every voxel.

    ``width`` scales every channel count (SPVNAS's ``cr``); ``seed`` draws the
    initial weights.
    """

    def __init__(self, in_channels=4, num_classes=19, width=1.0, seed=0):
        super().__init__()
        rng = _weights_rng(seed)
        cs = scaled_channels([32, 32, 64, 128, 256, 256, 128, 96, 96], width)
        self.in_channels = positive_int(in_channels, "in_channels")
        self.num_classes = positive_int(num_classes, "num_classes")
        self.stem = Sequential(SubMConv3d(in_channels, cs[0], 3, rng=rng), BatchNorm(cs[0]), ReLU(),
                               SubMConv3d(cs[0], cs[0], 3, rng=rng), BatchNorm(cs[0]), ReLU())
        for i in range(4):  # stage i+1: down to stride 2^(i+1), then two residual blocks
            setattr(self, f"stage{i + 1}", Sequential(
                ConvBlock(cs[i], cs[i], 2, 2, rng), ResidualBlock(cs[i], cs[i + 1], 3, rng),
                ResidualBlock(cs[i + 1], cs[i + 1], 3, rng)))
        skips = [cs[3], cs[2], cs[1], cs[0]]  # the encoder's channels at each decoder level
        for i in range(4):  # up i+1 inverts stage 4-i's strided convolution
            down = getattr(self, f"stage{4 - i}")[0][0]
            setattr(self, f"up{i + 1}", TransposedBlock(cs[i + 4], cs[i + 5], down, rng))
            setattr(self, f"dec{i + 1}", Sequential(
                ResidualBlock(cs[i + 5] + skips[i], cs[i + 5], 3, rng),
                ResidualBlock(cs[i + 5], cs[i + 5], 3, rng)))
        self.classifier = Linear(cs[8], num_classes, rng=rng)

    def forward(self, x):
        x0 = self.stem(x)
        x1 = self.stage1(x0)
        x2 = self.stage2(x1)
        x3 = self.stage3(x2)
        y = self.stage4(x3)
        for i, skip in enumerate((x3, x2, x1, x0)):
            up = getattr(self, f"up{i + 1}")(y)
            y = getattr(self, f"dec{i + 1}")(cat(up, skip))
        return self.classifier(y)
