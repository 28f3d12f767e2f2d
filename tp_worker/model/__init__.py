"""The model (tp_worker): a decoder built from a checkpoint's config.json, its tensor-parallel
layers, rotary embeddings, the attention seam and its torch backend, the weights' loading,
and the speculative draft model. Per-family differences are one table (families.py)."""
