"""Scoring images with a model: ``predict_images`` (with test-time augmentation over the 8 dihedral transforms),
what ``train`` (evaluation), ``callbacks`` (the benchmarks' test curve) and ``predict`` share."""

from __future__ import annotations

import numpy as np


def dihedral(x: np.ndarray, k: int) -> np.ndarray:
    """One of the 8 symmetries of the square (k in 0..7) applied to a batch (N, H, W, C)."""
    if k & 4:
        x = x.transpose(0, 2, 1, 3)
    if k & 1:
        x = x[:, :, ::-1]
    if k & 2:
        x = x[:, ::-1]
    return x


PREDICT_BATCH_SIZE = 256  # evaluation and ``predict`` score with the same function and batch size
TTA_VIEWS = 8


def predict_images(
    model, images: np.ndarray, batch_size: int = PREDICT_BATCH_SIZE, tta: bool = False, views: list | None = None
) -> np.ndarray:
    """Class probabilities of uint8 images (N, H, W, 3). With ``tta``: the mean over the 8 dihedral transforms
    (8 forward passes per image). ``views``, when given a list, receives each transform's probabilities
    (the first is the plain single-view prediction). The flow's evaluation and ``predict`` both call this."""
    import keras

    transforms = range(TTA_VIEWS) if tta else (0,)
    total = None
    for k in transforms:
        x = np.ascontiguousarray(dihedral(images, k)).astype(np.float32)
        logits = model.predict(x, batch_size=batch_size, verbose=0)
        probs = keras.ops.convert_to_numpy(keras.ops.softmax(keras.ops.cast(logits, "float32")))
        if views is not None:
            views.append(probs)
        total = probs if total is None else total + probs
    return total / len(transforms)


predict_logits = predict_images  # the old name
