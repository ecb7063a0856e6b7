"""Token ids of text files under a SentencePiece model, by the sentencepiece
Python package (Debian's python3-sentencepiece): each file one document,
[bos] ids [eos], as `meshtrain data` frames it. The reference meshtrain's
shards are checked against (tests/unit/test_tokenizers.cpp).
    /usr/bin/python3 sentencepiece_ids.py MODEL FILE...  ->  ids, space-separated"""
import sys

import sentencepiece as spm

model, *paths = sys.argv[1:]
sp = spm.SentencePieceProcessor(model_file=model)
ids = []
for path in paths:
    with open(path, encoding="utf-8", newline="") as f:  # the bytes as they are: no newline translation
        ids += [sp.bos_id()] + sp.encode(f.read()) + [sp.eos_id()]
print(" ".join(map(str, ids)))
