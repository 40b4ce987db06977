"""Train an EAGLE-3 head for a target on a text corpus (scripts/train_eagle3.py).

corpus.py    the corpus as token sequences; the draft vocabulary from token frequencies
features.py  the target's features over the corpus, by our own engine (resumable dump)
ttt.py       the head's training forward: training-time test unrolled over draft steps
trainer.py   the loop, checkpoints in upstream's EAGLE-3 format, resume
"""
