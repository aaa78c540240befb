"""EuroSAT RGB land-cover classification with a Vision Transformer (Keras 3 on JAX).

Modules:
    dataset  -- fetch (URL / local zip or directory / gs://), validate, decode once to uint8 arrays, split
    model    -- the ViT (strided-conv patch embedding, [CLS] token, pre-LN encoder blocks)
    train    -- numpy-fed training with cheap augmentation, per-epoch checkpoints and resume, evaluation
    callbacks -- the training's Keras callbacks: schedule and time budget, progress, checkpoint, test curve
    metrics  -- accuracy / per-class P/R/F1 / confusion matrix, and the PNG plots
    predict  -- classify a folder of images with a saved ``.keras`` model

Only ``dataset`` and ``metrics`` are imported by the flow's caller side without Keras.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")  # ~/.keras/keras.json may say tensorflow, which is not installed
