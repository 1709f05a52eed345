"""The families added after the first four (tests/hf_models.py NEW_FAMILIES: llama with llama3 rope,
qwen3, mixtral, qwen3_moe, olmoe, qwen2_moe, glm4_moe), held to transformers as test_convert.py holds
those:

- from-hf: our fp32 logits equal transformers' within 1e-5 of max |logit| at 96 tokens (past every
  model's original rope length 64); every parameter's gradient, cut back into HF tensors by the same
  table, equals transformers' within 1e-4 of its largest entry.
- from-hf -> to-hf gives back every input tensor bit for bit, as the same model_type.
- A converted model trains under ep2 (MoE) or tp2 (dense) with the losses and parameters of one
  process, and its to-hf output loads in transformers with our logits (mixtral in the default suite,
  the others marked slow).
- glm4_moe's MTP layer (DeepSeek-V3's names) round-trips; to-hf of a softmax family refuses a run
  whose expert_bias moved (bias balancing), which that family's router has no place for.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from moe_lc.config import load_config
from moe_lc.convert import ConvertError, from_hf, to_hf
from tests import hf_models
from tests.harness import assert_equivalent, run_layout
from tests.test_convert import ROOT, SEQ, TRAIN, forward_backward_both, hf_tensor_of_grads, our_model, quiet

transformers = pytest.importorskip("transformers")  # a dev dependency: `pip install -e '.[dev]'`
from safetensors.torch import load_file, save_file  # noqa: E402

FAMILIES = list(hf_models.NEW_FAMILIES)
DENSE = ("llama3", "qwen3")


@pytest.fixture(scope="module")
def convert(tmp_path_factory):
    """family -> (transformers model, HF dir, our converted dir), made on first use."""
    made: dict[str, tuple] = {}

    def get(family: str):
        if family not in made:
            base = tmp_path_factory.mktemp(family)
            model = hf_models.save_model(hf_models.NEW_FAMILIES[family](), base / "hf")
            from_hf(base / "hf", base / "ours", log=quiet)
            made[family] = (model, base / "hf", base / "ours")
        return made[family]
    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_gradients_match_transformers(convert, family):
    hf, _, ours_dir = convert(family)
    ours, cfg = our_model(ours_dir)
    logit_diff, want = forward_backward_both(ours, hf, cfg, family)
    print(f"\n{family}: max |logit diff| / max |logit| = {logit_diff:.2e}")
    assert logit_diff <= 1e-5
    have = hf_tensor_of_grads(ours, cfg, family)
    assert set(have) == set(want), set(have) ^ set(want)
    worst = max(((have[n] - g).abs().max() / g.abs().max().clamp_min(1e-6)).item() for n, g in want.items())
    print(f"{family}: worst gradient diff / its max = {worst:.2e} over {len(want)} tensors")
    assert worst <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_from_hf_then_to_hf_is_bit_identical(convert, family, tmp_path):
    _, hf_dir, ours_dir = convert(family)
    to_hf(ours_dir, tmp_path / "back", log=quiet)
    have, want = load_file(tmp_path / "back" / "model.safetensors"), load_file(hf_dir / "model.safetensors")
    assert have.keys() == want.keys(), set(have) ^ set(want)
    bad = [k for k in want if have[k].dtype != want[k].dtype or not torch.equal(have[k], want[k])]
    assert not bad, bad[:4]
    config, source = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "back", hf_dir))
    assert config["model_type"] == source["model_type"]
    rope = source["rope_parameters"]
    assert {k: config["rope_parameters"].get(k) for k in rope} == rope


def hold_key_bias_aside(one, got, cfg) -> float:
    """The largest absolute difference of the k rows of every q|k|v bias between the two runs, which it
    then sets equal in `got` (so the norm-wise comparison covers everything else). Why apart: the k bias
    has a zero gradient in exact arithmetic (it adds q . b_k to every score of a softmax row, which the
    softmax ignores), so Adam steps it by the sign of rounding noise, and layouts that reorder sums move
    it differently (llama3 under tp2: 6e-5 norm-wise, 6e-7 absolute, while q, v and o agree within 1e-6)."""
    q, k = cfg.n_heads * cfg.head_size, cfg.n_kv_heads * cfg.head_size
    worst = 0.0
    for name in [n for n in one.final_state if n.endswith("attn.wqkv.bias")]:
        want, have = one.final_state[name][q:q + k], got.final_state[name][q:q + k]
        worst = max(worst, (want - have).abs().max().item())
        got.final_state[name][q:q + k] = want
    return worst


@pytest.mark.parametrize("family", [f if f == "mixtral" else pytest.param(f, marks=pytest.mark.slow)
                                    for f in FAMILIES])
def test_converted_model_trains_alike_under_ep2_or_tp2_and_exports(convert, family, tmp_path):
    hf, _, ours_dir = convert(family)
    recipe = ours_dir / "recipe.toml"
    one = run_layout(recipe, TRAIN, world=1)
    ckpt = tmp_path / "ckpt"
    layout = "parallel.tp=2" if family in DENSE else "parallel.ep=2"
    got = run_layout(recipe, TRAIN + [layout, "checkpoint.interval=3", f"checkpoint.dir={ckpt}"], world=2)
    key_bias_apart = hold_key_bias_aside(one, got, load_config(recipe).model)
    assert key_bias_apart <= 1e-5
    report = assert_equivalent(one, got, rtol=1e-5)
    print(f"\n{family} {layout}: losses {report.max_loss_rel:.1e}, parameters {report.max_param_rel:.1e} apart "
          f"(k biases {key_bias_apart:.1e} absolute)")
    (ckpt / "config.toml").write_bytes(recipe.read_bytes())
    to_hf(ckpt, tmp_path / "hf_out", log=quiet)
    trained = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out").float().eval()
    ours, _ = our_model(ckpt)
    tokens = torch.randint(0, hf_models.VOCAB, (2, SEQ))
    with torch.no_grad():
        want, have, before = trained(tokens).logits, ours(tokens), hf(tokens).logits
    assert (have - want).abs().max() <= 1e-5 * want.abs().max()
    assert (before - want).abs().max() > 1e-3  # training moved the weights: the check above can fail


def test_glm4_moe_mtp_layer_converts_as_deepseek_v3s(convert, tmp_path):
    """GLM-4.5 checkpoints carry their MTP layer as DeepSeek-V3's do: layer num_hidden_layers with enorm,
    hnorm, eh_proj over [enorm(embedding); hnorm(hidden)], shared_head.norm, copies of the embedding and
    head, and a decoder layer of its own (vLLM's vllm/model_executor/models/glm4_moe_mtp.py loads these
    names); transformers builds no MTP layer, so this checks the names and the round trip."""
    _, hf_dir, _ = convert("glm4_moe")
    config = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(hf_dir / "model.safetensors")
    L, D = config["num_hidden_layers"], config["hidden_size"]
    mtp = f"model.layers.{L}"
    for key in [k for k in tensors if k.startswith(f"model.layers.{L - 1}.")]:
        tensors[key.replace(f"layers.{L - 1}.", f"layers.{L}.")] = tensors[key] + 0.01
    tensors.update({f"{mtp}.enorm.weight": torch.rand(D), f"{mtp}.hnorm.weight": torch.rand(D),
                    f"{mtp}.eh_proj.weight": torch.randn(D, 2 * D), f"{mtp}.shared_head.norm.weight": torch.rand(D),
                    f"{mtp}.embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                    f"{mtp}.shared_head.head.weight": tensors["lm_head.weight"].clone()})
    src = tmp_path / "hf"
    src.mkdir()
    save_file(tensors, src / "model.safetensors")
    (src / "config.json").write_text(json.dumps(config))
    from_hf(src, tmp_path / "ours", log=quiet)
    assert load_config(tmp_path / "ours" / "recipe.toml").model.mtp.depth == 1
    to_hf(tmp_path / "ours", tmp_path / "back", log=quiet)
    have = load_file(tmp_path / "back" / "model.safetensors")
    assert have.keys() == tensors.keys(), set(have) ^ set(tensors)
    assert not [k for k in tensors if not torch.equal(have[k], tensors[k])]
    assert json.loads((tmp_path / "back" / "config.json").read_text())["num_nextn_predict_layers"] == 1


@pytest.mark.slow  # two training subprocesses, ~15 s
def test_to_hf_refuses_a_trained_bias_its_family_has_no_place_for(convert, tmp_path):
    """A mixtral-shaped run that balanced by the bias (model.moe.bias_update_speed > 0) routes by a bias
    transformers' Mixtral lacks: to-hf refuses rather than drop it (at speed 0 the same run exports)."""
    _, _, ours_dir = convert("mixtral")
    for speed, out in ((0.0, "zero"), (0.05, "moved")):
        run = tmp_path / out
        args = [a for kv in TRAIN + [f"train.output_dir={run}", "train.threads=1", "train.steps=2",
                                     f"model.moe.bias_update_speed={speed}"] for a in ("--set", kv)]
        done = subprocess.run([sys.executable, "-m", "moe_lc.train", str(ours_dir / "recipe.toml"), *args],
                              capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert done.returncode == 0, done.stderr
        if speed:
            with pytest.raises(ConvertError, match=r"layers.0.ffn.router.expert_bias is non-zero: mixtral routing "
                                                   r"has no bias"):
                to_hf(run, tmp_path / f"{out}_hf", log=quiet)
        else:
            to_hf(run, tmp_path / f"{out}_hf", log=quiet)
