"""A load spec for a test request (the connector's ``LoadSpec``), shared by the vLLM transfer tests."""
from ciuicflow.integrations.vllm.metadata import LoadSpec


def cdiv(a, b):
    return -(-a // b)


def load_spec(r, block_ids, timeout_s=20.0, sync=False):
    return LoadSpec(req_id=r["id"], key=r["key"], block_ids=block_ids, sent_blocks=cdiv(r["tokens"], r["bs"]),
                    first_block=0, num_tokens=r["tokens"], tokens_sha=r["sha"], timeout_s=timeout_s, sync=sync)
