"""Training on packed documents (`data.document_mask`, `data.document_positions`) is layout-independent:
cp2, cp4, cp2 x tp2, pp2 DualPipe x cp2, MLA's latent ring on cp2 and cp4 with the balanced chunk
placement equal one process (fp32, the harness tolerance, 5 steps).

The data is a token file written here whose document lengths mix what packing meets: documents of
1-5 tokens (shorter than a chunk: 8 tokens at cp 4), documents that start mid-chunk and span several
chunks, and documents longer than a whole 64-token sequence (windows that are one document).
"""

from __future__ import annotations

import numpy as np
import pytest

from moe_lc.data.loader import TokenWindows
from moe_lc.data.token_file import TokenFileWriter, open_token_file
from moe_lc.data.tokenizer import ByteTokenizer
from tests.harness import RECIPES, assert_equivalent, reference, run_layout

RECIPE = RECIPES / "debug_cpu.toml"
MLA = ["model.attention=mla", "model.mla.q_lora_rank=48", "model.mla.kv_lora_rank=32", "model.mla.qk_nope_head_dim=16",
       "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=24"]
LENGTHS = [3, 40, 1, 70, 17, 150, 5, 26, 64, 2, 9, 33, 120, 4, 11]  # cycled; each plus its EOS
TRAIN = ["train.steps=5", "train.seq_len=64", "train.global_batch=8", "train.micro_batch=2", "train.warmup_steps=2",
         "data.source=tokens", "data.document_mask=true", "data.document_positions=true"]


def write_packed_corpus(prefix, n_docs: int = 400, seed: int = 0) -> None:
    tok = ByteTokenizer()
    rng = np.random.default_rng(seed)
    for split in ("train", "val"):
        writer = TokenFileWriter(f"{prefix}.{split}", tokenizer_name=tok.name, vocab_size=tok.vocab_size, source="test")
        with writer:
            for i in range(n_docs):
                n = LENGTHS[i % len(LENGTHS)]
                writer.append_document(rng.integers(0, 256, n), np.array([tok.eos_id]))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("packed") / "docs"
    write_packed_corpus(prefix)
    return [f"data.path={prefix}"]


def test_the_corpus_has_every_kind_of_window(corpus):
    """The cases the layouts must meet are in the first steps' windows: several documents, one that
    starts mid-chunk, one shorter than a cp-4 chunk, and a window that is a single document."""
    prefix = corpus[0].split("=", 1)[1]
    tokens, _, starts = open_token_file(f"{prefix}.train", documents=True)
    windows = TokenWindows(tokens, 64, seed=1, doc_starts=starts)
    lengths = [windows[i]["documents"].tolist() for i in range(40)]  # 5 steps x 8 samples
    assert any(len(row) == 1 for row in lengths)
    assert any(min(row) < 8 for row in lengths if len(row) > 1)
    assert any(any(int(s) % 8 for s in np.cumsum(row)[:-1]) for row in lengths)
    assert any(max(row) > 16 and len(row) > 1 for row in lengths)  # spans chunks (cp 4: 8 tokens each)


LAYOUTS = {
    "cp2": (["parallel.cp=2"], 2),
    "cp4": (["parallel.cp=4"], 4),
    "cp2_tp2": (["parallel.cp=2", "parallel.tp=2"], 4),
    "pp2_dualpipe_cp2": (["parallel.cp=2", "parallel.pp=2", "parallel.pp_schedule=dualpipe", "train.micro_batch=1"], 4),
    "mla_latent_ring_cp2": (MLA + ["parallel.cp=2"], 2),
    "cp4_balanced": (["parallel.cp=4", "parallel.cp_layout=balanced"], 4),
}


@pytest.mark.parametrize("layout", [pytest.param(k, marks=pytest.mark.slow) if k in ("cp4", "cp2_tp2", "pp2_dualpipe_cp2") else k
                                    for k in LAYOUTS])  # cp4 and cp2 x tp2: -m slow
def test_document_masked_training_equals_one_process(corpus, layout):
    extra, world = LAYOUTS[layout]
    micro = [o for o in extra if not o.startswith("parallel.")]
    ref = reference(RECIPE, TRAIN + corpus + micro)
    got = run_layout(RECIPE, TRAIN + corpus + extra, world=world)
    report = assert_equivalent(ref, got, rtol=1e-5)
    print(f"{layout}: loss {report.max_loss_rel:.1e} params {report.max_param_rel:.1e}")


def test_the_mask_changes_training(corpus):
    """Not a no-op: the same data without the mask trains to other losses."""
    masked = reference(RECIPE, TRAIN + corpus)
    plain = reference(RECIPE, [o for o in TRAIN if not o.startswith("data.document")] + corpus)
    assert max(abs(a - b) for a, b in zip(masked.losses, plain.losses)) > 1e-3


def test_balanced_layout_needs_the_document_mask():
    from moe_lc.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="cp_layout = 'balanced' .* needs data.document_mask = true"):
        load_config(RECIPE, ["parallel.cp=2", "parallel.cp_layout=balanced"], world_size=2)
