"""Teacher-forced next-token agreement of CPU dtypes with a reference dtype.

Usage: python scripts/agreement.py MODEL --reference bfloat16 --dtypes w8a8,int4
       [--prompts PROMPTS.jsonl] [--limit 6]
Each prompt (the chat template applied) plus the reference's own greedy continuation of
--new tokens is read through a session, as serving reads it; prints the share of positions
after the prompt where each dtype's argmax equals the reference's, as one JSON line.
"gguf:torch" is a GGUF with the steps between its matmuls in torch rather than in C
(backends/torch/lean_ops.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from backends.torch.backend import TorchBackend

DEFAULT_PROMPTS = ["Write a Python function that checks whether a string is a palindrome.",
                   "Explain what a hash map is in two sentences.",
                   "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
                   "Rewrite this sentence in the passive voice: The cat chased the mouse.",
                   "What is 17 * 23? Show your steps.",
                   "List three uses of the Linux command grep."]


def argmaxes(model, ids: list[int]) -> torch.Tensor:
    return torch.tensor(model.start().forward(ids, n_logits=len(ids)).argmax)


def load(path: str, config: str):
    dtype, _, steps = config.partition(":")
    model = TorchBackend().load(path, device="cpu", dtype=dtype)
    if steps == "torch" and model.lean is not None:
        model.lean.in_c = False
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--reference", default="bfloat16")
    parser.add_argument("--dtypes", default="w8a8,int4")
    parser.add_argument("--prompts", default="")
    parser.add_argument("--limit", type=int, default=6)
    parser.add_argument("--new", type=int, default=64)
    args = parser.parse_args()
    prompts = DEFAULT_PROMPTS
    if args.prompts:
        lines = Path(args.prompts).read_text().splitlines()
        prompts = [json.loads(line)["prompt"] for line in lines if line.strip()]
    prompts = prompts[:args.limit]
    reference = TorchBackend().load(args.model, device="cpu", dtype=args.reference)
    tok = reference.tokenizer
    texts = []
    for prompt in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                      add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        with torch.inference_mode():
            out = reference.hf.generate(torch.tensor([ids]), max_new_tokens=args.new,
                                        do_sample=False)
        texts.append((len(ids), out[0].tolist()))
    ref = [argmaxes(reference, ids)[n - 1:-1] for n, ids in texts]
    del reference
    result = {"reference": args.reference, "prompts": len(texts)}
    for dtype in args.dtypes.split(","):
        model = load(args.model, dtype)
        same = total = 0
        for (n, ids), expected in zip(texts, ref):
            got = argmaxes(model, ids)[n - 1:-1]
            same += int((got == expected).sum())
            total += len(expected)
        result[dtype] = round(same / total, 4)
        del model
    print(json.dumps(result))


if __name__ == "__main__":
    main()
