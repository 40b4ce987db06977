"""Batch review of legal documents: every (document, question) answered once, resumably.

Run it as `python -m sglang.review` (see docs/review.md). The pieces: `inputs` (documents,
questions, programs), `store` (the kill-safe JSONL results file), `runner` (warm each
document once, answer its questions in parallel), `summary`.
"""
