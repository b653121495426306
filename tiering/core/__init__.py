"""The bottom layer: what a block is, before any policy, backend or manager.

Offload keys and prefix hashing (aligned to ``hash_block_size``), KV-cache groups and their
layouts, hybrid-hit lookup, store planning, the block frame every tier writes (header and
checksum) and the layout fingerprint it carries, caller-memory runs, and the loader of
``module:attr`` plugins. Nothing here imports another layer of ``tiering``.
"""
