"""A small Vision Transformer for 64x64 EuroSAT tiles, in Keras 3 (JAX backend).

Patch embedding is a strided Conv2D (kernel = stride = patch size); optionally a short strided
convolutional stem runs first (``stem_channels``), which gives a ViT the locality prior it otherwise
needs far more data to learn (Xiao et al., "Early convolutions help transformers see better", 2021).
A learnable [CLS] token and learnable position embeddings are added, then ``depth`` pre-LayerNorm
encoder blocks (multi-head self-attention, GELU MLP, dropout), a final LayerNorm and a linear head
on the [CLS] token.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
from keras import layers, ops  # noqa: E402


@dataclass(frozen=True)
class ViTConfig:
    image_size: int = 64
    patch_size: int = 8
    dim: int = 64
    depth: int = 4
    heads: int = 4
    mlp_ratio: float = 2.0
    dropout: float = 0.1
    attention_dropout: float = 0.0
    stem_channels: tuple[int, ...] = ()  # e.g. (32, 64): two 3x3 stride-2 convs before the patch conv
    bn_momentum: float = 0.99  # stem BatchNorm; 0.9 lets the running statistics keep up in short runs
    pool: str = "cls"  # "cls": the [CLS] token feeds the head; "gap": the mean of the patch tokens does
    num_classes: int = 10

    @property
    def tokens(self) -> int:
        reduced = self.image_size // (2 ** len(self.stem_channels))
        return (reduced // self.patch_size) ** 2

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["stem_channels"] = list(self.stem_channels)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ViTConfig:
        d = dict(d)
        if "stem_channels" in d:
            d["stem_channels"] = tuple(d["stem_channels"] or ())
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown model option(s) {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)


# Named presets for the flow's ``model_size`` parameter.
PRESETS: dict[str, ViTConfig] = {
    "tiny": ViTConfig(patch_size=8, dim=32, depth=1, heads=2, mlp_ratio=2.0, dropout=0.0),
    "seed": ViTConfig(patch_size=8, dim=64, depth=4, heads=4, mlp_ratio=2.0, dropout=0.1),
    "small": ViTConfig(patch_size=2, dim=96, depth=4, heads=4, mlp_ratio=2.0, dropout=0.0, stem_channels=(32, 64)),
    "medium": ViTConfig(patch_size=2, dim=96, depth=6, heads=4, mlp_ratio=2.0, dropout=0.0, stem_channels=(32, 64)),
    "base": ViTConfig(patch_size=2, dim=128, depth=8, heads=4, mlp_ratio=3.0, dropout=0.1, stem_channels=(48, 96)),
    # the recipe for 2 CPU cores (bench/results/eurosat_compare.json): three stride-2 conv stages take the
    # 64x64 tile to an 8x8x128 map (locality for free), 2x2 patches of it make 16 tokens, 4 blocks, and the
    # mean of the patch tokens feeds the head; BatchNorm statistics that keep up in minutes-long runs
    "hybrid": ViTConfig(
        patch_size=2,
        dim=128,
        depth=4,
        heads=4,
        mlp_ratio=2.0,
        dropout=0.0,
        stem_channels=(32, 64, 128),
        bn_momentum=0.9,
        pool="gap",
    ),
    # the same shape at a quarter of the width and half the depth: for minutes-long runs (the README's first
    # command), where more steps matter more than capacity
    "hybrid-mini": ViTConfig(
        patch_size=2,
        dim=64,
        depth=2,
        heads=2,
        mlp_ratio=2.0,
        dropout=0.0,
        stem_channels=(16, 32, 64),
        bn_momentum=0.9,
        pool="gap",
    ),
    # ``auto`` on a GPU/TPU (with mixed_bfloat16): a wider stem, 64 tokens, 8 wider blocks
    "hybrid-large": ViTConfig(
        patch_size=1,
        dim=256,
        depth=8,
        heads=8,
        mlp_ratio=4.0,
        dropout=0.1,
        stem_channels=(64, 128, 256),
        bn_momentum=0.9,
        pool="gap",
    ),
}


ACCELERATOR_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")
# ``model_size="auto"``: the recipe measured on 2 CPU cores, a larger one where an accelerator is present
AUTO_PRESET = {"cpu": "hybrid", "accelerator": "hybrid-large"}


def device_platform() -> str:
    """The JAX backend the job trains on: ``cpu``, ``gpu`` or ``tpu`` (what ``auto`` choices key on)."""
    import jax

    return jax.default_backend()


def select_preset(model_size: str, platform: str) -> str:
    """``auto`` -> the larger preset on a GPU/TPU, the CPU recipe otherwise; a named preset is kept."""
    if model_size == "auto":
        return AUTO_PRESET["accelerator" if platform.lower() in ACCELERATOR_PLATFORMS else "cpu"]
    if model_size not in PRESETS:
        raise ValueError(f"model_size={model_size!r}: choose auto or one of {', '.join(PRESETS)}")
    return model_size


def select_precision(precision: str, platform: str) -> str:
    """The Keras dtype policy: ``auto`` -> ``mixed_bfloat16`` on a GPU/TPU (bf16 matmuls, float32 weights
    and head), ``float32`` on CPU (XLA's CPU bf16 path is no faster here); explicit policies are kept."""
    allowed = ("float32", "mixed_bfloat16", "mixed_float16")
    if precision == "auto":
        return "mixed_bfloat16" if platform.lower() in ACCELERATOR_PLATFORMS else "float32"
    if precision not in allowed:
        raise ValueError(f"precision={precision!r}: choose auto or one of {', '.join(allowed)}")
    return precision


@keras.saving.register_keras_serializable(package="eurosat")
class ClassTokenAndPosition(layers.Layer):
    """Prepends a learnable [CLS] token and adds learnable position embeddings."""

    def __init__(self, num_tokens: int, dim: int, **kwargs):
        super().__init__(**kwargs)
        self.num_tokens, self.dim = num_tokens, dim

    def build(self, input_shape):
        init = keras.initializers.TruncatedNormal(stddev=0.02)
        self.cls = self.add_weight(shape=(1, 1, self.dim), initializer=init, name="cls_token")
        self.pos = self.add_weight(
            shape=(1, self.num_tokens + 1, self.dim), initializer=init, name="position_embedding"
        )

    def call(self, x):
        batch = ops.shape(x)[0]
        cls = ops.broadcast_to(ops.cast(self.cls, x.dtype), (batch, 1, self.dim))
        return ops.concatenate([cls, x], axis=1) + ops.cast(self.pos, x.dtype)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], self.num_tokens + 1, self.dim)

    def get_config(self):
        return {**super().get_config(), "num_tokens": self.num_tokens, "dim": self.dim}


def encoder_block(x, cfg: ViTConfig, index: int):
    name = f"block{index}"
    h = layers.LayerNormalization(epsilon=1e-6, name=f"{name}_ln1")(x)
    h = layers.MultiHeadAttention(
        num_heads=cfg.heads, key_dim=cfg.dim // cfg.heads, dropout=cfg.attention_dropout, name=f"{name}_attn"
    )(h, h)
    h = layers.Dropout(cfg.dropout, name=f"{name}_drop1")(h)
    x = layers.Add(name=f"{name}_res1")([x, h])
    h = layers.LayerNormalization(epsilon=1e-6, name=f"{name}_ln2")(x)
    h = layers.Dense(int(cfg.dim * cfg.mlp_ratio), activation="gelu", name=f"{name}_mlp1")(h)
    h = layers.Dropout(cfg.dropout, name=f"{name}_drop2")(h)
    h = layers.Dense(cfg.dim, name=f"{name}_mlp2")(h)
    h = layers.Dropout(cfg.dropout, name=f"{name}_drop3")(h)
    return layers.Add(name=f"{name}_res2")([x, h])


def build_vit(cfg: ViTConfig, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0)) -> keras.Model:
    """Inputs: uint8 or float images in [0, 255], shape (64, 64, 3); outputs: class logits."""
    if cfg.pool not in ("cls", "gap"):
        raise ValueError(f"pool={cfg.pool!r}: choose 'cls' or 'gap'")
    if cfg.dim % cfg.heads:
        raise ValueError(f"dim={cfg.dim} is not divisible by heads={cfg.heads}")
    reduced = cfg.image_size // (2 ** len(cfg.stem_channels))
    if reduced % cfg.patch_size:
        raise ValueError(f"patch_size={cfg.patch_size} does not tile the {reduced}x{reduced} feature map")
    inputs = keras.Input((cfg.image_size, cfg.image_size, 3), name="image")
    x = layers.Rescaling(1.0, name="to_float")(inputs)  # also casts uint8 to float
    x = layers.Normalization(mean=[float(m) for m in mean], variance=[float(s) ** 2 for s in std], name="normalize")(x)
    for i, channels in enumerate(cfg.stem_channels):
        x = layers.Conv2D(channels, 3, strides=2, padding="same", use_bias=False, name=f"stem{i}_conv")(x)
        x = layers.BatchNormalization(momentum=cfg.bn_momentum, name=f"stem{i}_bn")(x)
        x = layers.Activation("gelu", name=f"stem{i}_gelu")(x)
    x = layers.Conv2D(cfg.dim, cfg.patch_size, strides=cfg.patch_size, name="patch_embed")(x)
    x = layers.Reshape((cfg.tokens, cfg.dim), name="tokens")(x)
    x = ClassTokenAndPosition(cfg.tokens, cfg.dim, name="cls_pos")(x)
    x = layers.Dropout(cfg.dropout, name="embed_drop")(x)
    for i in range(cfg.depth):
        x = encoder_block(x, cfg, i)
    x = layers.LayerNormalization(epsilon=1e-6, name="final_ln")(x)
    if cfg.pool == "gap":
        patches = layers.Cropping1D((1, 0), name="drop_cls")(x)
        feat = layers.GlobalAveragePooling1D(name="token_mean")(patches)
    else:
        feat = layers.Cropping1D((0, cfg.tokens), name="take_cls")(x)  # keeps token 0, the [CLS] token
        feat = layers.Reshape((cfg.dim,), name="cls_token")(feat)
    # the head always computes in float32, so mixed precision never changes the logits' dtype
    outputs = layers.Dense(cfg.num_classes, name="head", dtype="float32")(feat)
    return keras.Model(inputs, outputs, name="eurosat_vit")
