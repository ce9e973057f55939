"""SparseResNet21 and MinkUNet42 as ``torch.nn.Module`` s, built from :mod:`numba_sc.nn.torch_layers`.

Optional: needs PyTorch. The same networks as :mod:`numba_sc.nn.models` (whose docstring
draws them), module for module and name for name, so that a numba-sc model's
``state_dict()`` (NumPy arrays) loads into its torch twin, and the twin's back into it::

    import numba_sc as ns
    from numba_sc.nn.torch_models import TorchMinkUNet42
    from numba_sc.nn.torch_layers import TorchSparseTensor

    ours = ns.nn.models.MinkUNet42(4, 19)                 # or one trained with numba_sc.train
    net = TorchMinkUNet42(4, 19)
    net.load_state_dict(ours.state_dict())                # NumPy arrays accepted
    logits = net(TorchSparseTensor.from_coords(coords, feats)).features

Then train it with ``torch.optim`` and ``torch.autocast`` as any torch model;
``numba_sc_state_dict()`` hands the weights back to :mod:`numba_sc.nn.models`.
A spconv or TorchSparse checkpoint goes through :mod:`numba_sc.nn.spconv_format` or
:mod:`numba_sc.nn.torchsparse_format` first (layouts, and names with ``rename=``).
"""
from __future__ import annotations

import numpy as np
import torch

from ..core.conventions import positive_int
from .models import scaled_channels
from .torch_layers import (Add, BatchNorm, Cat, Identity, Linear, ReLU, SparseConv3d, SparseInverseConv3d,
                           SubMConv3d, TorchSparseTensor, numpy_state)

__all__ = ["TorchMinkUNet42", "TorchSparseResNet21"]


def _conv(in_ch, out_ch, kernel_size, stride):
    if np.all(np.asarray(stride) == 1):
        return SubMConv3d(in_ch, out_ch, kernel_size)
    return SparseConv3d(in_ch, out_ch, kernel_size, stride)


def conv_block(in_ch, out_ch, kernel_size=3, stride=1):
    """Convolution, BatchNorm, ReLU (``[0]`` is the convolution), as ``models.ConvBlock``."""
    return torch.nn.Sequential(_conv(in_ch, out_ch, kernel_size, stride), BatchNorm(out_ch), ReLU())


class ResidualBlock(torch.nn.Module):
    """``relu(main(x) + shortcut(x))``; ``main`` = conv, BN, ReLU, conv, BN (submanifold),
    the shortcut the input or a 1x1x1 convolution and a BN, as ``models.ResidualBlock``."""

    def __init__(self, in_ch, out_ch, kernel_size=3):
        super().__init__()
        self.main = torch.nn.Sequential(SubMConv3d(in_ch, out_ch, kernel_size), BatchNorm(out_ch), ReLU(),
                                        SubMConv3d(out_ch, out_ch, kernel_size), BatchNorm(out_ch))
        self.shortcut = (Identity() if in_ch == out_ch else
                         torch.nn.Sequential(SubMConv3d(in_ch, out_ch, 1), BatchNorm(out_ch)))
        self.add = Add(relu=True)

    def forward(self, x):
        return self.add(self.main(x), self.shortcut(x))


class _Twin(torch.nn.Module):
    """What both networks share with their numba-sc twins: their state dicts."""

    def load_state_dict(self, state, strict=True, assign=False):
        """``torch.nn.Module.load_state_dict``, taking NumPy (or CuPy) arrays too: a
        :mod:`numba_sc.nn.models` network's ``state_dict()`` as it is."""
        return super().load_state_dict(numpy_state(state), strict=strict, assign=assign)

    def numba_sc_state_dict(self) -> dict:
        """The parameters and statistics as NumPy arrays, for the numba-sc twin's
        ``load_state_dict``."""
        return {k: v.detach().cpu().numpy() for k, v in self.state_dict().items()}

    def _input(self, x):
        if not isinstance(x, TorchSparseTensor):
            raise TypeError(f"{type(self).__name__} takes a numba_sc.nn.torch_layers.TorchSparseTensor, got "
                            f"{type(x).__name__}; make one with TorchSparseTensor.from_coords(coords, features)")
        return x


class TorchSparseResNet21(_Twin):
    """:class:`numba_sc.nn.models.SparseResNet21` in torch: 21 convolutions, the same
    parameter names; ``width`` scales the channels. Initial weights from torch's
    generator (``torch.manual_seed``)."""

    def __init__(self, in_channels=4, width=1.0):
        super().__init__()
        cs = scaled_channels([16, 32, 64, 128], width)
        self.in_channels = positive_int(in_channels, "in_channels")
        c = self.in_channels
        for name, out, stride in zip(("stem", "stage1", "stage2", "stage3"), cs, (1, 2, 2, 2)):
            setattr(self, name, torch.nn.Sequential(conv_block(c, out, 3, stride), ResidualBlock(out, out, 3),
                                                    ResidualBlock(out, out, 3)))
            c = out
        self.stage4 = conv_block(c, c, (1, 3, 1), (1, 2, 1))

    def forward(self, x):
        return self.stage4(self.stage3(self.stage2(self.stage1(self.stem(self._input(x))))))


class TorchMinkUNet42(_Twin):
    """:class:`numba_sc.nn.models.MinkUNet42` in torch: 42 convolutions and a linear
    classifier on every voxel, the same parameter names; ``width`` scales the channels.
    Returns the logits on the input's coordinates."""

    def __init__(self, in_channels=4, num_classes=19, width=1.0):
        super().__init__()
        cs = scaled_channels([32, 32, 64, 128, 256, 256, 128, 96, 96], width)
        self.in_channels = positive_int(in_channels, "in_channels")
        self.num_classes = positive_int(num_classes, "num_classes")
        self.stem = torch.nn.Sequential(SubMConv3d(in_channels, cs[0], 3), BatchNorm(cs[0]), ReLU(),
                                        SubMConv3d(cs[0], cs[0], 3), BatchNorm(cs[0]), ReLU())
        for i in range(4):  # stage i+1: down to stride 2^(i+1), then two residual blocks
            setattr(self, f"stage{i + 1}", torch.nn.Sequential(
                conv_block(cs[i], cs[i], 2, 2), ResidualBlock(cs[i], cs[i + 1], 3),
                ResidualBlock(cs[i + 1], cs[i + 1], 3)))
        skips = [cs[3], cs[2], cs[1], cs[0]]
        for i in range(4):  # up i+1 inverts stage 4-i's strided convolution (kernel 2, stride 2)
            setattr(self, f"up{i + 1}", torch.nn.Sequential(SparseInverseConv3d(cs[i + 4], cs[i + 5], 2, 2),
                                                            BatchNorm(cs[i + 5]), ReLU()))
            setattr(self, f"dec{i + 1}", torch.nn.Sequential(
                ResidualBlock(cs[i + 5] + skips[i], cs[i + 5], 3), ResidualBlock(cs[i + 5], cs[i + 5], 3)))
        self.cat = Cat()
        self.classifier = Linear(cs[8], num_classes)

    def forward(self, x):
        x0 = self.stem(self._input(x))
        x1 = self.stage1(x0)
        x2 = self.stage2(x1)
        x3 = self.stage3(x2)
        y = self.stage4(x3)
        for i, skip in enumerate((x3, x2, x1, x0)):
            up = getattr(self, f"up{i + 1}")(y)
            y = getattr(self, f"dec{i + 1}")(self.cat(up, skip))
        return self.classifier(y)
