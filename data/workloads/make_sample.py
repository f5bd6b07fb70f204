"""Writes ``sample.jsonl``: the synthetic sample workload of ``conf/workload/jsonl.yaml``.

    python data/workloads/make_sample.py          # rewrites data/workloads/sample.jsonl (bit-identical)

Nothing here is measured or downloaded: lengths are drawn from stated distributions, prompts are
templated English filler. Recipe (numpy PCG64, seed 0, 256 records):

- prompt length: lognormal, median 96, sigma 0.6, rounded and clipped to [8, 384]. Prompts are
  written as text of exactly that many UTF-8 bytes (= tokens under the harness's one-token-per-byte
  rule for text, harness/core/workload.py), HH-RLHF's dialogue shape ("\\n\\nHuman: ... \\n\\nAssistant:").
  384 keeps prompt + generation inside LLaMA-tiny's 512 positions for max_gen_len <= 128.
- response length: lognormal, median 128, sigma 1.0, rounded and clipped to [1, 2048]: the shape
  conf/workload/hh_rlhf.yaml assumes (a long tail; P99.9/median = exp(3.09) = 22x before clipping).

The first four records show the other accepted forms (token ids, a bare length, a response given
as text, non-ASCII text); their lengths are drawn like the rest.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

NUM = 256
OUT = Path(__file__).resolve().parent / "sample.jsonl"
TOPICS = ["photosynthesis", "compound interest", "the French revolution", "sourdough bread", "binary search",
          "jet lag", "plate tectonics", "a job interview", "vaccines", "composting", "the stock market",
          "learning the guitar", "black holes", "a lease agreement", "marathon training", "recursion"]
ASKS = ["Can you explain {} to me?", "What should I know about {}?", "How would you summarise {}?",
        "Give me three tips about {}.", "Is it true what people say about {}?", "Write a short poem about {}."]
FILLER = ["I have been reading about this for a while and I am still confused.",
          "Please keep the answer practical.", "My friend told me something different last week.",
          "I am a beginner, so avoid jargon if you can.", "An example would help a lot.",
          "I need this for a class tomorrow.", "Be honest if you are not sure."]


def prompt_text(rng: np.random.Generator, num_bytes: int) -> str:
    """HH-style dialogue prompt of exactly ``num_bytes`` UTF-8 bytes (ASCII, so bytes = characters)."""
    head = "\n\nHuman: " + ASKS[rng.integers(len(ASKS))].format(TOPICS[rng.integers(len(TOPICS))])
    tail = "\n\nAssistant:"
    body = head
    while len(body) + len(tail) < num_bytes:
        body += " " + FILLER[rng.integers(len(FILLER))]
    text = (body[:max(num_bytes - len(tail), 0)] + tail)[-num_bytes:]
    assert len(text.encode()) == num_bytes
    return text


def main() -> None:
    rng = np.random.default_rng(0)
    prompt_lens = np.clip(np.rint(rng.lognormal(np.log(96), 0.6, NUM)), 8, 384).astype(int)
    response_lens = np.clip(np.rint(rng.lognormal(np.log(128), 1.0, NUM)), 1, 2048).astype(int)
    lines = []
    for i, (p, r) in enumerate(zip(prompt_lens.tolist(), response_lens.tolist())):
        rec: dict = {"id": i}
        if i == 0:  # token ids (here: the bytes of a text prompt)
            rec["prompt_ids"] = list(prompt_text(rng, p).encode())
        elif i == 1:  # a length only: backend=ray draws random tokens for it
            rec["prompt_len"] = p
        elif i == 3:  # non-ASCII text: 'é' is 2 bytes, so 2 tokens
            text = "\n\nHuman: Qu'est-ce qu'une crème brûlée ?"
            rec["prompt"] = (text + " " * max(p - len(text.encode()) - 12, 0) + "\n\nAssistant:")
        else:
            rec["prompt"] = prompt_text(rng, p)
        if i == 2:  # a response given as text: its length is its byte count
            rec["response"] = ("Sure. " * (r // 6 + 1))[:r]
        else:
            rec["response_len"] = r
        lines.append(json.dumps(rec, ensure_ascii=False))
    OUT.write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
