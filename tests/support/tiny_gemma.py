"""A tiny Gemma 3 built from the real keras-hub classes, saved as a local preset.

``build_tiny_preset(folder)`` trains a SentencePiece model on the fly (BPE with byte fallback, Gemma's special
tokens: ``<pad> <eos> <bos> <unk>`` and, as user-defined pieces so they are matched inside text,
``<start_of_turn> <end_of_turn>`` plus the image tokens), builds ``Gemma3Backbone`` from a small config
(2 layers, hidden 64, text only), wraps it in ``Gemma3CausalLMPreprocessor`` -> ``Gemma3CausalLM`` and writes
it with ``save_to_preset``. ``Gemma3CausalLM.from_preset(folder)`` then takes the same code path as the real
``gemma3_instruct_1b`` preset. Used by tests/pipelines/test_gemma.py and bench/bench_gemma.py.
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")

SPECIAL_USER_SYMBOLS = ["<start_of_turn>", "<end_of_turn>", "<img>", "<start_of_image>", "<end_of_image>"]

TINY_CONFIG = dict(
    num_layers=2,
    num_query_heads=2,
    num_key_value_heads=1,
    hidden_dim=64,
    intermediate_dim=128,
    head_dim=32,
    use_post_ffw_norm=True,
    use_post_attention_norm=True,
    use_query_key_norm=True,
    query_head_dim_normalize=True,
    use_sliding_window_attention=True,
    sliding_window_size=64,
    final_logit_soft_cap=None,
    attention_logit_soft_cap=None,
    layer_norm_epsilon=1e-6,
)

# Gemma 3 1B's architecture (google-deepmind/gemma `Gemma3_1B`, as converted by keras-hub's
# tools/checkpoint_conversion/convert_gemma3_checkpoints.py): 26 layers, 4 query heads sharing 1 KV head of
# 256, hidden 1152, MLP 6 x 1152, 512-token sliding windows (5 local : 1 global), no soft caps.
GEMMA3_1B_CONFIG = dict(
    vocabulary_size=262144,
    num_layers=26,
    num_query_heads=4,
    num_key_value_heads=1,
    hidden_dim=1152,
    intermediate_dim=6912,
    head_dim=256,
    use_post_ffw_norm=True,
    use_post_attention_norm=True,
    use_query_key_norm=True,
    query_head_dim_normalize=True,
    use_sliding_window_attention=True,
    sliding_window_size=512,
    final_logit_soft_cap=None,
    attention_logit_soft_cap=None,
    local_rope_scaling_factor=1.0,
    global_rope_scaling_factor=1.0,
    layer_norm_epsilon=1e-6,
)

_FALLBACK_TEXT = [
    "Do statins reduce the risk of stroke in elderly patients?",
    "Yes. The trial showed a lower incidence.",
    "No. There was no significant difference between the groups.",
    "Maybe. The evidence is limited.",
    "Please stop writing such nonsense in the article.",
    "I think this could be written more clearly.",
]


def corpus(shared_data: Path | None, limit: int = 600) -> list[str]:
    """Training text for the tokenizer: PubMedQA and ParaDetox sentences when available."""
    texts = list(_FALLBACK_TEXT)
    if shared_data is not None and (shared_data / "pubmedqa" / "ori_pqal.json").is_file():
        items = json.loads((shared_data / "pubmedqa" / "ori_pqal.json").read_text())
        for item in list(items.values())[: limit // 3]:
            texts += [item["QUESTION"], item["LONG_ANSWER"], *item["CONTEXTS"]]
    if shared_data is not None and (shared_data / "paradetox" / "paradetox.tsv").is_file():
        with open(shared_data / "paradetox" / "paradetox.tsv", newline="", encoding="utf-8") as fh:
            for i, row in enumerate(csv.reader(fh, delimiter="\t", quoting=csv.QUOTE_NONE)):
                if i > limit:
                    break
                texts += [c for c in row if c]
    texts += [
        "Answer the biomedical research question using the abstract excerpts below.",
        "Rewrite the following message so that it is polite and free of insults or profanity.",
    ]
    return texts


def train_sentencepiece(texts: list[str], vocab_size: int = 1024) -> bytes:
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        pad_piece="<pad>",
        eos_piece="<eos>",
        bos_piece="<bos>",
        unk_piece="<unk>",
        user_defined_symbols=SPECIAL_USER_SYMBOLS,
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        split_digits=True,
        num_threads=1,
        minloglevel=2,
        train_extremely_large_corpus=False,
    )
    return model.getvalue()


def build_tiny_causal_lm(proto: bytes, sequence_length: int = 256, seed: int = 0, dtype: str = "float32", **overrides):
    import keras
    import keras_hub

    keras.utils.set_random_seed(seed)
    tokenizer = keras_hub.models.Gemma3Tokenizer(proto=proto)
    backbone = keras_hub.models.Gemma3Backbone(
        vocabulary_size=tokenizer.vocabulary_size(),
        image_size=None,
        vision_encoder=None,
        dtype=dtype,
        **{**TINY_CONFIG, **overrides},
    )
    preprocessor = keras_hub.models.Gemma3CausalLMPreprocessor(
        tokenizer=tokenizer, image_converter=None, sequence_length=sequence_length
    )
    return keras_hub.models.Gemma3CausalLM(backbone=backbone, preprocessor=preprocessor)


def build_tiny_preset(
    folder: str | Path,
    shared_data: Path | None = None,
    vocab_size: int = 1024,
    sequence_length: int = 256,
    seed: int = 0,
) -> Path:
    """Write the tiny preset into ``folder`` (created); returns it."""
    folder = Path(folder)
    proto = train_sentencepiece(corpus(shared_data), vocab_size)
    lm = build_tiny_causal_lm(proto, sequence_length=sequence_length, seed=seed)
    lm.save_to_preset(str(folder))
    return folder


if __name__ == "__main__":  # python tests/support/tiny_gemma.py OUT_DIR
    import sys

    shared = Path(__file__).resolve().parents[3] / "shared" / "data"
    print(build_tiny_preset(sys.argv[1], shared if shared.is_dir() else None))
