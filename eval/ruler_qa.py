"""RULER's QA tasks: a question over its gold paragraph(s) hidden among distractor paragraphs.

qa_1 reads SQuAD, qa_2 HotpotQA (RULER's qa.py, which downloads SQuAD v2's and HotpotQA's dev sets);
here the user gives each as a local JSONL file (`--squad FILE`, `--hotpotqa FILE`), one question per line,
and without one the task is skipped with a line saying so. Accepted rows (the shapes of the original
files' entries and of their Hugging Face `datasets` exports, written as JSON lines):

  SQuAD     {"question": str, "context": str, "answers": {"text": [str, ...]} or [str, ...]
             or [{"text": str}, ...], "title": str (optional)}   rows without an answer are skipped
  HotpotQA  {"question": str, "answer": str, "context": [[title, [sentence, ...]], ...]
             or {"title": [...], "sentences": [[...], ...]}}

Documents are every distinct paragraph of the file (SQuAD) or "title\\nsentences" (HotpotQA). A sample
takes a seeded random question (RULER takes the file's questions in order), its gold documents (SQuAD:
its paragraph; HotpotQA: all of its context paragraphs, as RULER), then distractors, for SQuAD first
the other paragraphs of its article, as RULER, then any others; as many as fit, in a shuffled order,
as "Document i:\\n..." blocks. Scored by RULER's string_match_part: any reference in the generation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .ruler_sample import RulerSample, TooShort, assemble, most_that_fit

QA_TEMPLATE = ("Answer the question based on the given documents. Only give me the answer and do not output any "
               "other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on "
               "the given documents. Only give me the answer and do not output any other words.\n\n"
               "Question: {query}")
QA_ANSWER_PREFIX = " Answer:"


@dataclass(frozen=True)
class QAData:
    """questions: [{"query", "outputs": [str], "gold": [doc index], "more": [doc index]}]; docs: texts."""

    path: str
    dataset: str
    questions: list[dict]
    docs: list[str]


def _squad_answers(row: dict) -> list[str]:
    answers = row.get("answers")
    if isinstance(answers, dict):
        answers = answers.get("text", [])
    return [a["text"] if isinstance(a, dict) else a for a in answers or [] if (a["text"] if isinstance(a, dict) else a)]


def _hotpot_docs(row: dict) -> list[str]:
    context = row["context"]
    if isinstance(context, dict):
        context = list(zip(context["title"], context["sentences"]))
    return [f"{title}\n{''.join(sentences)}" for title, sentences in context]


def load_qa(path: str | Path, dataset: str) -> QAData:
    """Questions and documents of a SQuAD or HotpotQA JSONL file; ValueError naming the file and line."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append((number, json.loads(line)))
                except ValueError as exc:
                    raise ValueError(f"{path} line {number} is not JSON ({exc})") from None
    docs: dict[str, int] = {}
    questions, by_title = [], {}
    for number, row in rows:
        try:
            if dataset == "squad":
                answers = _squad_answers(row)
                if not answers:
                    continue  # SQuAD v2's unanswerable questions, as RULER skips them
                gold = [docs.setdefault(row["context"], len(docs))]
                by_title.setdefault(row.get("title", ""), set()).update(gold)
                questions.append({"query": row["question"], "outputs": answers, "gold": gold,
                                  "title": row.get("title", "")})
            else:
                gold = [docs.setdefault(d, len(docs)) for d in _hotpot_docs(row)]
                questions.append({"query": row["question"], "outputs": [row["answer"]], "gold": gold})
        except (KeyError, TypeError, ValueError) as exc:
            want = "question, context, answers" if dataset == "squad" else "question, answer, context"
            raise ValueError(f"{path} line {number} is not a {dataset} row ({want}): {exc!r}") from None
    if not questions:
        raise ValueError(f"{path} holds no answerable {dataset} question")
    for q in questions:
        q["more"] = sorted(by_title.get(q.pop("title", None), set()) - set(q["gold"])) if dataset == "squad" else []
    return QAData(str(path), dataset, questions, list(docs))


def qa(rng: np.random.Generator, length: int, tokenizer, data: QAData | None = None, dataset: str = "squad"
       ) -> RulerSample:
    """One question over as many documents as fit; answer " " + its first reference."""
    if data is None:
        flag = "--squad" if dataset == "squad" else "--hotpotqa"
        raise TooShort(f"no {dataset} questions: pass {flag} FILE.jsonl (see eval/ruler_qa.py)")
    question = data.questions[int(rng.integers(len(data.questions)))]
    gold, more = question["gold"], list(question["more"])
    near = set(gold) | set(more)
    others = [i for i in range(len(data.docs)) if i not in near]
    pool = [more[i] for i in rng.permutation(len(more))] + [others[i] for i in rng.permutation(len(others))]
    order_seed = int(rng.integers(2**62))
    head, tail = (QA_TEMPLATE + QA_ANSWER_PREFIX).split("{context}")
    tail = tail.format(query=question["query"])

    def _most_documents(n):
        """An upper bound on how many distractors fit n tokens (each document costs at least its text),
        so the search never encodes thousands of documents it cannot use."""
        if not pool:
            return 0
        lengths = [len(t) for t in tokenizer.encode_batch([data.docs[d] for d in pool[:4096]])]
        total, m = sum(len(t) for t in tokenizer.encode_batch([data.docs[g] for g in gold])), 0
        while total <= n:
            total += max(1, lengths[m % len(lengths)])
            m += 1
        return m

    def documents(m):
        """Gold + the first m distractors (the pool repeats when the file has too few), shuffled."""
        chosen = gold + [pool[i % len(pool)] for i in range(m)] if pool else list(gold)
        chosen = [chosen[i] for i in np.random.default_rng(order_seed).permutation(len(chosen))]
        texts = [f"Document {i + 1}:\n{data.docs[d]}" + ("\n\n" if i + 1 < len(chosen) else "")
                 for i, d in enumerate(chosen)]
        return [np.asarray(t, dtype=np.int64) for t in tokenizer.encode_batch(texts)], chosen

    def context(n):
        m = most_that_fit(lambda k: sum(len(t) for t in documents(k)[0]), n, 0, _most_documents(n))
        pieces, chosen = documents(m)
        context.docs = len(chosen)
        context.gold_at = [chosen.index(g) for g in gold]
        return np.concatenate(pieces)

    sample = assemble("qa", length, tokenizer, [head, context, tail], " " + question["outputs"][0],
                      question["outputs"], False, {"dataset": dataset, "query": question["query"]}, preamble=True)
    sample.params.update(documents=context.docs, gold_positions=context.gold_at)
    return sample
