"""Where one worker's time goes, without Ray: our generation engine and one training step of a
model's shape, timed and profiled in one process (torch.profiler).

    python benchmarks/engine_profile.py                          # SmolLM2-135M's shape, CUDA if any
    python benchmarks/engine_profile.py --model tiny --device cpu

Prints wall seconds per generation run and per engine step, per forward+backward, and the ops that
took the most host (self CPU) and device time. Weights are seeded random of the model's shape.
Not a test: a benchmark (docs/GPU.md shows a run on an H100).
"""
from __future__ import annotations

import argparse
import time

import torch

from harness.real.engine import SamplingParams, TorchGenerator
from harness.real.model import LlamaModel, ModelArgs, load_llama_config


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def generate(model, batch: int, prompt_len: int, new_tokens: int, vocab: int) -> int:
    engine = TorchGenerator(model, max_batch_size=batch, kv_capacity=prompt_len + new_tokens,
                            sampling=SamplingParams(max_new_tokens=new_tokens))
    gen = torch.Generator().manual_seed(0)
    for i in range(batch):
        engine.submit(i, torch.randint(0, vocab, (prompt_len,), generator=gen).tolist(), target_len=new_tokens)
    engine.run()
    return engine.num_steps


def train_step(model, batch: int, seq_len: int, vocab: int, device: str) -> None:
    tokens = torch.randint(0, vocab, (batch, seq_len), device=device)
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
    loss.backward()
    model.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2_135m", help="conf/llama name")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    margs = ModelArgs.from_llama_config(load_llama_config(args.model))
    model = LlamaModel(margs, seed=0, dtype=dtype, device=args.device)
    vocab = margs.vocab_size
    print(f"{args.model} on {args.device} ({dtype}): {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M "
          f"parameters, {margs.num_layers} layers; batch {args.batch}, prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens")
    model.eval()
    generate(model, args.batch, args.prompt_len, args.new_tokens, vocab)  # warm-up
    times, steps = [], 0
    for _ in range(args.repeats):
        sync(args.device)
        t0 = time.perf_counter()
        steps = generate(model, args.batch, args.prompt_len, args.new_tokens, vocab)
        sync(args.device)
        times.append(time.perf_counter() - t0)
    gen_s = min(times)
    print(f"generation: {gen_s:.3f} s a run, {steps} engine steps, {1e3 * gen_s / steps:.2f} ms a step")
    model.train()
    seq = args.prompt_len + args.new_tokens
    train_step(model, args.batch, seq, vocab, args.device)  # warm-up
    times = []
    for _ in range(args.repeats):
        sync(args.device)
        t0 = time.perf_counter()
        train_step(model, args.batch, seq, vocab, args.device)
        sync(args.device)
        times.append(time.perf_counter() - t0)
    print(f"forward+backward ({args.batch} x {seq} tokens): {min(times):.3f} s")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    model.eval()
    with torch.profiler.profile(activities=activities) as prof:
        generate(model, args.batch, args.prompt_len, args.new_tokens, vocab)
        sync(args.device)
    events = prof.key_averages()
    print("\n== generation: ops by self CPU time")
    print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=48))
    if args.device.startswith("cuda"):
        print("\n== generation: ops by device time")
        print(events.table(sort_by="self_device_time_total", row_limit=8, max_name_column_width=48))


if __name__ == "__main__":
    main()
