"""Can a model we can ship tell a meaning-changing edit from a paraphrase? (issue 21, point 1)

`.venv/bin/python -m bench.cache_meaning_probe` (see --help). The semantic cache needs a check that reads
meaning: "increase" against "decrease", "from A to B" against "from B to A". This measures, on the held-out
sets of bench/near_miss_sets.py (edits of 8 kinds, GPTCache's held-out paraphrase pairs, rule-based rewrites),
how well each signal available offline separates the two, as the area under the ROC curve (AUC: the chance
that a random paraphrase scores above a random edit; 0.5 is no signal), overall and per edit kind, and what share
of each kind's edits a threshold would let through at 60% paraphrase recall (the issue's recall target):

- cosine: all-MiniLM-L6-v2's cosine of the two questions (what the cache's threshold reads);
- answer likelihood: SmolLM2-135M-Instruct answers the cached question greedily (--answer-tokens), then the
  mean log-probability of that answer given the new question minus given the cached one (a changed meaning
  should make the cached answer less likely);
- judge: SmolLM2-135M-Instruct asked whether the two questions ask the same thing, logit of "Yes" minus "No".

Nothing here is trained or tuned on these sets: each signal is used as it comes.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence

import numpy as np

from assets import offline_hub
from bench.engine import MODEL_DIR
from bench.ledger_stores import cpu_model
from bench.near_miss_sets import KINDS, Case, build

offline_hub()

JUDGE = ("Question A: {a}\nQuestion B: {b}\nDo A and B ask exactly the same thing, so that one answer fits both? "
         "Answer Yes or No.")


def auc(positive: np.ndarray, negative: np.ndarray) -> float:
    """P(a random positive scores above a random negative), ties counting half."""
    return float((positive[:, None] > negative[None, :]).mean() + 0.5 * (positive[:, None] == negative[None, :]).mean())


def cosine_scores(cases: Sequence[Case]) -> np.ndarray:
    from cache.embedder import Embedder

    embedder = Embedder()
    a = embedder.encode([c.original for c in cases])
    b = embedder.encode([c.query for c in cases])
    return (a * b).sum(axis=1)


class SmolLM:
    def __init__(self, threads: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(threads)
        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(MODEL_DIR)
        self.model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()

    def prompt_ids(self, text: str) -> list[int]:
        chat = self.tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                            add_generation_prompt=True)
        return self.tok(chat, add_special_tokens=False)["input_ids"]

    def answers(self, questions: Sequence[str], max_tokens: int, batch: int = 16) -> dict[str, list[int]]:
        """Greedy answers (token ids, up to and with EOS), prompts padded on the left by hand."""
        torch, tok = self.torch, self.tok
        out: dict[str, list[int]] = {}
        for start in range(0, len(questions), batch):
            chunk = list(questions[start:start + batch])
            ids = [self.prompt_ids(q) for q in chunk]
            width = max(map(len, ids))
            input_ids = torch.tensor([[tok.pad_token_id] * (width - len(i)) + i for i in ids])
            mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
            with torch.inference_mode():
                made = self.model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_tokens,
                                           do_sample=False, pad_token_id=tok.pad_token_id)
            for q, row in zip(chunk, made[:, width:].tolist(), strict=True):
                eos = tok.eos_token_id
                out[q] = row[:row.index(eos) + 1] if eos in row else row
        return out

    def mean_logprob(self, question: str, answer: list[int]) -> float:
        torch = self.torch
        prompt = self.prompt_ids(question)
        with torch.inference_mode():
            logits = self.model(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1:-1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(answer)[:, None])
        return float(logp.mean())

    def judge(self, a: str, b: str) -> float:
        torch, tok = self.torch, self.tok
        yes, no = (tok.encode(w, add_special_tokens=False)[0] for w in ("Yes", "No"))
        with torch.inference_mode():
            last = self.model(torch.tensor([self.prompt_ids(JUDGE.format(a=a, b=b))])).logits[0, -1]
        return float(last[yes] - last[no])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-kind", type=int, default=30, help="edits per kind")
    ap.add_argument("--gptcache", type=int, default=80, help="GPTCache held-out paraphrase pairs (a seeded sample)")
    ap.add_argument("--rules", type=int, default=40, help="rule-based paraphrases")
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1, help="picks the GPTCache sample")
    args = ap.parse_args()
    cases = build(per_kind=args.per_kind, num_rule_paraphrases=args.rules)
    gptcache = [c for c in cases if c.kind == "paraphrase:gptcache"]
    random.Random(args.seed).shuffle(gptcache)
    cases = [c for c in cases if c.kind != "paraphrase:gptcache"] + gptcache[:args.gptcache]
    t0 = time.perf_counter()
    lm = SmolLM(args.threads)
    answers = lm.answers(sorted({c.original for c in cases}), args.answer_tokens)
    scores: dict[str, np.ndarray] = {"cosine (MiniLM)": cosine_scores(cases)}
    scores["answer likelihood (SmolLM2)"] = np.array([
        lm.mean_logprob(c.query, answers[c.original]) - lm.mean_logprob(c.original, answers[c.original])
        for c in cases])
    scores["judge (SmolLM2)"] = np.array([lm.judge(c.original, c.query) for c in cases])
    kinds = [k for k in KINDS if any(c.kind == k for c in cases)]
    para = np.array([c.is_paraphrase for c in cases])
    counts = {k: sum(c.kind == k for c in cases) for k in kinds}
    print(f"CPU: {cpu_model()}; {args.threads} threads; {int(para.sum())} paraphrases "
          f"({sum(c.kind == 'paraphrase:gptcache' for c in cases)} GPTCache, "
          f"{sum(c.kind == 'paraphrase:rules' for c in cases)} rules), {int((~para).sum())} edits "
          f"({', '.join(f'{k} {n}' for k, n in counts.items())}); {time.perf_counter() - t0:.0f} s\n")
    print("AUC, paraphrases against edits (0.5: no signal)\n")
    header = "| signal | all edits | " + " | ".join(kinds) + " |\n" + "|---" * (len(kinds) + 2) + "|"
    print(header)
    rows = []
    for name, s in scores.items():
        kind_auc = [auc(s[para], s[np.array([c.kind == k for c in cases])]) for k in kinds]
        print(f"| {name} | {auc(s[para], s[~para]):.3f} | " + " | ".join(f"{a:.3f}" for a in kind_auc) + " |")
        threshold = np.quantile(s[para], 0.4)  # 60% of paraphrases score at or above it
        let_through = [float((s[np.array([c.kind == k for c in cases])] >= threshold).mean()) for k in kinds]
        rows.append(f"| {name} | {float((s[~para] >= threshold).mean()):.0%} | "
                    + " | ".join(f"{v:.0%}" for v in let_through) + " |")
    print("\nEdits let through at the threshold that keeps 60% of paraphrases (issue's bound: <= 1% overall, <= 2% "
          "a kind)\n")
    print(header)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
