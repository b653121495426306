"""Model geometry: KV-cache groups and bytes per block from a Hugging Face ``config.json``
(:mod:`~tiering.model.hf_model`, its families in :mod:`~tiering.model.hf_families`), the named
shapes of the examples and benchmarks (:mod:`~tiering.model.shapes`), a shape's KV tensors
(:mod:`~tiering.model.kv_tensors`, the one module here that imports torch), and which checkpoint a
block's KV came from (:mod:`~tiering.model.identity`). Above :mod:`tiering.core`, below
everything that builds a layout from a model.
"""
