"""Train an EAGLE-3 head for a target on a text corpus (our engine makes the features).

    python scripts/train_eagle3.py --target-model-path DIR --corpus FILE_OR_FOLDER \
        --output-dir DIR [--max-steps N]

The output folder serves as `--speculative-algorithm EAGLE3 --speculative-draft-model-path
DIR`. Rerunning the same command resumes (features already dumped are kept; training goes
on from the last checkpoint up to --max-steps). Runs on a GPU where torch sees one, else on
the CPU (small targets); `--device` picks. The design is in python/sglang/eagle_train/.
"""

from __future__ import annotations

import argparse
import json
import sys

from sglang.eagle_train.trainer import TrainConfig, train


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target-model-path", required=True, help="HF folder or .gguf of the target")
    p.add_argument("--corpus", required=True, help="a .txt file or a folder of them")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--max-steps", type=int, default=1000, help="sequences trained on")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--max-sequences", type=int, default=0, help="0: the whole corpus")
    p.add_argument("--draft-vocab-size", type=int, default=32000)
    p.add_argument("--ttt-steps", type=int, default=3, help="draft steps unrolled in training")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--save-every", type=int, default=200)
    p.add_argument("--aux-layers", type=str, default=None,
                   help="three target layer ids, e.g. 1,11,20 (default: upstream's rule)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto",
                   help="where the target and the head run: auto (a GPU where torch sees one), "
                        "cpu, cuda, cuda:N")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    layers = [int(x) for x in a.aux_layers.split(",")] if a.aux_layers else None
    cfg = TrainConfig(a.target_model_path, a.corpus, a.output_dir, max_steps=a.max_steps,
                      seq_len=a.seq_len, max_sequences=a.max_sequences,
                      draft_vocab_size=a.draft_vocab_size, ttt_steps=a.ttt_steps, lr=a.lr,
                      save_every=a.save_every, aux_layers=layers, seed=a.seed,
                      progress=not a.no_progress, device=a.device)
    print(json.dumps(train(cfg), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
