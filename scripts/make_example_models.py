"""Write the model folders that the README's and docs' `--model` examples read.

    python scripts/make_example_models.py      # models/gpt2-tiny, marian-tiny, llama-2-7b, ...
    python scripts/make_example_models.py DIR  # the same four in DIR

- gpt2-tiny: a tiny random GPT-2 (3 blocks, D 32, 4 heads), its weights a seeded draw, with a
  small byte-level BPE tokenizer; its heads show no real language.
- marian-tiny: a tiny random MarianMT translator (2 + 2 blocks, D 32, 4 heads), its weights a
  seeded draw, with a small tokenizer that splits Chinese by character and ends a text with
  </s>: it shows the three attentions of an encoder–decoder, not a translation.
- llama-2-7b: Llama-2-7B's config.json and a model.safetensors that holds only the header
  (tensor names, shapes, float16), all that `shapes` and `memory` read.
- gemma-3-1b: the same for Gemma-3-1B (bfloat16): 22 of its 26 blocks slide over 512 keys.

transformers writes them (as `save_pretrained` does), so this needs the test extra:
`python -m pip install -e ".[test]"`. Existing folders are rewritten.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("gpt2-tiny", "marian-tiny", "llama-2-7b", "gemma-3-1b")


def write_example_models(directory: Path) -> list[Path]:
    """Write DIR/gpt2-tiny, marian-tiny, llama-2-7b and gemma-3-1b (nothing else); return them."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise SystemExit(
            'make_example_models: needs transformers (a test extra): pip install -e ".[test]"'
        ) from None
    sys.path.insert(0, str(ROOT / "tests"))
    import tiny_models  # the tests' own writers: the examples show what the tests check
    import tiny_seq2seq

    gpt2 = tiny_models.write("gpt2", directory / "gpt2-tiny")
    marian = tiny_seq2seq.write("marian", directory / "marian-tiny")
    llama = tiny_models.write_header_only("llama-2-7b", directory / "llama-2-7b")
    gemma = tiny_models.write_header_only("gemma-3-1b", directory / "gemma-3-1b", "bfloat16")
    return [gpt2, marian, llama, gemma]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", default="models", type=Path,
                        help="where the folders go (default: models)")  # fmt: skip
    args = parser.parse_args()
    for folder in write_example_models(args.directory):
        print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
