"""The SGLang and LMCache adapter tests (a package: its conftest must not clash with others)."""
