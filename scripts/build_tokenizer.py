"""Build the tokenizer shipped in attnctl/data/tokenizer.json from scripts/corpus/.

    python scripts/build_tokenizer.py            # rewrite the shipped file
    python scripts/build_tokenizer.py --check    # exit 1 if the shipped file differs

A byte-level BPE (the GPT-2 scheme) trained with Hugging Face `tokenizers` on a small
English + Chinese corpus written for attnctl. Byte-level means any text encodes without
unknown tokens; a Chinese character not merged during training becomes 2–3 byte tokens,
which attnctl labels as pieces of one character.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = Path(__file__).resolve().parent.parent
CORPUS = sorted((ROOT / "scripts" / "corpus").glob("*.txt"))
TARGET = ROOT / "attnctl" / "data" / "tokenizer.json"
VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<pad>"]  # id 0; used to pad batches of unequal length


def build() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # trim_offsets: the offsets of " you" cover "you", so labels carry no leading space
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(p) for p in CORPUS], trainer)
    return tokenizer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the shipped file")
    args = parser.parse_args()
    text = build().to_str(pretty=True) + "\n"
    if args.check:
        same = TARGET.read_text(encoding="utf-8") == text
        print("tokenizer.json is up to date" if same else "tokenizer.json differs from a rebuild")
        return 0 if same else 1
    TARGET.write_text(text, encoding="utf-8")
    print(f"wrote {TARGET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
