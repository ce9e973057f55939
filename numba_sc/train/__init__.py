"""Training: losses, optimizers, labels, the loop (the convolution's own gradient is the
layer's, :mod:`numba_sc.conv.gradient`; the tape that plays each layer's backward step is
:mod:`numba_sc.nn.tape`). Its modules::

    loss            cross-entropy and its gradient
    optim           SGD and AdamW, in place; learning-rate schedules
    labels          SemanticKITTI's label ids, classes, per-voxel labels and scores
    checkpoint      save / load: a model's and an optimizer's state in one .npz file
    loop            one training step, fitting a network to a labelled scan, the checkerboard
                    split, evaluation (per-class IoU)
    data            scans from disk (SemanticKITTI's layout or .bin/.label pairs), batches, a loader
    augment         rotation, flips, scaling, jitter, crop: random, reproducible from a seed
    run             training over a dataset: prepared scans, epochs, evaluation, resume, the log
    amp             mixed precision: float16 compute, float32 master weights, dynamic loss scaling
    parallel        data parallel over NCCL: communicators, gradient buckets, synced BatchNorm,
                    sharded batches, the launcher (one process per GPU; several machines)
    trainer         one step with amp and/or a communicator

The loop's functions are importable from here: ``numba_sc.train.scan_tensor``, ...
"""
from .loop import checkerboard, evaluate, fit_scan, iou_table, predict, scan_tensor, scores, train_step

__all__ = ["checkerboard", "evaluate", "fit_scan", "iou_table", "predict", "scan_tensor", "scores", "train_step"]
