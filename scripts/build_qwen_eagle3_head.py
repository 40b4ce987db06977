"""Train (or resume) the EAGLE-3 head for Qwen2.5-Coder-0.5B on legal texts, cached.

Trains on the legal documents of scripts/fetch_legal_docs.py except those the held-out
evaluation asks about (benchmark/spec_eval/eval_set.py: DORA, CRA, the Esri licence; the
table contract is generated there), and writes the head to
~/.cache/sglang-fork/heads/qwen2.5-coder-0.5b-eagle3/ (not committed: ~60 MB). Rerunning
resumes; --max-steps higher goes on training.

    python scripts/build_qwen_eagle3_head.py [--max-steps 300] [--max-sequences 160]
        [--chat-answers 3 --seq-len 512 --output-dir DIR]  # + the target's own chat answers
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))

from sglang.eagle_train.trainer import TrainConfig, resolve_device, train  # noqa: E402
from sglang.test import real_assets  # noqa: E402

HELD_OUT = {"dora", "cra", "license_esri"}  # the held-out eval's documents


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-steps", type=int, default=300)
    ap.add_argument("--max-sequences", type=int, default=160)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--draft-vocab-size", type=int, default=16384)
    ap.add_argument("--chat-answers", type=int, default=0,
                    help="excerpts per training document answered by the target itself in the "
                         "chat template and trained on beside the raw texts "
                         "(sglang/eagle_train/selfgen.py); 0: raw texts only")
    ap.add_argument("--device", default="auto",
                    help="auto (a GPU where torch sees one), cpu or cuda: the answers, the "
                         "features and the training")
    ap.add_argument("--output-dir", default=os.path.expanduser(
        "~/.cache/sglang-fork/heads/qwen2.5-coder-0.5b-eagle3"))
    a = ap.parse_args(argv)
    legal = real_assets.legal_dir()
    names = sorted(f[:-4] for f in os.listdir(legal) if f.endswith(".txt"))
    train_docs = [n for n in names if n not in HELD_OUT]
    if not train_docs:
        raise SystemExit(f"no legal texts in {legal}: run scripts/fetch_legal_docs.py")
    corpus = os.path.join(a.output_dir, "corpus")
    os.makedirs(corpus, exist_ok=True)
    for n in train_docs:
        link = os.path.join(corpus, n + ".txt")
        if not os.path.exists(link):
            os.symlink(os.path.join(legal, n + ".txt"), link)
    target = os.path.join(real_assets.models_dir(), "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
    gen_seconds = 0.0
    if a.chat_answers:
        import time

        from sglang.eagle_train.selfgen import generate_answers

        t0 = time.perf_counter()
        generate_answers(target, [os.path.join(legal, n + ".txt") for n in train_docs],
                         os.path.join(corpus, "chat"), excerpt_tokens=256,
                         excerpts_per_doc=a.chat_answers, device=resolve_device(a.device))
        gen_seconds = round(time.perf_counter() - t0, 1)
    summary = train(TrainConfig(target, corpus, a.output_dir, max_steps=a.max_steps,
                                seq_len=a.seq_len, max_sequences=a.max_sequences,
                                draft_vocab_size=a.draft_vocab_size, save_every=50,
                                device=a.device))
    summary["train_documents"] = train_docs
    summary["chat_answers_per_document"] = a.chat_answers
    summary["chat_answer_seconds"] = gen_seconds
    summary["held_out"] = sorted(HELD_OUT)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
