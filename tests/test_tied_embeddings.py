"""Tied embeddings (model.tie_embeddings): one parameter is the embedding and the output head.

- Trains like one process over 10 steps (fp32, 1e-5) under tp2, pp2 1F1B (the first and last stages
  each hold a copy and sum its gradient over pp_tie), pp2 DualPipe (one copy per rank), pp2 x tp2 and
  dp2; after every step every copy of it on every rank is bit-identical, and a rank's head reads its
  embedding's tensor.
- Tiny tied Qwen3 and Llama models made with transformers' own classes: from-hf keeps them tied (no
  head tensor, the flag in the recipe), logits within 1e-5, to-hf gives back the same keys bit for bit
  and tie_word_embeddings, and 3 AdamW steps from them equal transformers' own 3 steps (torch AdamW on
  the HF model) on the same batches within 1e-5, losses and final weights.
- The planner counts the tied table once, and its pp_tie all-reduce as the run counts it.
- checkpoint.init_from of a tied conversion with model.tie_embeddings = false unties it: the head starts
  as a copy of the embedding (one line says so), the first loss is the tied model's, and pp2 1F1B and tp2
  train like one process; an untied checkpoint under a tied recipe is refused in one line naming the key.
"""

from __future__ import annotations

import shutil
import tempfile

import pytest
import torch

from moe_lc.config import load_config
from tests.harness import FAST, RECIPES, run_workers

DENSE = RECIPES / "dense_cpu.toml"
TIED = ["model.tie_embeddings=true", "train.steps=10", "train.seq_len=32", "train.global_batch=8",
        "train.micro_batch=1", "train.warmup_steps=2", "model.n_layers=4"]


def tied_steps(rank: int, world: int, overrides: list[str]) -> dict:
    """Train the tied dense model `train.steps` steps on this rank; after each step record this rank's copy
    of the tied parameter (None without one). Returns losses, copies, tp coordinate and (rank 0) the full
    final state."""
    from moe_lc.parallel.parallelize import full_state_dict
    from moe_lc.train import Trainer

    with tempfile.TemporaryDirectory(prefix="moe_lc_tied_") as tmp:
        cfg = load_config(DENSE, FAST + TIED + overrides + [f"train.output_dir={tmp}/run"], world_size=world)
        trainer = Trainer(cfg)
        losses, copies = [], []
        for _ in range(cfg.train.steps):
            losses.append(trainer.train_step().loss)
            trainer.step += 1
            model = trainer.model
            weight = dict(model.named_parameters()).get("embed.weight")
            assert model.head is None or model.head.weight is weight, "the head reads another tensor"
            copies.append(None if weight is None else weight.detach().clone())
        final = full_state_dict(trainer.parallel, trainer.dims)
        return {"losses": losses, "copies": copies, "tp": trainer.dims.coords()["tp"],
                "pp": trainer.dims.coords()["pp"], "final": final if rank == 0 else None}


_ONE: dict[tuple, dict] = {}


def one_process(model: tuple[str, ...]) -> dict:
    if model not in _ONE:
        _ONE[model] = run_workers(tied_steps, 1, list(model))[0]
    return _ONE[model]


def assert_like_one_process(overrides: list[str], world: int, holders: int, model: tuple[str, ...] = ()) -> None:
    """`overrides` (and `model`'s) on `world` ranks: losses and final parameters within 1e-5 of one process
    with `model`; every copy of the tied parameter equal bit for bit after every step (`holders`: ranks that
    must hold one)."""
    ref, ranks = one_process(model), run_workers(tied_steps, world, overrides + list(model))
    got = ranks[0]
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
    assert loss_rel <= 1e-5, (got["losses"], ref["losses"])
    assert got["final"].keys() == ref["final"].keys() and "head.weight" not in ref["final"]
    for name, want in ref["final"].items():
        rel = ((got["final"][name].double() - want.double()).norm() / want.double().norm()).item()
        assert rel <= 1e-5, (name, rel)
    with_copy = [r for r in ranks if r["copies"][0] is not None]
    assert len(with_copy) == holders
    for step in range(len(ref["losses"])):
        for tp in {r["tp"] for r in with_copy}:
            same_shard = [r["copies"][step] for r in with_copy if r["tp"] == tp]
            assert all(torch.equal(c, same_shard[0]) for c in same_shard), f"step {step + 1}: copies differ"


def test_tp2_like_one_process():
    assert_like_one_process(["parallel.tp=2"], 2, holders=2)


def test_pp2_1f1b_like_one_process():
    assert_like_one_process(["parallel.pp=2", "parallel.pp_schedule=1f1b"], 2, holders=2)


def test_pp2_dualpipe_like_one_process():
    assert_like_one_process(["parallel.pp=2", "parallel.pp_schedule=dualpipe"], 2, holders=2)


def test_pp2_dualpipe_mtp_like_one_process():
    """MTP's shared head is the tied tensor too (on DualPipe's last-stage chunk, whose embedding it is)."""
    assert_like_one_process(["parallel.pp=2", "parallel.pp_schedule=dualpipe"], 2, holders=2,
                            model=("model.mtp.depth=1",))


@pytest.mark.slow
@pytest.mark.parametrize("schedule, holders", [("zbh1", 2), ("interleaved_1f1b", 2), ("dualpipev", 1)])
def test_pp2_other_schedules_like_one_process(schedule, holders):
    """ZB-H1 defers the head's weight gradient (its W delivers the last stage's share); interleaved 1F1B
    holds stage 0 and the last stage on ranks 0 and 1 among other stages; DualPipeV holds both on rank 0."""
    assert_like_one_process(["parallel.pp=2", f"parallel.pp_schedule={schedule}"], 2, holders=holders)


@pytest.mark.slow
def test_pp2_tp2_like_one_process():
    assert_like_one_process(["parallel.pp=2", "parallel.tp=2", "parallel.pp_schedule=1f1b"], 4, holders=4)


def test_dp2_like_one_process():
    assert_like_one_process(["parallel.dp=2"], 2, holders=2)


@pytest.mark.slow
def test_checkpoint_of_both_copies_reshards_to_tp2(tmp_path):
    """Saved at pp2 1F1B (both stages save their copy of embed.weight and its optimizer state, the same
    boxes), resumed at tp2 (one vocabulary-sharded copy): the next steps match the run that went on."""
    from tests.harness import compare, run_layout

    ckpt = tmp_path / "ckpt"
    base = TIED + ["train.steps=6", "checkpoint.interval=3", f"checkpoint.dir={ckpt}"]
    original = run_layout(DENSE, base + ["parallel.pp=2"], world=2)
    assert "head.weight" not in original.final_state
    shutil.rmtree(ckpt / "step_00000006")
    resumed = run_layout(DENSE, base + ["parallel.tp=2", "checkpoint.resume=true"], world=2)
    assert max(abs(a - b) / b for a, b in zip(resumed.losses, original.losses[3:])) < 1e-5
    report = compare(original, resumed.__class__(original.losses[:3] + resumed.losses, resumed.grad_norms,
                                                 resumed.final_state, [], [], 2))
    assert report.max_param_rel < 1e-5, report


# -- tiny tied Qwen3 and Llama models of transformers' own classes --------------------------------------

transformers = pytest.importorskip("transformers")  # the eval extra: `pip install -e '.[eval]'`

from tests import hf_models  # noqa: E402

TRAIN_HF = ["precision.recipe=fp32", "train.steps=3", "train.seq_len=32", "train.global_batch=2",
            "train.micro_batch=1", "train.warmup_steps=0", "train.lr_schedule=constant", "train.lr=1e-3",
            "train.weight_decay=0", "train.grad_clip=0", "train.threads=1", "data.source=stdlib"]


def tied_config(family: str):
    config = {"qwen3": hf_models.qwen3, "llama": hf_models.llama}[family]()
    config.tie_word_embeddings = True  # as Qwen3-0.6B and Llama-3.2-1B ship
    return config


@pytest.fixture(scope="module")
def tied_hf(tmp_path_factory):
    """family -> (transformers model, its directory, our conversion's directory)."""
    from moe_lc.convert import from_hf

    out = {}
    for family in ("qwen3", "llama"):
        base = tmp_path_factory.mktemp(f"tied_{family}")
        model = hf_models.save_model(tied_config(family), base / "hf")
        assert model.lm_head.weight is model.model.embed_tokens.weight
        from_hf(base / "hf", base / "ours", log=lambda *_: None)
        out[family] = (model, base / "hf", base / "ours")
    return out


def as_hf(state: dict, cfg, family: str) -> dict:
    """Our full tensors cut into transformers' tensors by the conversion table."""
    from moe_lc.convert.hf_names import pieces, to_theirs

    out = {}
    for p in pieces(cfg.model, family):
        region = state[p.ours]
        for d, (start, size) in enumerate(zip(p.offset, p.box_shape())):
            region = region.narrow(d, start, size)
        out[p.theirs] = to_theirs(p, region, cfg.model.mla.qk_rope_head_dim).clone()
    return out


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_tied_hf_converts_tied_and_comes_back(tied_hf, family, tmp_path):
    import json

    from safetensors.torch import load_file

    from eval.model_io import load_eval_config, load_model, resolve_checkpoint
    from moe_lc.job.checkpoint import checkpoint_keys, find_checkpoint
    from moe_lc.convert import to_hf

    hf, hf_dir, ours_dir = tied_hf[family]
    step, recipe = resolve_checkpoint(ours_dir)
    cfg = load_eval_config(recipe, None, [])
    assert cfg.model.tie_embeddings and "tie_embeddings = true" in (ours_dir / "recipe.toml").read_text()
    keys = checkpoint_keys(find_checkpoint(ours_dir))
    assert "model.embed.weight" in keys and "model.head.weight" not in keys
    ours = load_model(step, cfg)
    assert ours.head.weight is ours.embed.weight
    tokens = torch.randint(0, hf_models.VOCAB, (2, 96))
    with torch.no_grad():
        want, have = hf(tokens).logits, ours(tokens)
    assert ((have - want).abs().max() / want.abs().max()).item() <= 1e-5
    to_hf(ours_dir, tmp_path / "back", log=lambda *_: None)
    back, orig = load_file(tmp_path / "back" / "model.safetensors"), load_file(hf_dir / "model.safetensors")
    assert back.keys() == orig.keys() and "lm_head.weight" not in back, set(back) ^ set(orig)
    assert all(back[k].dtype == orig[k].dtype and torch.equal(back[k], orig[k]) for k in orig)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["tie_word_embeddings"] is True
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight


def train_ours(ours_dir, tmp) -> tuple[list[float], list[list[torch.Tensor]], dict, object]:
    """3 steps of our trainer from the conversion: (losses, each step's micro-batch tokens (B, S+1), the
    final full state, the config)."""
    from moe_lc.parallel.parallelize import full_state_dict
    from moe_lc.job.preflight import init_from_checkpoint
    from moe_lc.train import Trainer

    cfg = load_config(ours_dir / "recipe.toml", TRAIN_HF + [f"train.output_dir={tmp}/run"])
    trainer = Trainer(cfg)
    trainer.checkpointer.load_weights(init_from_checkpoint(cfg), trainer.parallel, trainer.optimizer)
    batches, next_step = [], trainer.loader.next_step

    def recorded():
        micro = next_step()
        assert all(mb["loss_mask"] is None for mb in micro)
        batches.append([mb["tokens"].clone() for mb in micro])
        return micro

    trainer.loader.next_step = recorded
    losses = []
    for _ in range(cfg.train.steps):
        losses.append(trainer.train_step().loss)
        trainer.step += 1
    return losses, batches, full_state_dict(trainer.parallel, trainer.dims), cfg


def train_transformers(hf, batches, cfg) -> list[float]:
    """transformers' model trained on the same micro-batches with torch's AdamW (the update rule HF's
    Trainer uses), the same hyper-parameters; the loss is the summed token loss over the step's tokens."""
    t = cfg.train
    opt = torch.optim.AdamW(hf.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, weight_decay=0.0)
    hf.train()
    losses = []
    for micro in batches:
        n_tokens = sum(tokens[:, 1:].numel() for tokens in micro)
        total = 0.0
        for tokens in micro:
            logits = hf(tokens[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(),
                                                     reduction="sum") / n_tokens
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_training_from_tied_hf_equals_transformers(tied_hf, family, tmp_path):
    import copy

    hf, _, ours_dir = tied_hf[family]
    losses, batches, state, cfg = train_ours(ours_dir, tmp_path)
    assert "head.weight" not in state
    hf = copy.deepcopy(hf)
    want_losses = train_transformers(hf, batches, cfg)
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses)) <= 1e-5, (losses, want_losses)
    have, want = as_hf(state, cfg, family), dict(hf.named_parameters())
    assert have.keys() == want.keys(), set(have) ^ set(want)
    worst = max(((have[k].double() - w.detach().double()).norm() / w.detach().double().norm()).item()
                for k, w in want.items())
    print(f"\n{family}: losses {losses}, rel diff {max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses)):.1e}, "
          f"weights {worst:.1e}")
    assert worst <= 1e-5, worst


# -- the planner ------------------------------------------------------------------------------------------

def test_planner_counts_the_tied_table_once_and_its_pp_tie_all_reduce():
    """The parameter count and the plan's table hold the tied (V, D) once; each of the two stages holding
    a copy all-reduces its reduced fp32 shard over pp_tie: 2 (n-1)/n x 4 V D bytes (dp = 1, n = 2), as a real
    pp2 1F1B run counts it (with every other counter and the optimizer bytes: tests/test_plan.py's check);
    DualPipe, whose rank 0 holds both ends, plans none."""
    from moe_lc.model.counting import param_counts
    from tests.test_plan import RECIPE, SMALL, _check_layout
    from tools.planner.plan import plan

    over = ["model.tie_embeddings=true", "parallel.pp=2", "parallel.dp=1", "train.micro_batch=2"]
    cfg = load_config(RECIPE, SMALL + over, world_size=2)
    V, D = cfg.model.vocab_size, cfg.model.dim
    untied = param_counts(load_config(RECIPE, SMALL + over[1:], world_size=2).model)
    assert param_counts(cfg.model)["total"] == untied["total"] - V * D
    assert param_counts(cfg.model)["activated"] == untied["activated"]  # the table is still the head's matmul
    for rank in plan(cfg, 2).ranks:
        assert [r.numel for r in rank.table if r.state == "params" and "tied" in r.part] == [V * D]
        assert rank.comm_per_step()["comm/pp_tie/all_reduce_bytes"] == 2 * (2 - 1) * 4 * V * D // 2
    dualpipe = load_config(RECIPE, SMALL + over + ["parallel.pp_schedule=dualpipe", "train.micro_batch=1"],
                           world_size=2)
    assert all("comm/pp_tie/all_reduce_bytes" not in r.comm_per_step() for r in plan(dualpipe, 2).ranks)
    _check_layout("pp2-tied", 2, over, act_rtol=None)  # PP activations: not measured there either


# -- untying a tied checkpoint on load (checkpoint.init_from), and refusing to tie an untied one ------------

def started_from(ours_dir, tmp, *overrides):
    """A trainer with `ours_dir`'s weights loaded as checkpoint.init_from loads them."""
    from moe_lc.job.preflight import init_from_checkpoint
    from moe_lc.train import Trainer

    cfg = load_config(ours_dir / "recipe.toml", TRAIN_HF + [f"train.output_dir={tmp}/run", *overrides])
    trainer = Trainer(cfg)
    trainer.checkpointer.load_weights(init_from_checkpoint(cfg), trainer.parallel, trainer.optimizer)
    return trainer


def test_a_tied_checkpoint_unties_on_load(tied_hf, tmp_path, capsys):
    """model.tie_embeddings = false over a tied conversion: the head starts as a copy of the embedding (one
    line says so), so the first forward, and its loss, are the tied model's; then the two tables train apart."""
    from moe_lc.job.checkpoint import find_checkpoint

    _, _, ours = tied_hf["qwen3"]
    step = find_checkpoint(ours)
    tied = started_from(ours, tmp_path / "tied")
    capsys.readouterr()
    untied = started_from(ours, tmp_path / "untied", "model.tie_embeddings=false")
    assert capsys.readouterr().out.count(
        f"checkpoint.init_from: {step} is tied (model.tie_embeddings = true) and this recipe is not: the head "
        "starts as a copy of the embedding\n") == 1
    head, embed = untied.model.head.weight, untied.model.embed.weight
    assert head is not embed and torch.equal(head, embed) and torch.equal(embed, tied.model.embed.weight)
    assert untied.train_step().loss == tied.train_step().loss
    assert not torch.equal(untied.model.head.weight, untied.model.embed.weight)


def test_untie_on_load_under_pp2_and_tp2_like_one_process(tied_hf):
    """pp2 1F1B: the head lives on the last stage, the embedding on the first; tp2: each rank holds a
    vocabulary shard of both. Each rank reads the saved embedding into its own head boxes, and 3 steps
    equal one process (fp32, 1e-5)."""
    from tests.harness import run_layout

    _, _, ours = tied_hf["qwen3"]
    recipe, untie = ours / "recipe.toml", TRAIN_HF + ["model.tie_embeddings=false"]
    one = run_layout(recipe, untie, world=1)
    assert "head.weight" in one.final_state
    for layout in (["parallel.pp=2", "parallel.pp_schedule=1f1b"], ["parallel.tp=2"]):
        got = run_layout(recipe, untie + layout, world=2)
        assert max(abs(a - b) / abs(b) for a, b in zip(got.losses, one.losses)) <= 1e-5, (layout, got.losses)
        assert got.final_state.keys() == one.final_state.keys()
        for name, want in one.final_state.items():
            rel = ((got.final_state[name].double() - want.double()).norm() / want.double().norm()).item()
            assert rel <= 1e-5, (layout, name, rel)


def test_tying_an_untied_checkpoint_is_refused_in_one_line(tied_hf, tmp_path):
    """An untied model's head is a trained tensor apart from its embedding: tying keeps one, so it is refused
    naming model.tie_embeddings; a tied checkpoint where no loader unties (resume, to-hf, eval) names it too;
    every lacks / holds line names the tensors."""
    from moe_lc.job.checkpoint import find_checkpoint, weight_errors
    from moe_lc.config import ConfigError
    from moe_lc.convert import from_hf
    from moe_lc.model.transformer import state_shapes
    from moe_lc.job.preflight import init_from_checkpoint

    hf_models.save_model(hf_models.qwen3(), tmp_path / "hf")  # untied
    from_hf(tmp_path / "hf", tmp_path / "untied", log=lambda *_: None)
    step = find_checkpoint(tmp_path / "untied")
    cfg = load_config(tmp_path / "untied" / "recipe.toml", ["model.tie_embeddings=true"])
    with pytest.raises(ConfigError) as refused:
        init_from_checkpoint(cfg)
    assert refused.value.errors == [
        f"checkpoint.init_from: {step} holds an untied model (a head.weight trained apart from embed.weight) but "
        "the recipe sets model.tie_embeddings = true: one tensor cannot be both, and the two differ, so tying would "
        "throw one away; set model.tie_embeddings = false"], refused.value.errors

    _, _, tied = tied_hf["qwen3"]
    tied_step = find_checkpoint(tied)
    untied_model = load_config(tied / "recipe.toml", ["model.tie_embeddings=false"]).model
    assert weight_errors(tied_step, state_shapes(untied_model), untie=True) == []
    (line,) = weight_errors(tied_step, state_shapes(untied_model))
    assert line.startswith(f"{tied_step} holds a tied model (its embed.weight is also the head, no head.weight) "
                           "but the recipe sets model.tie_embeddings = false: set it to true"), line
    one_layer = load_config(tied / "recipe.toml", ["model.n_layers=1", "model.moe.n_dense_layers=1",
                                                   "model.tie_embeddings=false"]).model
    extra = weight_errors(tied_step, state_shapes(one_layer), untie=True)
    assert len(extra) == 1 and f"{tied_step} holds 8 tensors: layers.1.attn_norm.weight, " in extra[0], extra
