"""Gemma 3 LoRA training-step benchmark: ms per step and trainable (LoRA) vs total parameters.

    uv run --extra llm python bench/bench_gemma.py   # tiny Gemma 3 (tests/support/tiny_gemma.py), CPU
    uv run --extra llm python bench/bench_gemma.py --size 1b             # Gemma 3 1B architecture, random weights (GPU)
    uv run --extra llm python bench/bench_gemma.py --size 1b --count-only   # parameter counts only (any machine)

On a GPU machine install JAX's CUDA build first (``uv pip install "jax[cuda12]"``: the ``llm`` extra pins the CPU
build); ``--batch-size``/``--sequence-length`` default to 4 x 512 for 1b, 8 x 256 for tiny.

Same step as the flow's job (flows/gemma/train.py): ``Gemma3CausalLM`` over token ids, ``backbone.enable_lora``,
AdamW, sparse cross-entropy averaged over the answer tokens only (``sample_weight`` zero on the prompt half),
dtype ``auto`` (mixed_bfloat16 on bf16 GPUs/TPUs, float32 on CPU). ``--size 1b`` builds keras-hub's
``Gemma3Backbone`` with the 1B configuration (vocabulary 262,144, 26 layers, hidden 1,152, MLP 6,912, 4 query
heads / 1 KV head of 256, 512-token sliding windows; tests/support/tiny_gemma.py GEMMA3_1B_CONFIG) and random weights:
no Kaggle download, the same compute as ``gemma3_instruct_1b``. Each run updates its entry
(``<size>/<device>``) in bench/results/gemma.json; the first step (compilation) is reported apart.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "flows"))
os.environ.setdefault("KERAS_BACKEND", "jax")

RESULTS = ROOT / "bench" / "results" / "gemma.json"
SHARED_DATA = ROOT.parent / "shared" / "data"
EXPECTED_1B_PARAMS = 999_885_952  # keras-hub's gemma3_1b / gemma3_instruct_1b preset metadata


def _device() -> str:
    import jax

    device = jax.devices()[0]
    kind = getattr(device, "device_kind", device.platform)
    return f"{device.platform}:{kind}".replace(" ", "-")


def build(size: str, dtype: str, sequence_length: int):
    import keras_hub
    from tiny_gemma import GEMMA3_1B_CONFIG, build_tiny_causal_lm, corpus, train_sentencepiece

    if size == "tiny":
        proto = train_sentencepiece(corpus(SHARED_DATA if SHARED_DATA.is_dir() else None))
        lm = build_tiny_causal_lm(proto, sequence_length=sequence_length, dtype=dtype)
        lm.preprocessor = None
        return lm
    backbone = keras_hub.models.Gemma3Backbone(image_size=None, vision_encoder=None, dtype=dtype, **GEMMA3_1B_CONFIG)
    return keras_hub.models.Gemma3CausalLM(backbone=backbone, preprocessor=None)


def count(weights) -> int:
    import numpy as np

    return int(sum(int(np.prod(w.shape)) for w in weights))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=("tiny", "1b"), default="tiny")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps; the first compiles")
    parser.add_argument("--batch-size", type=int, default=None, help="default 8 (tiny) / 4 (1b)")
    parser.add_argument("--sequence-length", type=int, default=None, help="default 256 (tiny) / 512 (1b)")
    parser.add_argument("--lora-rank", type=int, default=4)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--count-only", action="store_true", help="parameter counts, no training step")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    batch = args.batch_size or (8 if args.size == "tiny" else 4)
    seq = args.sequence_length or (256 if args.size == "tiny" else 512)

    from gemma.train import choose_dtype, hide_accelerators_from_tensorflow

    hide_accelerators_from_tensorflow()
    import jax
    import keras
    import numpy as np

    dtype = "float32" if args.count_only else choose_dtype(args.dtype)
    if args.size == "1b" and jax.devices()[0].platform == "cpu" and not args.count_only:
        print(
            "warning: timing the 1B architecture on CPU (minutes per step); --count-only gives the counts", flush=True
        )
    keras.utils.set_random_seed(0)
    t = time.perf_counter()
    lm = build(args.size, dtype, seq)
    build_s = time.perf_counter() - t
    total_before_lora = count(lm.backbone.weights)
    lm.backbone.enable_lora(rank=args.lora_rank)
    trainable, total = count(lm.backbone.trainable_weights), count(lm.backbone.weights)
    entry: dict = {
        "size": args.size,
        "device": _device(),
        "dtype": dtype,
        "lora_rank": args.lora_rank,
        "params": {
            "base": total_before_lora,
            "lora_trainable": trainable,
            "total_with_lora": total,
            "trainable_percent": round(100 * trainable / total, 4),
        },
        "config": {
            k: v
            for k, v in lm.backbone.get_config().items()
            if k
            in (
                "vocabulary_size",
                "num_layers",
                "num_query_heads",
                "num_key_value_heads",
                "hidden_dim",
                "intermediate_dim",
                "head_dim",
                "sliding_window_size",
            )
        },
        "build_seconds": round(build_s, 1),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "load_avg_at_start": [round(v, 2) for v in os.getloadavg()],
            "jax": jax.__version__,
            "keras": keras.__version__,
        },
    }
    if args.size == "1b":
        entry["params"]["matches_gemma3_1b_preset"] = total_before_lora == EXPECTED_1B_PARAMS
    print(
        f"{args.size}: {trainable:,} LoRA parameters trainable of {total:,} ({entry['params']['trainable_percent']}%)"
        f", base model {total_before_lora:,}",
        flush=True,
    )

    if not args.count_only:
        vocab = lm.backbone.vocabulary_size
        rng = np.random.default_rng(0)
        token_ids = rng.integers(10, vocab, size=(batch, seq)).astype("int32")
        weights = np.zeros((batch, seq - 1), dtype="float32")
        weights[:, seq // 2 :] = 1.0  # loss on the "answer" half only, as in the flow
        x = {"token_ids": token_ids[:, :-1], "padding_mask": np.ones((batch, seq - 1), dtype=bool)}
        y = token_ids[:, 1:]
        lm.compile(
            optimizer=keras.optimizers.AdamW(learning_rate=1e-4, weight_decay=0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="mean_with_sample_weight"),
        )
        total_steps = args.warmup + args.steps
        times: list[float] = []
        losses: list[float] = []

        class Timer(keras.callbacks.Callback):  # the flow's job times its steps the same way
            def on_train_batch_begin(self, batch, logs=None):
                self.t = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                losses.append(float(np.asarray(logs["loss"])))  # synchronises
                times.append((time.perf_counter() - self.t) * 1000)
                if batch == 0 or (batch + 1) % 5 == 0:
                    print(f"step {batch + 1}/{total_steps}: {times[-1]:.1f} ms, loss {losses[-1]:.4f}", flush=True)

        def tile(a):  # the same batch every step
            return np.concatenate([a] * total_steps)

        lm.fit(
            {k: tile(v) for k, v in x.items()},
            tile(y),
            sample_weight=tile(weights),
            batch_size=batch,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[Timer()],
        )
        loss = losses[-1]
        timed = times[args.warmup :]
        entry.update(
            {
                "batch_size": batch,
                "sequence_length": seq,
                "steps_timed": len(timed),
                "first_step_ms": round(times[0], 1),
                "ms_per_step": {
                    "median": round(statistics.median(timed), 2),
                    "min": round(min(timed), 2),
                    "max": round(max(timed), 2),
                },
                "tokens_per_second": round(batch * (seq - 1) / (statistics.median(timed) / 1000)),
                "final_loss": round(loss, 4),
            }
        )
        print(
            f"{args.size} on {entry['device']} ({dtype}), batch {batch} x {seq} tokens: median "
            f"{entry['ms_per_step']['median']} ms/step (first step {entry['first_step_ms']:.0f} ms)",
            flush=True,
        )
    entry["machine"]["load_avg_at_end"] = [round(v, 2) for v in os.getloadavg()]

    out = Path(args.out)
    results = json.loads(out.read_text()) if out.is_file() else {}
    key = f"{args.size}/{entry['device']}" + ("/count-only" if args.count_only else "")
    results[key] = entry
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=1, sort_keys=True))
    os.replace(tmp, out)
    print(f"wrote {out} [{key}]")


if __name__ == "__main__":
    main()
