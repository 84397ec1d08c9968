"""Drop-ins for the trainers' own loss code: ``megatron`` (Megatron-Core's DSA indexer loss).

The Hugging Face ``transformers`` side needs no adapter module: examples/hf_distill.py registers
an attention function through transformers' ``AttentionInterface`` (docs/integrations.md).
"""
from .megatron import dsa_indexer_loss, tp_row_chunks

__all__ = ["dsa_indexer_loss", "tp_row_chunks"]
