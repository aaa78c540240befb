"""Gemma 3 LoRA fine-tuning (flows/gemma_lora.py): data, token packing, presets, the training job, metrics.

Import-light on purpose: ``data``, ``tokens`` and ``presets`` need no Keras; ``train`` imports keras-hub inside
its functions (it runs in the job).
"""
