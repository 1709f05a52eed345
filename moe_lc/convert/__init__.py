"""Hugging Face interop: models in (`from_hf`) and out (`to_hf`), streamed one box / layer at a time.

    python -m moe_lc.convert from-hf HF_DIR --out DIR [--overwrite]   recipe.toml + tokenizer/ + a step-0 checkpoint
    python -m moe_lc.convert to-hf CHECKPOINT --out HF_DIR [--overwrite]

`hf_config` maps config.json to our [model] (and back) for the families it can express exactly
(`hf_moe_config` the GQA MoE ones, `hf_fields` what all share), `hf_names` places each HF tensor in
our tensors, `hf_files` reads and writes safetensors, `out_dir` decides what --out may replace and
swaps the result in whole. Needs the [hf] extra (safetensors,
tokenizers): pip install -e '.[hf]'.
"""

from moe_lc.convert.from_hf import from_hf
from moe_lc.convert.hf_config import FAMILIES, ConvertError, family_of, from_hf_config, to_hf_config
from moe_lc.convert.to_hf import to_hf

__all__ = ["FAMILIES", "ConvertError", "family_of", "from_hf", "from_hf_config", "to_hf", "to_hf_config"]
