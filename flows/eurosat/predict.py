"""Classify a folder of images with a saved ``.keras`` model (its class names are stored inside it)."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")

import numpy as np  # noqa: E402

from eurosat import dataset as ds  # noqa: E402


def predict_folder(model_path: str | Path, folder: str | Path, batch_size: int = 256) -> list[dict]:
    """One ``{"file", "class", "confidence", "probabilities"}`` per image under ``folder`` (recursively).

    An unreadable image is an error naming the file; a folder without images is an error too.
    """
    from eurosat.train import load_model, predict_logits

    folder = Path(folder)
    if not folder.is_dir():
        raise ds.DatasetError(f"{folder} is not a directory", str(folder))
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in ds.IMAGE_SUFFIXES
                   and not any(part.startswith(".") for part in p.relative_to(folder).parts))
    if not files:
        raise ds.DatasetError(f"{folder}: no images found ({', '.join(ds.IMAGE_SUFFIXES)})", str(folder))
    model, class_names = load_model(model_path)
    size = int(model.input_shape[1])
    images = np.stack([ds.decode_image(p.read_bytes(), str(p), size) for p in files])
    probs = predict_logits(model, images, batch_size=batch_size, tta=False)
    rows = []
    for path, p in zip(files, probs):
        k = int(p.argmax())
        rows.append({"file": str(path.relative_to(folder)), "class": class_names[k], "confidence": float(p[k]),
                     "probabilities": {n: round(float(v), 5) for n, v in zip(class_names, p)}})
    return rows
