"""`attnctl run --model` against transformers computing the same block's attention.

    python benchmarks/pretrained.py [--tokens 512] [--rounds 3]

Writes a GPT-2 small shaped checkpoint (12 blocks, D 768, 12 heads, random weights,
float32, about 500 MB; transformers is a test extra) with a tiny tokenizer, and a text of
about --tokens tokens. Then it times whole processes, interleaved round by round: wall
time and peak RSS (os.wait4). attnctl shows block 11's weights (`--layer 11`); the plain
script loads the folder with transformers (eager attention, the implementation that
returns weights), runs it with output_attentions=True and takes block 11's. Target:
attnctl <= 1.3x the transformers script in time and in peak RSS.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from long_input import report, run

ROOT = Path(__file__).resolve().parent.parent

PLAIN = r"""
import sys
import torch
import transformers
from tokenizers import Tokenizer

folder, text = sys.argv[1], open(sys.argv[2], encoding="utf-8").read()
ids = Tokenizer.from_file(folder + "/tokenizer.json").encode(text).ids
model = transformers.AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
with torch.inference_mode():
    attentions = model(torch.tensor([ids]), output_attentions=True).attentions
print(tuple(attentions[11].shape), float(attentions[11][0, 0, -1].max()))
"""


def write_checkpoint(folder: Path) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import tiny_models
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    tiny_models.build_tokenizer("gpt2").save(str(folder / "tokenizer.json"))
    torch.manual_seed(0)
    config = transformers.GPT2Config()  # the defaults are GPT-2 small
    transformers.GPT2Model(config).save_pretrained(folder)


def text_of(tokens: int, folder: Path) -> str:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    words = (ROOT / "scripts" / "corpus" / "en.txt").read_text(encoding="utf-8").split()
    text = ""
    while len(tokenizer.encode(text).ids) < tokens:
        text += " " + words[len(text.split()) % len(words)]
    return text.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write:  # in a child process: see below
        write_checkpoint(args.write)
        (args.write / "text.txt").write_text(text_of(args.tokens, args.write), encoding="utf-8")
        return 0
    with tempfile.TemporaryDirectory() as temporary:
        folder = Path(temporary)
        # written by a child: Linux carries a process's peak RSS across exec, so a parent
        # that had built the model would lend every timed command its own peak
        writer = [sys.executable, __file__, "--write", str(folder), "--tokens", str(args.tokens)]
        subprocess.run(writer, check=True, stdout=subprocess.DEVNULL)
        path = folder / "text.txt"
        script = folder / "plain.py"
        script.write_text(PLAIN, encoding="utf-8")
        commands = {
            "attnctl --layer 11": [sys.executable, "-m", "attnctl", "run", "--file", str(path),
                                   "--model", str(folder), "--layer", "11", "--device", "cpu"],
            "attnctl --layer all": [sys.executable, "-m", "attnctl", "run", "--file", str(path),
                                    "--model", str(folder), "--layer", "all", "--device", "cpu"],
            "transformers eager": [sys.executable, str(script), str(folder), str(path)],
        }  # fmt: skip
        samples: dict[str, list[tuple[float, int]]] = {name: [] for name in commands}
        for _ in range(args.rounds):
            for name, command in commands.items():
                samples[name].append(run(command))
    print(f"GPT-2 small shape, {args.tokens} tokens, {args.rounds} interleaved rounds (medians)")
    return report(samples, "attnctl --layer 11", "transformers eager")


if __name__ == "__main__":
    sys.exit(main())
