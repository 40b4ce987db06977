"""SGLang's frontend language: programs of text, `gen` and `select` run against a backend.

Importable without torch. The public names are re-exported from `sglang` itself.
"""
