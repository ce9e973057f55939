"""Networks: layers that hold their weights, the kernels between the convolutions, two models.

Its modules::

    layers           SubMConv3d, SparseConv3d, SparseInverseConv3d, BatchNorm, ReLU, Linear,
                     Sequential, add, cat; maps kept on the tensors and reused
    tape             Tape: records each layer's backward step in the forward pass, plays them back
    pointwise        the kernels between convolutions: BatchNorm (+ residual, + ReLU), add, concat
    models           SparseResNet21 and MinkUNet42, the two networks of the paper's evaluation
    spconv_format    weights from and to spconv's (C_out, kx, ky, kz, C_in) layout
    torchsparse_format  weights from and to TorchSparse's (K, C_in, C_out), its offset order
    checkpoint_keys  rename= for the converters: checkpoints whose module names differ
    torch_adapter    (optional, needs PyTorch) a sparse convolution as a torch.autograd.Function
    torch_layers     (optional) every layer kind as a torch.nn.Module on a TorchSparseTensor
    torch_models     (optional) SparseResNet21 and MinkUNet42 in torch, loading numba-sc's state dicts

The layers are importable from here: ``numba_sc.nn.SubMConv3d``, ``numba_sc.nn.Tape``, ...
"""
from .tape import Tape
from .layers import (BatchNorm, ConvLayer, Identity, Linear, Module, ReLU, Sequential, SparseConv3d,
                     SparseInverseConv3d, SubMConv3d, add, cat, current_backend, observe)

__all__ = ["BatchNorm", "ConvLayer", "Identity", "Linear", "Module", "ReLU", "Sequential", "SparseConv3d",
           "SparseInverseConv3d", "SubMConv3d", "Tape", "add", "cat", "current_backend", "observe"]
