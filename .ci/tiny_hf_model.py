"""A tiny random DeepSeek-V2 model directory (config.json, safetensors, tokenizer) made with transformers,
no download: where the README's Hugging Face flow reads `path/to/DeepSeek-V2-Lite` in CI.

    python .ci/tiny_hf_model.py DIR
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ of this checkout

from tests.hf_models import deepseek_v2, save_model  # noqa: E402

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
save_model(deepseek_v2(), out)
print(f"tiny DeepSeek-V2 in {out}")
