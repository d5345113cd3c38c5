"""Score the local lm-eval tasks (``benchmarks/lm_eval_tasks/``) offline and compare with what lm-eval's
``local-completions`` measured against ``python -m engine.serve`` (docs/serving.md, "Third-party clients:
lm-eval"): the same accuracy and perplexities, or a non-zero exit.

The offline side runs ``LLM`` with ``SamplingParams(prompt_logprobs=0)`` over the token ids lm-eval sends
(lm-eval 0.4.13's rules, re-stated here: the continuation is the tail of ``context + continuation``'s
encoding past the context's, with no special tokens; a rolling text short of the context limit is one
window after the BOS token), and lm-eval's metric definitions::

    python -m benchmarks.lm_eval_check --model DIR --results LM_EVAL_OUTPUT_PATH
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import re
import sys
from pathlib import Path

from tokenizers import Tokenizer

from engine.llm import LLM
from engine.request import SamplingParams

TASKS = Path(__file__).parent / "lm_eval_tasks"
TOLERANCE = 1e-4  # relative, on the perplexities: lm-eval adds the same logprobs in another order


def encode_pair(tokenizer: Tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split for a causal model: trailing spaces move to the continuation, which is what the
    whole text's encoding has past the context's."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False).ids
    context_ids = tokenizer.encode(context, add_special_tokens=False).ids
    return context_ids, whole[len(context_ids) :]


def loglikelihoods(llm: LLM, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
    """Each continuation's summed logprob after its context, from the prompt logprobs of one prefill."""
    prompts = [{"prompt_token_ids": context + continuation} for context, continuation in pairs]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    sums = []
    for (context, _), out in zip(pairs, outputs, strict=True):
        ids, scored = out.prompt_token_ids, out.prompt_logprobs
        sums.append(sum(scored[i][ids[i]].logprob for i in range(len(context), len(ids))))
    return sums


def read_jsonl(name: str) -> list[dict]:
    return [json.loads(line) for line in (TASKS / name).read_text().splitlines() if line.strip()]


def choice_metrics(llm: LLM, tokenizer: Tokenizer) -> dict[str, float]:
    """``tiny_choice``: acc (the most likely choice is the answer) and acc_norm (likelihood per character)."""
    docs = read_jsonl("tiny_choice.jsonl")
    pairs = [encode_pair(tokenizer, d["question"], " " + c) for d in docs for c in d["choices"]]
    scores = iter(loglikelihoods(llm, pairs))
    hits = {"acc": 0, "acc_norm": 0}
    for doc in docs:
        lls = [next(scores) for _ in doc["choices"]]
        normed = [ll / len(c) for ll, c in zip(lls, doc["choices"], strict=True)]
        hits["acc"] += lls.index(max(lls)) == doc["answer"]
        hits["acc_norm"] += normed.index(max(normed)) == doc["answer"]
    return {name: count / len(docs) for name, count in hits.items()}


def perplexity_metrics(llm: LLM, tokenizer: Tokenizer, bos: int) -> dict[str, float]:
    """``tiny_perplexity``: word and byte perplexity and bits per byte over the summed text logprobs."""
    texts = [d["text"] for d in read_jsonl("tiny_perplexity.jsonl")]
    pairs = [([bos], tokenizer.encode(text, add_special_tokens=False).ids) for text in texts]
    total = sum(loglikelihoods(llm, pairs))
    words = sum(len(re.split(r"\s+", text)) for text in texts)
    size = sum(len(text.encode()) for text in texts)
    return {
        "word_perplexity": math.exp(-total / words),
        "byte_perplexity": math.exp(-total / size),
        "bits_per_byte": -total / size / math.log(2),
    }


def lm_eval_results(path: Path) -> dict[str, dict[str, float]]:
    """The task results of an lm-eval ``--output_path`` (the newest results file under it) or results file."""
    files = (
        [path] if path.is_file() else sorted(glob.glob(str(path / "**" / "results_*.json"), recursive=True))
    )
    if not files:
        raise SystemExit(f"no lm-eval results_*.json under {path}")
    results = json.loads(Path(files[-1]).read_text())["results"]
    return {task: {k.split(",")[0]: v for k, v in metrics.items()} for task, metrics in results.items()}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="the checkpoint folder the server served")
    parser.add_argument(
        "--results", type=Path, required=True, help="lm-eval's --output_path (or a results file)"
    )
    args = parser.parse_args()
    llm = LLM(model=args.model)
    tokenizer = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json"))
    offline = {
        "tiny_choice": choice_metrics(llm, tokenizer),
        "tiny_perplexity": perplexity_metrics(llm, tokenizer, llm.engine.model.cfg.bos_token_id),
    }
    served = lm_eval_results(args.results)
    same = True
    for task, metrics in offline.items():
        for name, value in metrics.items():
            measured = served.get(task, {}).get(name)
            ok = measured is not None and abs(measured - value) <= TOLERANCE * max(1.0, abs(value))
            same &= ok
            verdict = "same" if ok else "DIFFERENT"
            print(f"{task:16} {name:16} lm-eval {measured!s:>22}  offline {value:<22} {verdict}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
