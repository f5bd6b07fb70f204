#!/usr/bin/env bash
# The checks a lent GPU machine runs in one call (docs/GPU.md says what each showed):
#   1. the CUDA environment;
#   2. `python -m harness.calibrate profile` rows (bf16 on CUDA) for the models whose H100 rows
#      Vidur published (data/profiles/vidur/compute/h100), to compare ours with theirs;
#   3. benchmarks/engine_profile.py: our generation engine and a training step in one process;
#   4. backend=ray on CUDA (NCCL, bf16): benchmarks/sim_vs_real.py with SmolLM2-135M's shape;
#   5. the README's one-GPU commands through `python -m harness` (rlhfuse, deepspeed_chat);
#   6. benchmarks/moe_profile.py: the routed experts' GEMMs of the shipped MoE models, as one GEMM
#      (the cost model's assumption), as a grouped GEMM and as one GEMM per expert (needs no wheels);
#   7. benchmarks/moe_profile.py --block: a whole MoE block of one expert-parallel rank (router,
#      permutation, grouped GEMMs, un-permutation).
# Weights are seeded random of each model's shape (checkpoint=null): the machine has no network
# and the GGUF file is too large to carry beside Ray. Each step has its own time limit and log, so
# one failure leaves the others' results; everything is packed into $OUT/gpu_check.tgz at the end.
#
#   bash benchmarks/gpu_check.sh            # on the GPU machine; .whl/ holds the wheels it lacks
#   STEPS="env profile" bash benchmarks/gpu_check.sh
set -u
OUT=${OUT:-/tmp/gpu_check_out}
W=$OUT/w
mkdir -p "$W"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
STEPS=${STEPS:-"env profile engine svr_small harness_runs moe moe_block"}
RW="model.actor.checkpoint=null model.critic.checkpoint=null model.ref.checkpoint=null model.reward.checkpoint=null"

if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$W/install.log" 2>&1 || echo "wheel install failed (see install.log)" | tee -a "$OUT/summary.log"
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi

step() {  # step NAME LIMIT_S CMD...: run CMD under a time limit, log to $W/NAME.log, summarise
  local name=$1 lim=$2
  shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  echo "=== $name (limit ${lim} s) start $(date +%T)" | tee -a "$OUT/summary.log"
  local t0=$SECONDS
  timeout "$lim" "$@" > "$W/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.log"
}

env_report() {
  nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.limit --format=csv
  $PY -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda,
torch.cuda.is_available(), torch.cuda.get_device_name(0), 'nccl', torch.cuda.nccl.version())"
  $PY -c "import ray, hydra, omegaconf, numba; print('ray', ray.__version__, 'hydra', hydra.__version__)"
}

profile() {
  for m in llama2_7b codellama_34b llama2_70b; do
    $PY -m harness.calibrate profile --model $m --device cuda --tp 1 2 4 8 \
      --num-tokens 1 2 4 8 16 32 64 128 256 512 1024 2048 4096 --out "$W/profiles" || return
  done
}

harness_runs() {
  $PY -m harness +system=rlhfuse model=smollm2_135m workload=tiny backend=ray cluster=h100_8x cluster.num_nodes=1 \
    cluster.gpus_per_node=1 system.fused_search.max_steps=200 logger=none results_dir="$W/results" $RW || return
  $PY -m harness +system=deepspeed_chat model=smollm2_135m workload=tiny backend=ray cluster=h100_8x \
    cluster.num_nodes=1 cluster.gpus_per_node=1 system.mini_batch_size=4 system.generation_batch_size=8 \
    logger=none results_dir="$W/results" $RW
}

export -f env_report profile harness_runs
export PY RW W
step env 60 bash -c env_report
step profile 160 bash -c profile
step engine 90 $PY benchmarks/engine_profile.py
step svr_small 120 $PY benchmarks/sim_vs_real.py --device cuda --devices 1 --model smollm2_135m \
  --systems rlhfuse_base rlhfuse --stream-rounds to_next_finish --iterations 3 --override $RW
step harness_runs 150 bash -c harness_runs
step moe 300 $PY benchmarks/moe_profile.py --local-experts 2 4 8 16 32 --budget-s 240 --out "$W/moe_experts.csv"
step moe_block 150 $PY benchmarks/moe_profile.py --block --budget-s 110 --out "$W/moe_block.csv"
tar czf "$OUT/gpu_check.tgz" -C "$OUT" w && rm -rf "$W"
cat "$OUT/summary.log"
