"""Which Gemma 3 preset to fine-tune: a Kaggle preset name, a local preset folder, or gs://.

Checked on the caller before anything is launched: an unknown name gets the closest valid names, a local
folder must hold a Gemma 3 preset (``config.json`` of a ``Gemma3Backbone``, the tokenizer and its
vocabulary), and a Kaggle preset needs ``KAGGLE_USERNAME``/``KAGGLE_KEY`` in the caller's environment (they
are forwarded to the job at run time with ``env=``, never written into the payload or the job manifest).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PRESET = "gemma3_instruct_1b"
KAGGLE_ENV = ("KAGGLE_USERNAME", "KAGGLE_KEY")

# keras-hub 0.32's Gemma3CausalLM presets (used when keras-hub is not importable on the caller).
_STATIC_PRESETS = (
    "function_gemma_instruct_270m",
    "gemma3_12b",
    "gemma3_12b_text",
    "gemma3_1b",
    "gemma3_270m",
    "gemma3_27b",
    "gemma3_27b_text",
    "gemma3_4b",
    "gemma3_4b_text",
    "gemma3_instruct_12b",
    "gemma3_instruct_12b_text",
    "gemma3_instruct_1b",
    "gemma3_instruct_270m",
    "gemma3_instruct_27b",
    "gemma3_instruct_27b_text",
    "gemma3_instruct_4b",
    "gemma3_instruct_4b_text",
    "medgemma_1.5_instruct_4b",
    "medgemma_4b",
    "medgemma_instruct_27b",
    "medgemma_instruct_27b_text",
    "medgemma_instruct_4b",
    "translategemma_12b_it",
    "translategemma_27b_it",
    "translategemma_4b_it",
)
REQUIRED_FILES = ("config.json", "tokenizer.json", "assets/tokenizer/vocabulary.spm")


class PresetError(ValueError):
    """An unusable ``preset``; the message says what is wrong and what to pass instead."""


def known_presets() -> list[str]:
    """Gemma 3 causal-LM preset names (embedding-only presets left out)."""
    try:
        import keras_hub

        names = list(keras_hub.models.Gemma3CausalLM.presets)
    except Exception:  # keras-hub missing or broken on the caller: the static list
        names = list(_STATIC_PRESETS)
    return sorted(n for n in names if "embedding" not in n)


@dataclass(frozen=True)
class PresetRef:
    kind: str  # kaggle | local | gcs | hf
    value: str  # the name/handle, the absolute local folder, or gs://bucket/prefix/
    fingerprint: str  # part of the train cache key: content of a local folder, else the name itself

    @property
    def needs_kaggle(self) -> bool:
        return self.kind == "kaggle"

    def as_dict(self) -> dict:
        return {"kind": self.kind, "value": self.value, "fingerprint": self.fingerprint}


def _folder_fingerprint(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        st = path.stat()
        digest.update(f"{path.relative_to(root).as_posix()}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return "local:" + digest.hexdigest()


def check_local_preset(root: Path) -> None:
    missing = [name for name in REQUIRED_FILES if not (root / name).is_file()]
    if missing:
        raise PresetError(
            f"preset folder {str(root)!r} is not a keras-hub preset: {', '.join(missing)} missing. Make one with "
            "`Gemma3CausalLM.save_to_preset(folder)` (the merged preset this flow writes is one), or pass a preset "
            f"name such as {DEFAULT_PRESET!r}."
        )
    try:
        config = json.loads((root / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise PresetError(f"{root / 'config.json'} is not valid JSON: {exc}") from None
    class_name = str(config.get("class_name", ""))
    if class_name != "Gemma3Backbone":
        raise PresetError(
            f"preset folder {str(root)!r} holds a {class_name or 'unknown'} model, not a Gemma 3 one "
            "(config.json class_name must be Gemma3Backbone); this flow fine-tunes Gemma3CausalLM."
        )


def resolve(preset: str) -> PresetRef:
    if not preset or not isinstance(preset, str):
        raise PresetError(
            f"preset={preset!r}: pass a Gemma 3 preset name (e.g. {DEFAULT_PRESET!r}), a local preset "
            "folder or gs://bucket/folder/"
        )
    if preset.startswith("gs://"):
        if preset.rstrip("/") == "gs:" or preset.count("/") < 3:
            raise PresetError(f"preset={preset!r}: use gs://bucket/folder/ (a folder written by save_to_preset)")
        value = preset if preset.endswith("/") else preset + "/"
        return PresetRef("gcs", value, value)
    if preset.startswith("kaggle://"):
        return PresetRef("kaggle", preset, preset)
    if preset.startswith("hf://"):
        return PresetRef("hf", preset, preset)
    path = Path(preset).expanduser()
    if path.is_file():
        raise PresetError(
            f"preset {preset!r} is a file; pass the preset folder (the one with config.json and "
            "tokenizer.json, as written by save_to_preset)"
        )
    if path.is_dir():
        root = path.resolve()
        check_local_preset(root)
        return PresetRef("local", str(root), _folder_fingerprint(root))
    names = known_presets()
    if preset in names:
        return PresetRef("kaggle", preset, preset)
    looks_like_path = any(sep in preset for sep in ("/", os.sep)) or preset.startswith((".", "~"))
    if looks_like_path:
        raise PresetError(
            f"preset folder {preset!r} does not exist (pass an existing folder written by "
            f"save_to_preset, gs://bucket/folder/, or a preset name such as {DEFAULT_PRESET!r})"
        )
    close = difflib.get_close_matches(preset, names, n=4, cutoff=0.5)
    hint = f"Did you mean {', '.join(close)}? " if close else ""
    raise PresetError(
        f"unknown preset {preset!r}. {hint}Gemma 3 presets: {', '.join(names)}; or pass a local preset "
        "folder or gs://bucket/folder/."
    )


def check_credentials(ref: PresetRef) -> list[str]:
    """The environment variables to forward to the job (``env=``); raises if a Kaggle preset lacks them."""
    if ref.kind == "kaggle":
        missing = [name for name in KAGGLE_ENV if not os.environ.get(name)]
        if missing:
            raise PresetError(
                f"preset {ref.value!r} is downloaded from Kaggle by the job, which needs your Kaggle API credentials: "
                f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set. Accept the Gemma licence on "
                "kaggle.com/models/keras/gemma3, create an API token (Settings > API), then `export "
                "KAGGLE_USERNAME=... KAGGLE_KEY=...` before running the flow; they are forwarded to the job at run "
                "time only. Or pass a local preset folder."
            )
        return list(KAGGLE_ENV)
    if ref.kind == "hf":
        return ["HF_TOKEN*", "HUGGING_FACE_HUB_TOKEN*"]  # patterns: optional
    return []
