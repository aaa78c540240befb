"""Classify a folder of images with a saved ``.keras`` model (its class names are stored inside it)."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")

import numpy as np  # noqa: E402

from eurosat import dataset as ds  # noqa: E402


def predict_folder(
    model_path: str | Path, folder: str | Path, batch_size: int | None = None, tta: bool | None = None
) -> list[dict]:
    """One ``{"file", "class", "confidence", "probabilities"}`` per image under ``folder`` (recursively).

    Scores exactly as the flow's evaluation scored the model (the same function and batch size), so the
    accuracy it published is what this delivers: ``tta=None`` repeats the model's own scoring (stored in the
    .keras file; the flow's default is 8-way TTA: 8 forward passes per image); ``tta=False`` is the single
    view, 8x cheaper (the flow publishes that figure beside the other).
    An unreadable image is an error naming the file; a folder without images is an error too.
    """
    from eurosat.train import PREDICT_BATCH_SIZE, load_model, load_scoring, predict_images

    folder = Path(folder)
    if not folder.is_dir():
        raise ds.DatasetError(f"{folder} is not a directory", str(folder))
    files = sorted(
        p
        for p in folder.rglob("*")
        if p.is_file()
        and p.suffix.lower() in ds.IMAGE_SUFFIXES
        and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )
    if not files:
        raise ds.DatasetError(f"{folder}: no images found ({', '.join(ds.IMAGE_SUFFIXES)})", str(folder))
    model, class_names = load_model(model_path)
    size = int(model.input_shape[1])
    images = np.stack([ds.decode_image(p.read_bytes(), str(p), size) for p in files])
    if tta is None:
        tta = bool(load_scoring(model_path).get("tta", False))
    probs = predict_images(model, images, batch_size=batch_size or PREDICT_BATCH_SIZE, tta=tta)
    rows = []
    for path, p in zip(files, probs):
        k = int(p.argmax())
        rows.append(
            {
                "file": str(path.relative_to(folder)),
                "class": class_names[k],
                "confidence": float(p[k]),
                "probabilities": {n: round(float(v), 5) for n, v in zip(class_names, p)},
            }
        )
    return rows
