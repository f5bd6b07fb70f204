"""Real execution (docs/DESIGN.md section 6): a LLaMA decoder that splits into pipeline stages and loads
Hugging Face / GGUF checkpoints (``model``, ``hf``, ``gguf``), a continuous-batching generation
engine with a KV cache and sample migration (``engine``, optional vLLM adapter ``vllm_engine``),
and the PPO math (``ppo``). Modules import torch; nothing here needs a GPU."""
