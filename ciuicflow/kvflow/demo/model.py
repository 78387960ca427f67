"""The kv-demo's model and prompts: every process builds the same DeepseekV3 (seeded random init)."""
from __future__ import annotations

import json
from typing import List, Optional

# DeepseekV3Config arguments per --size. "base" has DeepSeek-V3's own attention widths (kv_lora_rank 512 +
# qk_rope_head_dim 64 = 576 cached values per token and layer); the rest are scaled down.
SIZES = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                 num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                 kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                 max_position_embeddings=512),
    "small": dict(vocab_size=2048, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                  num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, n_routed_experts=8,
                  num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                  kv_lora_rank=128, q_lora_rank=192, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
                  max_position_embeddings=2048),
    "base": dict(vocab_size=8192, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
                 num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=16,
                 num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                 kv_lora_rank=512, q_lora_rank=768, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                 max_position_embeddings=4096),
}


def model_config_kwargs(size: str, layers: Optional[int] = None, config_file: Optional[str] = None) -> dict:
    if config_file:
        with open(config_file) as fh:
            kwargs = json.load(fh)
        for drop in ("architectures", "auto_map", "quantization_config", "transformers_version", "torch_dtype",
                     "dtype"):
            kwargs.pop(drop, None)
    else:
        if size not in SIZES:
            raise ValueError(f"--size must be one of {sorted(SIZES)}, got {size!r}")
        kwargs = dict(SIZES[size])
    if layers is not None:
        if layers < 1:
            raise ValueError("--layers must be at least 1")
        kwargs["num_hidden_layers"] = layers
        kwargs["first_k_dense_replace"] = min(kwargs.get("first_k_dense_replace", 1), layers)
    return kwargs


def build_model(spec: dict):
    """(model, config) from a spec: the same weights in every process (seeded random init)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    torch.set_num_threads(int(spec.get("threads", 1)))
    config = DeepseekV3Config(**spec["config"])
    torch.manual_seed(int(spec["seed"]))
    model = DeepseekV3ForCausalLM(config)
    model = model.to(getattr(torch, spec["dtype"])).eval()
    return model, config


def model_fingerprint(model) -> str:
    import hashlib
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().float().sum().double().numpy().tobytes())
        h.update(p.detach().reshape(-1)[:64].float().numpy().tobytes())
    return h.hexdigest()[:16]


def make_prompts(spec: dict) -> List[List[int]]:
    import random
    rng = random.Random(int(spec["seed"]) + 1)
    longest, vocab = int(spec["prompt_len"]), int(spec["config"]["vocab_size"])
    return [[rng.randrange(vocab) for _ in range(rng.randint(max(1, longest // 2), longest))]
            for _ in range(int(spec["prompts"]))]


def greedy_decode(model, cache, first_token: int, new_tokens: int) -> List[int]:
    """Greedy decoding from a filled cache: ``first_token`` (from prefill) then new_tokens - 1 more."""
    import torch
    tokens = [int(first_token)]
    with torch.no_grad():
        for _ in range(new_tokens - 1):
            out = model(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def reference_tokens(model, config, prompt: List[int], new_tokens: int) -> List[int]:
    """Prefill and decode in this one process: what the disaggregated pair must reproduce."""
    import torch
    from transformers import DynamicCache
    cache = DynamicCache(config=config)
    with torch.no_grad():
        out = model(torch.tensor([prompt]), cache=cache, use_cache=True)
    return greedy_decode(model, cache, int(out.logits[0, -1].argmax()), new_tokens)


def transfer_key(spec: dict, index: int) -> str:
    return f"{spec['run_id']}/prompt-{index}"
