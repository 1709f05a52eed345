"""A bridge to EleutherAI's lm-evaluation-harness: a moe_lc checkpoint as an lm-eval `LM`.

    python -m eval.lm_eval run --model moe_lc --model_args path=RUN_OR_CHECKPOINT[,recipe=R,max_length=N]
        --tasks NAME [--include_path DIR] [lm_eval's other arguments]
    python -m eval.lm_eval --model moe_lc ...           # lm_eval's legacy form (it inserts `run`)
    moe-lm-eval ...                                     # the same, installed

lm-eval 0.4.x has no plugin discovery, so this front end registers the model class with lm_eval's
registry under the name "moe_lc" and then hands its own command line to lm_eval's CLI unchanged; the
package also declares an entry point (group "lm_eval.models", pyproject.toml) for a later lm-eval that
discovers plugins. Needs the `[eval]` extra (pip install -e '.[eval]': lm-eval pinned).

model_args: path (run directory, checkpoint root, step directory or from-hf directory, as `python -m
eval`), recipe (default: the run's config.toml), set (recipe overrides, `;`-separated: set=a.b=1;c.d=2),
max_length (tokens the model sees: default the recipe's train.seq_len), max_gen_toks (default 256),
device (auto | cpu | cuda), threads. The model reads and writes text with the recipe's data.tokenizer;
`tokenizer=` is accepted and left to the tasks that read it from model_args (lm_eval's `ruler` tasks size
their prompts with a Hugging Face tokenizer of that name: a converted model's tokenizer/ directory).

The three request types, as lm_eval's docstrings define them:
  loglikelihood(context, continuation)  sum of log p(continuation | context) and whether greedy decoding
                                        gives it; an empty context is conditioned on EOS, and the context's
                                        trailing spaces move to the continuation (lm_eval's TemplateLM rule);
                                        inputs longer than max_length keep their last max_length tokens.
  loglikelihood_rolling(text)           the text's log-likelihood in windows of max_length (lm_eval's
                                        get_rolling_token_windows), the first conditioned on EOS.
  generate_until(context, gen_kwargs)   greedy decoding with the KV cache (moe_lc/model/decode.py) until EOS,
                                        max_gen_toks or one of `until` (cut there); sampling is refused.
"""

from __future__ import annotations

import sys

import torch

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from moe_lc.data import load_tokenizer
from moe_lc.model.decode import extend, new_cache, prefill
from moe_lc.preflight import resolve_device
from .model_io import forward_logits, load_eval_config, load_model, resolve_checkpoint

MODEL_NAME = "moe_lc"


class MoeLcLM(LM):
    """A moe_lc checkpoint behind lm_eval's `LM` interface (one process, no context parallelism)."""

    def __init__(self, path: str, recipe: str | None = None, set: str | None = None, max_length: int | None = None,
                 max_gen_toks: int = 256, device: str | None = "auto", threads: int = 0, batch_size=1,
                 max_batch_size=None, tokenizer: str | None = None, **unused):
        super().__init__()
        if unused:
            raise ValueError(f"moe_lc model_args: unknown {', '.join(sorted(unused))}; known: path, recipe, set, "
                             "max_length, max_gen_toks, device, threads, tokenizer")
        if threads:
            torch.set_num_threads(int(threads))
        step_dir, config_path = resolve_checkpoint(str(path))
        overrides = [x for x in str(set).split(";") if x] if set else []
        cfg = load_eval_config(config_path, recipe, overrides)
        self._device = resolve_device(device or "auto")
        self.model = load_model(step_dir, cfg, self._device)
        self.tok = load_tokenizer(cfg.data.tokenizer)
        self.max_length = int(max_length or cfg.train.seq_len)
        self.max_gen_toks = int(max_gen_toks)
        self.checkpoint = str(step_dir)

    # ------------------------------------------------------------------ scoring

    def _encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tok.encode(text)]

    def _continuation_logprob(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """sum log p(continuation | context) and whether every continuation token is the argmax."""
        tokens = (context + continuation)[-(self.max_length + 1):]
        logits = forward_logits(self.model, torch.tensor([tokens[:-1]]))[0]
        logp = torch.log_softmax(logits[-len(continuation):], -1)
        target = torch.tensor(continuation, device=logp.device)
        return logp.gather(-1, target[:, None]).sum().item(), bool((logp.argmax(-1) == target).all())

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out = []
        for request in requests:
            context, continuation = request.args
            spaces = len(context) - len(context.rstrip())
            if spaces:  # lm_eval's rule: word-boundary spaces belong to the continuation
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            whole, head = self._encode(context + continuation), self._encode(context)
            cont = whole[len(head):] if whole[:len(head)] == head else self._encode(continuation)
            head = head if context else [self.tok.eos_id]
            result = self._continuation_logprob(head, cont) if cont else (0.0, True)
            out.append(result)
            self.cache_hook.add_partial("loglikelihood", request.args, result)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for request in requests:
            (text,) = request.args
            total = 0.0
            for window in get_rolling_token_windows(self._encode(text), self.tok.eos_id, self.max_length, 1):
                context, predicted = make_disjoint_window(window)
                total += self._continuation_logprob(list(context), list(predicted))[0]
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return out

    # ------------------------------------------------------------------ generation

    @torch.no_grad()
    def _generate(self, context: str, until: list[str], max_gen: int) -> str:
        prompt = (self._encode(context) or [self.tok.eos_id])[-max(1, self.max_length - max_gen):]
        cache = new_cache(self.model, 1, len(prompt) + max_gen)
        logits, new = prefill(self.model, torch.tensor([prompt]), cache), []
        while len(new) < max_gen:
            token = int(logits[0].argmax())
            if token == self.tok.eos_id:
                break
            new.append(token)
            text = self.tok.decode(new)
            cut = min((text.index(u) for u in until if u and u in text), default=None)
            if cut is not None:
                return text[:cut]
            if len(new) < max_gen:
                logits = extend(self.model, torch.tensor([[token]]), cache)[:, -1]
        return self.tok.decode(new)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for request in requests:
            context, kwargs = request.args
            kwargs = dict(kwargs or {})
            if kwargs.get("do_sample") or float(kwargs.get("temperature", 0) or 0) > 0:
                raise ValueError("moe_lc generates greedily only: set do_sample=false / temperature=0 in the task")
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            text = self._generate(context, until, int(kwargs.get("max_gen_toks", self.max_gen_toks)))
            out.append(text)
            self.cache_hook.add_partial("generate_until", request.args, text)
        return out

    @property
    def tokenizer_name(self) -> str:
        return self.tok.name


def register() -> None:
    """Register MoeLcLM with lm_eval's model registry as "moe_lc" (again is harmless)."""
    try:
        register_model(MODEL_NAME)(MoeLcLM)
    except ValueError:  # registered already (by this module imported under another name): that one serves
        pass


def main(argv: list[str] | None = None) -> None:
    """lm_eval's own CLI with the moe_lc model registered; `argv` as lm_eval's (default: sys.argv[1:])."""
    from lm_eval.__main__ import cli_evaluate

    register()
    sys.argv = ["lm-eval", *(sys.argv[1:] if argv is None else argv)]
    cli_evaluate()


if __name__ == "__main__":
    main()
