"""Write data/published/replay.jsonl: every calibration point graded A or B in
../shared/published/measurements.jsonl (A100/A800, DeepSpeed-era PPO), and every point graded A or
B in ../shared/published/hopper.jsonl (H100 and GB200, critic-free GRPO on NeMo-RL, on-policy and
asynchronous), expressed as harness overrides.

    python data/published/make_replay.py [--measurements PATH] [--hopper PATH]

Where a source also gives a point's stages (OpenRLHF's benchmark table, the DeepSpeed blog's Figure 5
bars, the NeMo-RL v0.3 blog's generation, training and refit seconds), each stage is one more line with
the point's overrides (``P037.gen``, ``P021.train``, ``H071.refit``, ...).
Each line's ``assumptions`` says what the source leaves open and what was assumed. Derived values
(samples/s from hours per epoch, from GPU-normalised seconds per sequence, from nominal TFLOPs) are
computed here from the published numbers with the formulas cited below. Where a source gives only
"the largest batch that does not run out of memory", the batch is the largest power of two <= 1024
whose plan passes the harness's memory check (the same rule, applied by our memory model).
"""
from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT_MEASUREMENTS = HERE.parents[1] / ".." / "shared" / "published" / "measurements.jsonl"
DEFAULT_HOPPER = DEFAULT_MEASUREMENTS.with_name("hopper.jsonl")
EPOCH_SAMPLES = 264_292  # DS-Chat BenckmarkSetting.md: 135,317,504 tokens / 512 tokens per pair
FAST = ["backend.num_iterations=1", "backend.num_warmup_iterations=0"]

OPT_MODEL = {"OPT-1.3B": "opt_1_3b_350m", "OPT-6.7B": "opt_6_7b_350m", "OPT-13B": "opt_13b_350m",
             "OPT-30B": "opt_30b_350m", "OPT-66B": "opt_66b_350m", "OPT-175B": "opt_175b_350m"}
# DeepSpeed-Chat's --inference_tp_size (hybrid-engine tp) per actor size: 1 (its default) up to 6.7B;
# 2 for 13B as in the release script single_node/run_13b.sh (measurement notes); assumed 4 / 8 / 8
# beyond (the actor's gathered weights must fit one tp group beside the training states).
OPT_GEN_TP = {"OPT-1.3B": 1, "OPT-6.7B": 1, "OPT-13B": 2, "OPT-30B": 4, "OPT-66B": 8, "OPT-175B": 8}
# (layers, hidden, vocab) of OPT (Zhang et al. 2022, Table 1) for DS-Chat's nominal FLOPs formula
OPT_DIMS = {"OPT-350M": (24, 1024, 50272), "OPT-1.3B": (24, 2048, 50272), "OPT-6.7B": (32, 4096, 50272),
            "OPT-13B": (40, 5120, 50272), "OPT-30B": (48, 7168, 50272), "OPT-66B": (64, 9216, 50272),
            "OPT-175B": (96, 12288, 50272)}


def megatron_flops(factor: float, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """DeepSpeed-Chat's nominal FLOPs per sequence (dschat/utils/perf.py, the Megatron formula of
    Narayanan et al. SC'21): 24 f s L h^2 (1 + s/(6h) + V/(16 L h)), f = 4 with gradient checkpointing,
    1 for generation."""
    return 24 * factor * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def ds_chat_cluster(gpu: str, num_gpus: int) -> list[str]:
    name = "a100_40g_8x" if "40" in gpu else "a100_8x"
    if num_gpus < 8:
        return [f"cluster={name}", "cluster.num_nodes=1", f"cluster.gpus_per_node={num_gpus}"]
    return [f"cluster={name}", f"cluster.num_nodes={num_gpus // 8}"]


def plan_error(overrides: list[str]) -> str:
    """Why ``overrides`` do not plan as ``python -m harness`` would (memory check included), or ''
    when they do."""
    from harness.errors import PlanError
    from harness.run import pipeline

    cfg = pipeline.compose([*overrides, "logger=none", "logger.progress_bar=false"])
    try:
        pipeline.plan(pipeline.prepare(cfg))
    except PlanError as e:
        return str(e)
    return ""


def fits(overrides: list[str]) -> bool:
    return not plan_error(overrides)


def largest_batch(base: list[str], num_gpus: int) -> tuple[int, list[str]]:
    for batch in (1024, 512, 256, 128, 64, 32, 16, 8):
        if batch < num_gpus:
            break
        ov = base + [f"workload.global_batch_size={batch}", f"workload.mini_batch_size={batch}",
                     f"workload.micro_batch_size={batch // num_gpus}", f"system.mini_batch_size={batch}",
                     f"system.generation_batch_size={batch}"]
        if fits(ov):
            return batch, ov
    raise NoFit(f"no batch fits in memory: {' '.join(base)}")


class NoFit(Exception):
    pass


FIXED_256 = ["workload=hh_rlhf", "workload.max_gen_len=256", "workload.activation_recompute=full",
             "workload.prompt_len.kind=constant", "workload.prompt_len.median=256", "workload.prompt_len.max=256",
             "workload.output_len.kind=constant", "workload.output_len.median=256", "workload.output_len.max=256"]


# Colossal-AI Coati's examples/train_prompts.py (April 2023): --experience_batch_size and
# --train_batch_size both default to 8 per rank.
COATI_BATCH_PER_GPU = 8


def ds_chat_table(m: dict) -> dict:
    """P001-P014 (DS-Chat README Table 1) and P021-P029 (blog Figures 5 and 6)."""
    actor = m["actor"]
    gpu, n = m["gpu"], int(m["num_gpus"])
    if "40GB/80GB" in gpu:  # Figure 6: 'the 13B value matches 8xA100-80G Table 1 better' (notes)
        gpu = "A100-80GB"
    base = ["+system=deepspeed_chat", f"model={OPT_MODEL[actor]}", *ds_chat_cluster(gpu, n), *FIXED_256,
            f"system.gen_tp={min(OPT_GEN_TP[actor], n)}", "engine.training=deepspeed_hf_eager", *FAST]
    assume = ("256-token prompts and 256-token answers (fixed, the benchmark setting); one PPO epoch, one "
              "mini-batch per iteration; the largest power-of-two batch <= 1024 that passes our memory check "
              "(the source: 'largest non-OOM'); ZeRO-3 for actor and critic; fp16 run as bf16; "
              f"hybrid-engine tp {min(OPT_GEN_TP[actor], n)} (assumed: DS-Chat's default 1, 2 for 13B per its "
              "release script, more for larger actors); training and inference passes with transformers' eager OPT "
              "attention in fp16 (OPT had no SDPA or flash path in the transformers of April 2023: "
              "conf/engine/training/deepspeed_hf_eager.yaml)")
    system = m["system"]
    if system.startswith("HuggingFace DDP"):
        base += ["engine.generation=hf_generate", "system.zero_stage=0", "system.gen_tp=1"]
        assume += "; HF-DDP: generate() on each GPU's full replica (no ZeRO), DeepSpeed-style training"
    elif system.startswith("Colossal-AI"):
        base += ["engine.generation=coati_generate", "system.zero_stage=3", "system.gen_tp=1"]
        assume += ("; Colossal-AI Coati: its Gemini (ZeRO-3-like) strategy assumed, Coati's own sampling loop on "
                   "the sharded module in place, without KV-cache reuse (conf/engine/generation/coati_generate.yaml), "
                   f"{COATI_BATCH_PER_GPU} prompts per GPU per round and micro-batches of {COATI_BATCH_PER_GPU} "
                   "(the defaults of --experience_batch_size and --train_batch_size in Coati's examples/"
                   "train_prompts.py, April 2023)")
    try:
        batch, ov = largest_batch(base, n)
    except NoFit:  # DS-Chat's single-GPU recipes offload (--offload, --offload_reference_model)
        base = [o for o in base if o != "engine.training=deepspeed_hf_eager"]
        base += ["engine.training=deepspeed_offload_hf_eager", "system.offload_reference_model=true"]
        assume += "; nothing fits without offload: Adam and the reference model offloaded to the CPU"
        batch, ov = largest_batch(base, n)
    if system.startswith("Colossal-AI"):
        ov += [f"system.generation_batch_size={COATI_BATCH_PER_GPU * n}",
               f"workload.micro_batch_size={COATI_BATCH_PER_GPU}"]
    if m["id"] <= "P014":
        value = EPOCH_SAMPLES / (float(m["value"]) * (24 if "day" in m["unit"] else 1) * 3600)
        derived = f"samples/s = {EPOCH_SAMPLES} samples per epoch / ({m['value']} {m['unit']})"
    elif m["id"] <= "P023":
        value = n / float(m["value"])
        derived = f"samples/s = {n} GPUs / {m['value']} GPU-normalised s per sequence"
    else:
        L, h, V = OPT_DIMS[actor]
        cl, ch, cv = OPT_DIMS["OPT-350M"]
        per_sample = (megatron_flops(4, 512, L, h, V) + megatron_flops(4, 512, cl, ch, cv)
                      + megatron_flops(1, 512, L, h, V))
        value = float(m["value"]) * 1e12 * n / per_sample
        derived = (f"samples/s = {m['value']} effective TFLOPs/GPU x {n} GPUs / {per_sample:.3g} nominal FLOPs "
                   "per sample (DS-Chat perf.py: actor 4x + critic 4x training + 1x generation, 512 tokens)")
    return {"metric": "samples_per_s", "value": round(value, 4), "overrides": ov,
            "assumptions": f"{assume}; batch {batch}; {derived}"}


BREAKDOWN = re.compile(r"Breakdown: generation ([0-9.]+) s/seq \([0-9]+%\), RL training ([0-9.]+) s/seq")


def ds_chat_breakdown(m: dict, main: dict) -> list[dict]:
    """P021-P023 (blog Figure 5) also give each stack's generation and RL-training bars: two more lines
    each, ``gen_s`` (generation alone) and ``train_s`` (actor and critic training), in seconds per
    iteration: the GPU-normalised seconds per sequence x the iteration's batch / the GPUs. The third bar,
    'others' (the experience's ref/reward/critic passes and the rest), is left out: what it holds is not
    stated."""
    found = BREAKDOWN.search(m["notes"])
    if found is None:
        return []
    batch = next(int(o.split("=")[1]) for o in main["overrides"] if o.startswith("workload.global_batch_size="))
    n = int(m["num_gpus"])
    out = []
    for suffix, metric, per_seq in ((".gen", "gen_s", found.group(1)), (".train", "train_s", found.group(2))):
        out.append({"id": m["id"] + suffix, "metric": metric, "value": round(float(per_seq) * batch / n, 4),
                    "overrides": main["overrides"],
                    "assumptions": f"{main['assumptions']}; {metric} = {per_seq} GPU-normalised s per sequence "
                                   f"x {batch} sequences / {n} GPUs (the figure's {metric[:-2]} bar)"})
    return out


OPENRLHF_BENCH = {  # id: (model, kind, gen mbs, train mbs, offload)
    "P037": ("llama2_7b", "dschat", 8, 8, True), "P038": ("llama2_7b", "dschat", 4, 4, False),
    "P042": ("llama2_13b", "dschat", 2, 2, True),
    "P039": ("llama2_7b", "openrlhf_ds", 8, 8, False),
    "P040": ("llama2_7b", "ray", 16, 8, False), "P043": ("llama2_13b", "ray", 8, 4, True),
    "P041": ("llama2_7b", "vllm", 16, 8, False), "P044": ("llama2_13b", "vllm", 8, 4, True),
    "P045": ("codellama_34b", "vllm", 4, 2, True),
}
HH_1024 = ["workload=hh_rlhf", "workload.global_batch_size=1024", "workload.mini_batch_size=128",
           "workload.max_gen_len=1024", "workload.prompt_len.max=1024", "workload.output_len.kind=constant",
           "workload.output_len.median=1024", "workload.output_len.max=1024", "workload.activation_recompute=full"]
HH_ASSUME = ("every answer at the 1,024-token maximum (the source's own nominal setting: its TFLOPs columns assume "
             "full-length answers; mean lengths unpublished); prompts: the harness's hh_rlhf distribution capped at "
             "1,024 (the benchmark's prompts are HH-RLHF-derived); 1,024 prompts, train_batch_size 128 -> 8 "
             "optimizer steps, one PPO epoch; gradient checkpointing as full recompute")


def openrlhf_bench(m: dict) -> list[dict]:
    """P037-P045: OpenRLHF's benchmark branch (A800, 8 GPUs), end to end + the gen/train breakdown."""
    model, kind, gen_mbs, train_mbs, offload = OPENRLHF_BENCH[m["id"]]
    ov = [f"model={model}", "cluster=a800_8x", "cluster.num_nodes=1", *HH_1024,
          f"workload.micro_batch_size={train_mbs}", *FAST]
    if kind in ("dschat", "openrlhf_ds"):
        ov = ["+system=deepspeed_chat", *ov, "system.mini_batch_size=128",
              f"system.generation_batch_size={gen_mbs * 8}"]
        if kind == "dschat":
            ov += ["engine.generation=ds_chat_generate", "system.actor_zero_stage=2", "system.critic_zero_stage=3",
                   "system.offload_reference_model=true"]
            assume = ("DeepSpeed-Chat with the hybrid engine disabled: generate() in place, prompts padded to 1,024; "
                      "actor ZeRO-2, critic ZeRO-3, reference model offloaded")
        else:
            ov += ["engine.generation=hf_generate_fa2", "system.zero_stage=2"]
            assume = ("OpenRLHF without Ray: all models on all 8 GPUs, DeepSpeed ZeRO-2, HF generate() in place "
                      "with flash-attention 2 (--flash_attn)")
    else:
        split = ["system.split.actor=4", "system.split.gen=0"] if kind == "ray" else []
        ov = ["+system=openrlhf", *ov, *split, f"system.generation_batch_size={gen_mbs}",
              f"system.micro_batch_size={train_mbs}"]
        assume = (("OpenRLHF Ray placement ref:reward:actor:critic = 1:1:4:2, HF generate() with flash-attention 2 "
                   "on the actor pool (system.split.gen=0: engine hf_generate_fa2)")
                  if kind == "ray" else "OpenRLHF Ray + vLLM placement 1:1:2:2:2, vLLM tp 1")
    if offload:
        ov.append("engine.training=deepspeed_offload")
        assume += "; Adam offloaded to the CPU (--offload / --adam_offload)"
    notes = m["notes"]
    gen_s = float(notes.split("'Generation' (make_experience: generation + ref/reward/critic forward) ")[1].split(" s")[0])
    train_s = float(notes.split("'Training' (actor+critic PPO update, train_batch_size 128 -> 8 optimizer steps) ")[1]
                    .split(" s")[0])
    a = f"{assume}; {HH_ASSUME}; per-GPU micro-batches as the row's mbs"
    return [{"id": m["id"], "metric": "step_s", "value": float(m["value"]), "overrides": ov, "assumptions": a},
            {"id": m["id"] + ".gen", "metric": "gen_inference_s", "value": gen_s, "overrides": ov, "assumptions": a},
            {"id": m["id"] + ".train", "metric": "train_s", "value": train_s, "overrides": ov, "assumptions": a}]


OPENRLHF_README = {  # id: (model, gen mbs, train mbs, the README's generation_length range)
    "P056": ("llama2_7b", 16, 8, (100, 300)), "P057": ("llama2_13b", 8, 4, (200, 400)),
    "P058": ("codellama_34b", 2, 1, (300, 800))}


def openrlhf_readme(m: dict) -> dict:
    """P056-P058: OpenRLHF README (Jan 2024), 8 A100-80GB, actor 4 / critic 2 / RM 1 / ref 1, ZeRO-2 + Adam
    offload, HF generate with flash-attention 2 (the default engine with system.split.gen=0)."""
    model, gen_mbs, train_mbs, (low, high) = OPENRLHF_README[m["id"]]
    ov = ["+system=openrlhf", f"model={model}", "cluster=a100_8x", "cluster.num_nodes=1", "workload=hh_rlhf",
          "workload.global_batch_size=1024", "workload.mini_batch_size=128", "workload.max_gen_len=1024",
          f"workload.micro_batch_size={train_mbs}", "workload.activation_recompute=full",
          "workload.output_len.kind=uniform", f"workload.output_len.min={low}", f"workload.output_len.max={high}",
          f"workload.output_len.median={(low + high) / 2:g}",
          "system.split.actor=4", "system.split.gen=0", f"system.generation_batch_size={gen_mbs}",
          f"system.micro_batch_size={train_mbs}", "engine.training=deepspeed_offload", *FAST]
    value = float(m["value"]) * 8
    return {"metric": "samples_per_s", "value": round(value, 4), "overrides": ov,
            "assumptions": (f"answers drawn uniformly from the README's generation_length range {low}~{high} "
                            "(each micro-rollout batch is then padded to its longest answer); "
                            "prompts: the harness's hh_rlhf distribution; rollout batch 1024, train batch 128; "
                            f"samples/s = {m['value']} samples/GPU/s x 8 GPUs")}


CHATLEARN = {"P070": ("gpt_7b", 1, "dp1tp4pp2", 128), "P072": ("gpt_13b", 2, "dp1tp8pp2", 206)}


def chatlearn(m: dict) -> dict:
    """P070, P072: ChatLearn's Megatron backend (Oct 2023), A800 nodes, colocated."""
    model, nodes, layout, gen_batch = CHATLEARN[m["id"]]
    ov = ["+system=colocated", f"model={model}", "cluster=a800_8x", f"cluster.num_nodes={nodes}",
          "workload=hh_rlhf", "workload.global_batch_size=2048", "workload.mini_batch_size=512",
          "workload.micro_batch_size=8", "workload.max_gen_len=512", "workload.prompt_len.max=512",
          "workload.output_len.kind=constant", "workload.output_len.median=512", "workload.output_len.max=512",
          f"system.layout={layout}", f"system.max_gen_batch_size={gen_batch}",
          "engine.generation=megatron", "engine.training=megatron", *FAST]
    return {"metric": "samples_per_s", "value": float(m["value"]), "overrides": ov,
            "assumptions": ("every answer exactly 512 tokens (early termination disabled); prompts: the harness's "
                            "hh_rlhf distribution capped at 512 (seq_len 1024 = 2 x max_new_tokens); one shared "
                            f"layout {layout} for every task (the run script's policy layout); generation batch "
                            f"{gen_batch}; 2048 samples per episode, train global batch 512")}


# ---- Hopper-class critic-free runs (../shared/published/hopper.jsonl) ------------------------------

HOPPER_MODELS = {"Llama-3.1-8B": "llama3_1_8b", "Llama-3.1-70B": "llama3_1_70b", "Qwen3-32B": "qwen3_32b",
                 "Qwen3-30B-A3B": "qwen3_30b_a3b", "Qwen3-235B-A22B": "qwen3_235b_a22b", "DeepSeek-V3": "deepseek_v3"}
# The shape of the response lengths, which no source publishes: lognormal with this sigma (the
# harness's default shape, conf/workload/hh_rlhf.yaml: P99.9 22x the median), clipped at the
# sequence cap, its median chosen so that the clipped mean is the published mean length.
HOPPER_OUTPUT_SIGMA = 1.0
# A GB200 NVL72 rack is one NVLink domain of 72 GPUs; a run on more GPUs than a rack is modelled as
# racks of this many (a power of two, as the recipes' node counts are).
GB200_GPUS_PER_DOMAIN = 64


def clipped_lognormal_median(mean: float, sigma: float, cap: float) -> float:
    """The median of a lognormal of shape ``sigma`` whose values clipped at ``cap`` average ``mean``:
    E[min(X, c)] = exp(mu + sigma^2 / 2) Phi((ln c - mu - sigma^2) / sigma) + c (1 - Phi((ln c - mu) / sigma)),
    increasing in mu, solved by bisection."""
    def phi(x: float) -> float:
        return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))

    def clipped_mean(mu: float) -> float:
        lc = math.log(cap)
        return (math.exp(mu + sigma ** 2 / 2) * phi((lc - mu - sigma ** 2) / sigma)
                + cap * (1.0 - phi((lc - mu) / sigma)))

    if not 0 < mean < cap:
        raise ValueError(f"mean {mean} must lie in (0, cap {cap})")
    lo, hi = math.log(mean) - 5 * sigma - 5, math.log(cap) + 5
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if clipped_mean(mid) < mean else (lo, mid)
    return math.exp((lo + hi) / 2)


def hopper_grade(m: dict) -> str:
    return m["notes"].split("]")[0].removeprefix("[completeness ").strip()


def hopper_source(m: dict) -> str:
    """The publication a row belongs to (its table), without the row's own recipe, led by a short
    label (the report shows a source's first 60 characters): points are grouped by it."""
    source = m["source"].split(" + ")[0]
    version = re.search(r"v0\.\d", source).group(0)
    table = "blog" if "blog" in source else "GB200" if "GB200" in source else "H100 FP8" if "FP8" in source else "H100"
    return f"NeMo-RL {version} {table} table: {source}"


def hopper_cluster(gpu: str, num_gpus: int) -> tuple[list[str], str]:
    if gpu.startswith("H100"):
        if num_gpus < 8:
            return ["cluster=h100_8x", "cluster.num_nodes=1", f"cluster.gpus_per_node={num_gpus}"], ""
        return ["cluster=h100_8x", f"cluster.num_nodes={num_gpus // 8}"], ""
    if gpu.startswith("GB200"):
        per = min(num_gpus, GB200_GPUS_PER_DOMAIN)
        note = (f"; GB200 NVL72 racks modelled as NVLink domains of {per} GPUs (cluster=gb200_nvl72, no "
                "calibration: the roofline cost model)")
        return ["cluster=gb200_nvl72", f"cluster.num_nodes={num_gpus // per}", f"cluster.gpus_per_node={per}"], note
    raise NoFit(f"no cluster config for {gpu!r}")


def hopper_model(actor: str) -> str:
    for prefix, name in HOPPER_MODELS.items():
        if actor.startswith(prefix):
            return name
    raise NoFit(f"no model config for {actor!r}")


def first_int(text: Any) -> int:
    match = re.search(r"\d[\d,]*", str(text))
    if match is None:
        raise NoFit(f"no number in {text!r}")
    return int(match.group(0).replace(",", ""))


def nemo_rl_row(m: dict) -> list[dict]:
    """A NeMo-RL GRPO row (performance tables v0.4-v0.6 and the v0.3 release's table):
    ``+system=nemo_rl`` with the recipe's model, GPUs, batch, lengths, parallelism and engines; its
    asynchronous rows with the recipe's generation and training pools and trajectory age (an
    off-policy plan, two iterations of which the first fills the pipeline); the v0.3 rows' published
    stages as lines of their own."""
    p, o = m["parallelism"], m["other_settings"]
    if "fp8" in str(m.get("precision", "")).lower():
        raise NoFit("FP8 training and generation are not modelled (the cost model runs bf16)")
    n, group = int(m["num_gpus"]), int(m["responses_per_prompt"])
    prompts, per_step = int(m["prompts_per_iter"]), first_int(m["train_global_batch"])
    cluster, cluster_note = hopper_cluster(m["gpu"], n)
    mean_out = float(m["gen_len_mean"])
    tokens_per_gpu_s = m["secondary_metrics"].get("tokens_per_sec_per_gpu")
    if tokens_per_gpu_s:  # the table's tokens/s/GPU counts prompt + response tokens over the step
        prompt = round(float(tokens_per_gpu_s) * n * float(m["value"]) / (prompts * group) - mean_out)
        prompt_note = (f"prompts of {prompt} tokens: Tokens/sec/GPU x GPUs x step time / samples - the mean response "
                       f"({tokens_per_gpu_s} x {n} x {m['value']} / {prompts * group} - {mean_out:g})")
    else:  # the v0.3 blog gives none: the v0.4/v0.5 rows of the same dataset and template imply 127-132
        prompt = 130
        prompt_note = "prompts of 130 tokens (the v0.4/v0.5 Llama-8B rows of the same dataset and template imply 127-132)"
    total_cap = first_int(m["gen_len_max"])
    max_gen = total_cap - prompt
    median = clipped_lognormal_median(mean_out, HOPPER_OUTPUT_SIGMA, max_gen)
    fsdp = "DTensor" in o.get("training_backend", "") or p.get("train_FSDP2_shards")
    tp, pp, dp = int(p["train_TP"]), int(p.get("train_PP") or 1), int(p["train_DP"])
    ep, cp = int(p.get("train_EP") or 1), int(p.get("train_CP") or 1)
    ov = ["+system=nemo_rl", "algo=grpo", f"algo.group_size={group}",
          f"algo.kl_coef={o.get('reference_policy_kl_penalty', 0.01)}", f"model={hopper_model(m['actor'])}", *cluster,
          "workload=hh_rlhf", f"workload.global_batch_size={prompts}", f"workload.mini_batch_size={per_step // group}",
          f"workload.micro_batch_size={int(o.get('train_micro_batch_size') or 1)}",  # packed below if the recipe packs
          f"workload.max_gen_len={max_gen}",
          "workload.prompt_len.kind=constant", f"workload.prompt_len.median={prompt}",
          f"workload.prompt_len.max={prompt}", f"workload.prompt_len.min={prompt}",
          "workload.output_len.kind=lognormal", f"workload.output_len.median={median:.1f}",
          f"workload.output_len.sigma={HOPPER_OUTPUT_SIGMA}", f"workload.output_len.max={max_gen}",
          f"workload.activation_recompute={'full' if o.get('activation_checkpointing') else 'selective'}",
          f"system.gen_tp={int(p['gen_TP'])}",
          f"system.gpu_memory_utilization={o.get('vllm_gpu_memory_utilization', 0.6)}"]
    layout_note = ""
    if fsdp:  # the fsdp engine shards over every GPU (dp = N, ZeRO-3); tensor parallelism beside it is not modelled
        ov.append("engine.training=fsdp")
        if tp > 1:
            layout_note = f"; FSDP2 over all {n} GPUs (the recipe's DTensor tp {tp} with sequence parallelism not modelled)"
    else:  # Megatron-core: expert parallelism folded with expert tensor parallelism over tp x cp x dp
        etp = int(p.get("train_ETP") or tp)  # expert_tensor_parallel_size; Megatron-core's default is tp
        if ep > 1 and (dp * cp * tp) % (ep * etp):
            raise NoFit(f"expert parallelism {ep} x expert tensor parallelism {etp} does not divide the "
                        f"{dp * cp * tp} ranks of a pipeline stage")
        ov.append(f"system.train_layout=dp{dp * cp}tp{tp}pp{pp}" + (f"ep{ep}" if ep > 1 else "")
                  + (f"etp{etp}" if ep > 1 and etp != tp else ""))
        if cp > 1:  # context parallelism is not modelled
            layout_note = (f"; the recipe's tp{tp} cp{cp} pp{pp} dp{dp} as dp{dp * cp}tp{tp}pp{pp}: context "
                           f"parallelism counted as data parallelism, which the harness models in its place")
    train_mbs = int(o.get("train_micro_batch_size") or 1)
    if o.get("sequence_packing"):  # train_mb_tokens = max_total_sequence_length x train_micro_batch_size
        ov.append(f"workload.micro_batch_tokens={total_cap * train_mbs}")
        logprob_tokens = total_cap * int(o.get("logprob_batch_size") or train_mbs)
        packing_note = (f"sequence packing (on in the recipe): micro-batches packed to {total_cap * train_mbs} tokens "
                        f"(train_mb_tokens), the log-prob passes' too (the recipe's logprob_mb_tokens is "
                        f"{logprob_tokens})")
    else:
        packing_note = f"micro-batches of {train_mbs} sample{'s' if train_mbs > 1 else ''} (sequence packing off)"
    off_policy = not m["policy_mode"].startswith("on-policy")
    pools_note = ""
    if off_policy:  # asynchronous GRPO: generation on GPUs of its own, up to `age` steps ahead of training
        age = first_int(m["policy_mode"])  # "1-step off-policy", "8-step off-policy"
        gen_gpus, train_gpus = int(p["gen_gpus"]), int(p["train_gpus"])
        if gen_gpus + train_gpus != n:
            raise NoFit(f"pools of {gen_gpus} + {train_gpus} GPUs are not the row's {n}")
        ov += [f"system.generation_gpus={gen_gpus}", f"system.max_trajectory_age_steps={age}",
               "system.in_flight_weight_updates=true"]
        # The first age + 1 windows are warm-up: the collector starts with every target up to the age open, so
        # the early windows run ahead of the steady state; then four windows (two periods of the alternation
        # between a long and a short step the steady state can settle into), averaged as the table averages
        # its steps (harness/planning/iterations.py, harness/planning/rollout.py)
        ov += [f"backend.num_iterations={age + 5}", f"backend.num_warmup_iterations={age + 1}"]
        pools_note = (f"; asynchronous GRPO, max_trajectory_age_steps {age}: generation on {gen_gpus} GPUs of its "
                      f"own, training on {train_gpus}, continuous rollout with {prompts} x {age} prompt groups in "
                      f"flight; in_flight_weight_updates true (assumed from the asynchronous performance recipes "
                      f"of later tags, e.g. grpo-qwen3-30ba3b-4n8g-async-1off.yaml; the row's recipe is not "
                      f"recorded with it); step = the mean interval between training steps over four windows after "
                      f"{age + 1} of warm-up")
    else:
        ov += FAST
    assume = (f"{prompt_note}; responses lognormal (sigma {HOPPER_OUTPUT_SIGMA:g}, an assumption: no source publishes "
              f"the shape) with median {median:.0f}, clipped at {max_gen} (the {total_cap}-token sequence cap less the "
              f"prompt), so that their mean is the published {mean_out:g}; {prompts} prompts x {group} responses, "
              f"{per_step} responses per optimizer step; reference model evaluated (KL "
              f"{o.get('reference_policy_kl_penalty', 0.01)}); {packing_note}; vLLM's "
              f"gpu_memory_utilization {o.get('vllm_gpu_memory_utilization', 0.6)}"
              f"{'' if 'vllm_gpu_memory_utilization' in o else ' (not recorded: NeMo-RL recipes default to 0.6)'}; "
              f"training "
              f"{'FSDP2 (engine.training=fsdp)' if fsdp else 'Megatron-core'}, generation vLLM tp {p['gen_TP']}"
              f"{layout_note}{pools_note}{cluster_note}")
    out = [{"metric": "step_s", "value": float(m["value"]), "overrides": ov, "assumptions": assume}]
    stages = m.get("stage_times") or {}
    refit_note = ("; the published refit also holds the policy's training states' copy to host memory "
                  "(offload_before_refit, offload_after_refit), which the simulator times at the end of "
                  "update_actor (its 'offload' span), not in timing_s/realloc")
    for key, metric, suffix in (("generation", "gen_s", "gen"), ("policy_training", "train_s", "train"),
                                ("refit", "realloc_s", "refit")):
        if key in stages:
            out.append({"id": f"{m['id']}.{suffix}", "metric": metric, "value": float(stages[key]),
                        "overrides": ov, "assumptions": assume + (refit_note if suffix == "refit" else "")})
    return out


def build_hopper(path: Path) -> list[dict]:
    """Every point of ``hopper.jsonl`` graded A or B, as harness overrides: NeMo-RL's on-policy
    rows and its asynchronous GRPO rows (``max_trajectory_age_steps``: +system=nemo_rl with
    generation on GPUs of its own, off-policy)."""
    lines = []
    for raw in path.read_text().splitlines():
        m = json.loads(raw)
        if not hopper_grade(m).startswith(("A", "B")):
            continue
        if not m["system"].startswith("NeMo-RL"):
            raise SystemExit(f"{m['id']} is graded A/B but has no expression here")
        try:
            out = nemo_rl_row(m)
            why = plan_error(out[0]["overrides"])
            if why:
                raise NoFit(f"does not plan: {why}")
        except NoFit as e:
            print(m["id"], "SKIPPED:", e, flush=True)
            continue
        for rec in out:
            rec.setdefault("id", m["id"])
            rec["source"] = hopper_source(m)
            lines.append({k: rec[k] for k in ("id", "metric", "value", "overrides", "source", "assumptions")})
        print(m["id"], "ok", flush=True)
    return lines


def build(measurements: Path) -> list[dict]:
    lines = []
    for raw in measurements.read_text().splitlines():
        m = json.loads(raw)
        grade = m["notes"].split("]")[0]
        if not (grade.startswith("[completeness A") or grade.startswith("[completeness B")):
            continue
        pid = m["id"]
        if pid <= "P029":
            try:
                out = [ds_chat_table(m)]
                out += ds_chat_breakdown(m, out[0])
            except NoFit as e:
                print(pid, "SKIPPED:", e, flush=True)
                continue
        elif pid in OPENRLHF_BENCH or pid in OPENRLHF_README:
            out = openrlhf_bench(m) if pid in OPENRLHF_BENCH else [openrlhf_readme(m)]
            openrlhf = "+system=openrlhf" in out[0]["overrides"] or "system.zero_stage=2" in out[0]["overrides"]
            if not fits(out[0]["overrides"]) and openrlhf:
                for rec in out:  # OpenRLHF's --zero_stage 3 where ZeRO-2 cannot hold the model
                    rec["overrides"] = [o for o in rec["overrides"] if o != "system.zero_stage=2"] + ["system.zero_stage=3"]
                    rec["assumptions"] += "; ZeRO-3 (--zero_stage 3): ZeRO-2 does not fit in our memory model"
            if not fits(out[0]["overrides"]):
                print(pid, "SKIPPED: no fit in memory:", " ".join(out[0]["overrides"]), flush=True)
                continue
        elif pid in CHATLEARN:
            out = [chatlearn(m)]
        else:
            raise SystemExit(f"{pid} is graded A/B but has no expression here")
        for rec in out:
            rec.setdefault("id", pid)
            rec["source"] = m["source"]
            lines.append({k: rec[k] for k in ("id", "metric", "value", "overrides", "source", "assumptions")})
        print(pid, "ok", flush=True)
    return lines


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--measurements", type=Path, default=DEFAULT_MEASUREMENTS)
    p.add_argument("--hopper", type=Path, default=DEFAULT_HOPPER)
    p.add_argument("--out", type=Path, default=HERE / "replay.jsonl")
    args = p.parse_args()
    records = build(args.measurements) + build_hopper(args.hopper)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"wrote {len(records)} lines to {args.out}")
