"""The moe_lc model behind lm-evaluation-harness's `LM` interface (eval/lm_eval.py registers it and runs
lm_eval's CLI; this module needs the `[eval]` extra).

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

import torch

from lm_eval.api.model import LM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from moe_lc.cpu_threads import apply_threads
from moe_lc.data import load_tokenizer
from moe_lc.model.decode import extend, new_cache, prefill
from .lm_eval_args import BridgeError, greedy_error, resolve_model_args
from .model_io import forward_logits, load_model


class MoeLcLM(LM):
    """A moe_lc checkpoint behind lm_eval's `LM` interface (one process, no context parallelism)."""

    def __init__(self, batch_size=1, max_batch_size=None, device: str | None = None, **model_args):
        """model_args: lm_eval's --model_args (eval/lm_eval.py: KNOWN_ARGS), device: lm_eval's --device
        (model_args' device wins); a mistake is a BridgeError."""
        super().__init__()
        args = resolve_model_args(model_args, device)
        apply_threads(args.threads, "threads=")  # 0: the idle cores, as train.threads and eval's --threads
        self._device = args.device
        self.model = load_model(args.step_dir, args.cfg, self._device)
        self.tok = load_tokenizer(args.cfg.data.tokenizer)
        self.max_length, self.max_gen_toks = args.max_length, args.max_gen_toks
        self.checkpoint = str(args.step_dir)

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
            refused = greedy_error(kwargs)
            if refused:
                raise BridgeError(f"task {getattr(request, 'task_name', None) or '?'}: generation_kwargs {refused}")
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            text = self._generate(context, until, int(kwargs.get("max_gen_toks", self.max_gen_toks)))
            out.append(text)
            self.cache_hook.add_partial("generate_until", request.args, text)
        return out

    @property
    def tokenizer_name(self) -> str:
        return self.tok.name
