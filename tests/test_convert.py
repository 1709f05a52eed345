"""Hugging Face interop: tiny random models of each family made with transformers itself
(tests/hf_models.py), converted, and held to transformers' numbers.

- from-hf: our fp32 logits equal transformers' within 1e-5 of max |logit| at 96 tokens, past YaRN's
  original 64; every parameter's gradient, mapped back through the same table, equals transformers'.
- from-hf -> to-hf gives back every input tensor bit for bit (MTP layers and fp8 weights included).
- A converted model trains under tp2 x ep2 with the losses of one process, its to-hf output loads in
  transformers with our logits, and `python -m eval` scores it with its own tokenizer.
- Refusals: one message naming the field and value, before any weight is read.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eval.model_io import load_eval_config, load_model, resolve_checkpoint
from moe_lc.job.checkpoint import find_checkpoint
from moe_lc.config import load_config
from moe_lc.convert import ConvertError, from_hf, to_hf
from moe_lc.convert.hf_files import HFWeights
from moe_lc.convert.hf_names import pieces, to_theirs
from moe_lc.data import load_tokenizer
from tests import hf_models
from tests.harness import assert_equivalent, run_layout

transformers = pytest.importorskip("transformers")  # a dev dependency: `pip install -e '.[dev]'`
from safetensors.torch import load_file, save_file  # noqa: E402

SEQ = 96  # > the original 64 of every tiny model's YaRN
ROOT = Path(__file__).resolve().parents[1]


def quiet(*_):
    pass


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """family -> (transformers model, HF dir, our converted dir)."""
    out = {}
    for family, make in hf_models.FAMILIES.items():
        base = tmp_path_factory.mktemp(family)
        model = hf_models.save_model(make(), base / "hf")
        from_hf(base / "hf", base / "ours", log=quiet)
        out[family] = (model, base / "hf", base / "ours")
    return out


def our_model(directory: Path):
    step, recipe = resolve_checkpoint(directory)
    cfg = load_eval_config(recipe, None, [])
    return load_model(step, cfg), cfg


def hf_tensor_of_grads(ours, cfg, family):
    """Our parameters' gradients cut into HF tensors by the conversion table (a tied model's embed.weight
    holds both uses' gradient, as transformers' tied embed_tokens does)."""
    grads = {n: p.grad for n, p in ours.named_parameters()}
    out = {}
    for p in pieces(cfg.model, family):
        if p.ours not in grads:
            continue
        region = grads[p.ours]
        for d, (start, size) in enumerate(zip(p.offset, p.box_shape())):
            region = region.narrow(d, start, size)
        part = to_theirs(p, region, cfg.model.mla.qk_rope_head_dim)
        if p.cols is not None:
            full = out.setdefault(p.theirs, torch.zeros(p.shape))
            full[:, p.cols[0]:p.cols[1]] = part
        else:
            out[p.theirs] = part.clone()
    return out


def checkpoint_grads(hf, family: str, expert_ffn: int) -> dict[str, torch.Tensor]:
    """transformers' parameter gradients under the names save_pretrained writes: its fused experts
    (gate_up_proj (E, 2F, D), down_proj (E, D, F)) one tensor per expert, Mixtral's `mlp` as
    `block_sparse_moe` with w1 / w3 / w2."""
    gate, up, down = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    out, F = {}, expert_ffn
    for name, p in hf.named_parameters():
        if p.grad is None:
            continue
        g = p.grad
        if family == "mixtral":
            name = name.replace(".mlp.", ".block_sparse_moe.")
        if name.endswith("experts.gate_up_proj"):
            for e in range(g.shape[0]):
                out[name.replace("gate_up_proj", f"{e}.{gate}.weight")] = g[e, :F]
                out[name.replace("gate_up_proj", f"{e}.{up}.weight")] = g[e, F:]
        elif name.endswith("experts.down_proj"):
            for e in range(g.shape[0]):
                out[name.replace("down_proj", f"{e}.{down}.weight")] = g[e]
        else:
            out[name] = g
    return out


def forward_backward_both(ours, hf, cfg, family: str) -> tuple[float, dict[str, torch.Tensor]]:
    """Our model and transformers' on the same random tokens (2, SEQ), each backward from the same random
    weighting of its logits: (max |logit diff| / max |logit|, transformers' gradients by checkpoint name)."""
    tokens = torch.randint(0, hf_models.VOCAB, (2, SEQ))
    weights = torch.randn(2, SEQ, hf_models.VOCAB)
    ours.zero_grad(), hf.zero_grad()
    ours_logits, hf_logits = ours(tokens), hf(tokens).logits
    logit_diff = ((ours_logits - hf_logits).abs().max() / hf_logits.abs().max()).item()
    (ours_logits * weights).sum().backward()
    (hf_logits * weights).sum().backward()
    return logit_diff, checkpoint_grads(hf, family, cfg.model.moe.ffn_dim)


@pytest.mark.parametrize("family", list(hf_models.FAMILIES))
def test_logits_and_gradients_match_transformers(converted, family):
    hf, hf_dir, ours_dir = converted[family]
    ours, cfg = our_model(ours_dir)
    logit_diff, hf_grads = forward_backward_both(ours, hf, cfg, family)
    assert logit_diff <= 1e-5
    mapped = hf_tensor_of_grads(ours, cfg, family)
    assert set(mapped) == set(hf_grads), set(mapped) ^ set(hf_grads)
    for name, want in hf_grads.items():
        have = mapped[name]
        assert (have - want).abs().max() <= 1e-4 * want.abs().max().clamp_min(1e-6), name


def _with_mtp_and_fp8(hf_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    """A DeepSeek-V3 directory as published: an MTP layer (number n_layers) with its copies of the
    embedding and head, and block-fp8 weights with scale_inv; returns the dequantized tensors."""
    config = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(hf_dir / "model.safetensors")
    L = config["num_hidden_layers"]
    mtp = f"model.layers.{L}"
    for key in [k for k in tensors if k.startswith(f"model.layers.{L - 1}.")]:
        tensors[key.replace(f"layers.{L - 1}.", f"layers.{L}.")] = tensors[key] + 0.01
    D = config["hidden_size"]
    tensors.update({f"{mtp}.enorm.weight": torch.rand(D), f"{mtp}.hnorm.weight": torch.rand(D),
                    f"{mtp}.eh_proj.weight": torch.randn(D, 2 * D), f"{mtp}.shared_head.norm.weight": torch.rand(D),
                    f"{mtp}.embed_tokens.weight": tensors["model.embed_tokens.weight"],
                    f"{mtp}.shared_head.head.weight": tensors["lm_head.weight"]})
    tensors = {k: v.to(torch.bfloat16) if v.dtype == torch.float32 and not k.endswith("correction_bias") else v
               for k, v in tensors.items()}
    quantized = "model.layers.1.self_attn.q_b_proj.weight"  # (96, 32): a partial 128 x 128 block
    w = tensors[quantized].float()
    scale = torch.tensor([[w.abs().max().item() / 448.0]])
    tensors[quantized] = (w / scale).to(torch.float8_e4m3fn)
    tensors[quantized + "_scale_inv"] = scale
    out.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors")
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (out / "config.json").write_text(json.dumps(config))
    want = dict(tensors)
    want[quantized] = (tensors[quantized].float() * scale).to(torch.bfloat16)
    del want[quantized + "_scale_inv"]
    return want


def test_from_hf_then_to_hf_is_bit_identical(converted, tmp_path):
    for family, (_, hf_dir, ours_dir) in converted.items():
        back = tmp_path / f"{family}_back"
        to_hf(ours_dir, back, log=quiet)
        have, want = load_file(back / "model.safetensors"), load_file(hf_dir / "model.safetensors")
        assert have.keys() == want.keys(), (family, set(have) ^ set(want))
        bad = [k for k in want if have[k].dtype != want[k].dtype or not torch.equal(have[k], want[k])]
        assert not bad, (family, bad[:4])
        assert (back / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()
    # DeepSeek-V3 as published: MTP layer, fp8 weights (dequantized to bf16 on the way in), two input shards
    published = _with_mtp_and_fp8(converted["deepseek_v3"][1], tmp_path / "published")
    from_hf(tmp_path / "published", tmp_path / "published_ours", log=quiet)
    recipe = load_config(tmp_path / "published_ours" / "recipe.toml")
    assert recipe.model.mtp.depth == 1
    to_hf(tmp_path / "published_ours", tmp_path / "published_back", max_shard_bytes=200_000, log=quiet)
    index = json.loads((tmp_path / "published_back" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    have = {}
    for shard in set(index["weight_map"].values()):
        have.update(load_file(tmp_path / "published_back" / shard))
    assert have.keys() == published.keys(), set(have) ^ set(published)
    bad = [k for k in published if not torch.equal(have[k], published[k])]
    assert not bad, bad[:4]


def test_fp8_weights_dequantize_blockwise(tmp_path):
    w = torch.randn(200, 300)
    scale = torch.rand(2, 3) + 0.5  # one per 128 x 128 block, the last ones partial
    q = (w / scale.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]).to(torch.float8_e4m3fn)
    save_file({"w": q, "w_scale_inv": scale}, tmp_path / "model.safetensors")
    weights = HFWeights(tmp_path, {"quant_method": "fp8", "weight_block_size": [128, 128]})
    got = weights.get("w")
    assert got.dtype == torch.bfloat16 and weights.out_dtype("w") == torch.bfloat16
    assert torch.equal(got[130:, 260:], (q[130:, 260:].float() * scale[1, 2]).to(torch.bfloat16))
    assert torch.equal(got[:128, :128], (q[:128, :128].float() * scale[0, 0]).to(torch.bfloat16))
    weights.close()


@pytest.mark.parametrize("field, value, message", [
    ("use_sliding_window", True, "use_sliding_window=True is not supported"),
    ("rope_parameters", {"rope_type": "dynamic", "rope_theta": 5e5, "factor": 8.0}, "rope_scaling.type='dynamic'"),
    ("model_type", "mistral", "model_type='mistral' is not supported"),
    ("hidden_act", "gelu", "hidden_act='gelu' is not supported"),
])
def test_unsupported_config_is_refused_before_any_weight_is_read(converted, tmp_path, monkeypatch, field, value,
                                                                  message):
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    source = converted["qwen2"][1]
    config = json.loads((source / "config.json").read_text())
    config[field] = value
    (hf_dir / "config.json").write_text(json.dumps(config))
    (hf_dir / "model.safetensors").symlink_to(source / "model.safetensors")
    monkeypatch.setattr(HFWeights, "get", lambda *a: pytest.fail("a weight was read"))
    with pytest.raises(ConvertError, match=message.replace("(", r"\(").replace("[", r"\[")):
        from_hf(hf_dir, tmp_path / "out", log=quiet)
    assert not (tmp_path / "out").exists()


def test_missing_or_misshapen_tensor_is_named(converted, tmp_path):
    source = converted["llama"][1]
    tensors = load_file(source / "model.safetensors")
    for case, edit, message in [
            ("missing", lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"),
             "model.layers.1.self_attn.k_proj.weight is missing"),
            ("shape", lambda t: t.update({"model.norm.weight": torch.ones(65)}),
             r"model.norm.weight: shape \(65,\) in the checkpoint, \(64,\) from config.json")]:
        hf_dir = tmp_path / case
        hf_dir.mkdir()
        (hf_dir / "config.json").write_bytes((source / "config.json").read_bytes())
        copy = dict(tensors)
        edit(copy)
        save_file(copy, hf_dir / "model.safetensors")
        result = subprocess.run([sys.executable, "-m", "moe_lc.convert", "from-hf", str(hf_dir), "--out",
                                 str(tmp_path / f"{case}_out")], capture_output=True, text=True, cwd=ROOT)
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
        assert __import__("re").search(message, result.stderr), result.stderr


def test_to_hf_refuses_what_transformers_cannot_compute(converted, tmp_path):
    _, _, ours = converted["deepseek_v3"]
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'extends = "{ours / "recipe.toml"}"\n[model.moe]\nscore_func = "softmax"\n')
    with pytest.raises(ConvertError, match="neither DeepSeek-V3's"):
        to_hf(ours, tmp_path / "x", recipe=recipe, log=quiet)


# -- training from converted weights --------------------------------------------------------------

TRAIN = ["data.source=synthetic", f"train.seq_len={SEQ}", "train.global_batch=4", "train.micro_batch=1",
         "train.steps=3", "train.warmup_steps=1", "train.lr=1e-3"]


def test_converted_model_trains_alike_under_tp2_ep2_and_exports(converted, tmp_path):
    hf, _, ours_dir = converted["deepseek_v3"]
    recipe = ours_dir / "recipe.toml"
    one = run_layout(recipe, TRAIN, world=1)
    ckpt = tmp_path / "ckpt"
    got = run_layout(recipe, TRAIN + ["parallel.tp=2", "parallel.ep=2", "checkpoint.interval=3",
                                      f"checkpoint.dir={ckpt}"], world=4)
    assert_equivalent(one, got, rtol=1e-5)
    assert one.losses[0] == pytest.approx(got.losses[0], rel=1e-6)
    # the trained weights, gathered from tp2 x ep2 boxes, load in transformers with our logits
    (ckpt / "config.toml").write_bytes(recipe.read_bytes())  # the recipe beside the checkpoint root
    to_hf(ckpt, tmp_path / "hf_out", log=quiet)
    trained = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out").float().eval()
    ours, _ = our_model(ckpt)
    tokens = torch.randint(0, hf_models.VOCAB, (2, SEQ))
    with torch.no_grad():
        want, have = trained(tokens).logits, ours(tokens)
        before = hf(tokens).logits
    assert (have - want).abs().max() <= 1e-5 * want.abs().max()
    assert (before - want).abs().max() > 1e-3  # training moved the weights: the check above can fail


def test_init_from_is_weights_only_and_names_shape_mismatches(converted, tmp_path):
    _, _, ours_dir = converted["llama"]
    recipe = ours_dir / "recipe.toml"
    out = tmp_path / "run"
    base = [sys.executable, "-m", "moe_lc.train", str(recipe)] + [a for kv in TRAIN + [
        f"train.output_dir={out}", "train.threads=1"] for a in ("--set", kv)]
    done = subprocess.run(base, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "checkpoint.init_from" in done.stdout and "step 1/3" in done.stdout
    bad = subprocess.run(base + ["--set", "model.ffn_dim=128"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert bad.returncode == 2
    assert "layers.0.ffn.w13.weight is (192, 64)" in bad.stderr and "but (256, 64) in the recipe" in bad.stderr
    assert bad.stderr.startswith("error: invalid recipe") and "Traceback" not in bad.stderr
    gone = subprocess.run(base + ["--set", f"checkpoint.init_from={tmp_path / 'nowhere'}"], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert gone.returncode == 2 and "no such run or checkpoint directory" in gone.stderr


def test_eval_scores_a_converted_model_with_its_own_tokenizer(converted, tmp_path):
    _, hf_dir, ours_dir = converted["qwen2"]
    result = subprocess.run([sys.executable, "-m", "eval", str(ours_dir), "--tasks", "passkey,perplexity",
                             "--lengths", "96", "--samples", "1", "--depths", "0.5", "--ppl-tokens", "500",
                             "--out", str(tmp_path / "eval")], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    tok = load_tokenizer(str(ours_dir / "tokenizer"))  # the directory form: specials from tokenizer_config.json
    assert results["tokenizer"] == tok.name and tok.name.startswith("hf-tokenizer-")
    assert results["checkpoint"] == str(find_checkpoint(ours_dir))
    assert results["tasks"]["passkey"]["by_length"]["96"]["n"] == 1
    assert tok.eos_id == tok._tok.token_to_id("<|end|>") and tok.pad_id == tok._tok.token_to_id("<|pad|>")
    assert tok.bos_id == tok._tok.token_to_id("<|begin|>")


# -- streaming ---------------------------------------------------------------------------------------

# VmHWM, not ru_maxrss: the latter keeps the forking parent's peak across exec
PEAK_SCRIPT = """
from moe_lc.convert import from_hf, to_hf
{call}
print([int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM")][0])
"""


def _peak_rss(call: str) -> int:
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT.format(call=call)], capture_output=True, text=True,
                         cwd=ROOT, timeout=1200)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip().splitlines()[-1])


def write_big_deepseek(directory: Path, shard_bytes: int) -> int:
    """A DeepSeek-V3-shaped directory of ~1.7 GB fp32 random weights in shards of `shard_bytes`, written
    shard by shard (names and shapes from the conversion table); returns its weight bytes."""
    from moe_lc.config import MLAConfig, MoEConfig, RopeConfig, model_config
    from moe_lc.convert.hf_config import to_hf_config

    cfg = model_config(vocab_size=32000, dim=1024, n_layers=8, n_heads=8, n_kv_heads=8, ffn_dim=2048,
                       attention="mla", mla=MLAConfig(q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64,
                                                      qk_rope_head_dim=32, v_head_dim=64),
                       moe=MoEConfig(n_dense_layers=1, n_routed_experts=32, n_shared_experts=1, ffn_dim=512, topk=4,
                                     n_groups=4, topk_groups=2), rope=RopeConfig())
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(to_hf_config(cfg, "deepseek_v3", 4096)))
    weight_map, shard, size, total = {}, {}, 0, 0

    def flush():
        nonlocal shard, size
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, directory / name)
        weight_map.update({k: name for k in shard})
        shard, size = {}, 0

    for key, shape in dict.fromkeys((p.theirs, p.shape) for p in pieces(cfg, "deepseek_v3")):
        t = torch.randn(shape) * 0.02
        if size + t.numel() * 4 > shard_bytes and shard:
            flush()
        shard[key], size, total = t, size + t.numel() * 4, total + t.numel() * 4
    flush()
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return total


@pytest.mark.slow
def test_conversion_streams_in_bounded_memory(tmp_path):
    """from-hf and to-hf of a 1.7 GB model in 200 MB shards stay far below the model's size: near the
    interpreter + one shard + one layer (to-hf: the output shard being filled holds the previous
    layer, and DCP's read of a box briefly holds it twice). The measured numbers are printed."""
    total = write_big_deepseek(tmp_path / "hf", 200 * 10**6)
    base = _peak_rss("pass")
    into = _peak_rss(f"from_hf({str(tmp_path / 'hf')!r}, {str(tmp_path / 'ours')!r}, log=lambda *a: None)")
    back = _peak_rss(f"to_hf({str(tmp_path / 'ours')!r}, {str(tmp_path / 'back')!r}, max_shard_bytes=200 * 10**6,"
                     " log=lambda *a: None)")
    layer = 32 * 3 * 1024 * 512 * 4  # one MoE layer's experts, fp32
    mb = 2**20
    print(f"\nweights {total / mb:.0f} MiB, interpreter {base / mb:.0f} MiB; peak RSS above it: "
          f"from-hf {(into - base) / mb:.0f} MiB, to-hf {(back - base) / mb:.0f} MiB (one layer {layer / mb:.0f} MiB)")
    assert into - base < 200 * 10**6 + 2 * layer < total / 2
    assert back - base < 200 * 10**6 + 3 * layer < total / 2
