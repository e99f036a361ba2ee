"""`attnctl run --generate` against transformers' generate() keeping the same attentions.

    python benchmarks/generate.py [--tokens 64] [--new 32] [--rounds 3]

Writes two checkpoints with random weights (transformers is a test extra): a GPT-2 small
shaped decoder (12 blocks, D 768, 12 heads, float32) and an opus-mt shaped Marian
(6 + 6 blocks, D 512, 8 heads), each with a tiny tokenizer, and a prompt of about --tokens
tokens. Then it times whole processes, interleaved round by round: wall time and peak RSS
(os.wait4). attnctl generates --new tokens greedily with its KV cache and writes every
step's rows as JSON (`--json`, every head); the plain scripts load the folder with
transformers (eager attention, the implementation that returns weights) and call
generate(do_sample=False, num_beams=1, max_new_tokens=N, output_attentions=True,
return_dict_in_generate=True). Target: attnctl <= 1.15x the transformers script in time
and in peak RSS, for each model.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from long_input import report, run
from pretrained import text_of

ROOT = Path(__file__).resolve().parent.parent

PLAIN = r"""
import sys
import torch
import transformers
from tokenizers import Tokenizer

folder, text, new = sys.argv[1], open(sys.argv[2], encoding="utf-8").read(), int(sys.argv[3])
ids = torch.tensor([Tokenizer.from_file(folder + "/tokenizer.json").encode(text).ids])
seq2seq = "marian" in folder
auto = transformers.AutoModelForSeq2SeqLM if seq2seq else transformers.AutoModelForCausalLM
model = auto.from_pretrained(folder, attn_implementation="eager").eval()
with torch.inference_mode():
    out = model.generate(ids, do_sample=False, num_beams=1, max_new_tokens=new, min_new_tokens=new,
                         output_attentions=True, return_dict_in_generate=True, pad_token_id=0)
print(out.sequences.shape)
"""


def write_checkpoints(folder: Path) -> tuple[Path, Path]:
    sys.path.insert(0, str(ROOT / "tests"))
    import tiny_models
    import tiny_seq2seq
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    gpt2 = folder / "gpt2"
    gpt2.mkdir()
    tokenizer = tiny_models.build_tokenizer("gpt2")
    tokenizer.save(str(gpt2 / "tokenizer.json"))
    torch.manual_seed(0)
    config = transformers.GPT2Config(  # GPT-2 small's sizes, the tokenizer's vocabulary
        vocab_size=tokenizer.get_vocab_size(), eos_token_id=None, bos_token_id=None
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(gpt2)
    marian = tiny_seq2seq.write(
        "marian", folder / "marian", d_model=512, encoder_layers=6, decoder_layers=6,
        encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=2048,
        decoder_ffn_dim=2048, max_position_embeddings=512, forced_eos_token_id=None,
        eos_token_id=None,
    )  # fmt: skip
    return gpt2, marian


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write:  # in a child process: see below
        for model in write_checkpoints(args.write):
            (model / "prompt.txt").write_text(text_of(args.tokens, model), encoding="utf-8")
        return 0
    failed = 0
    with tempfile.TemporaryDirectory() as temporary:
        folder = Path(temporary)
        script = folder / "plain.py"
        script.write_text(PLAIN, encoding="utf-8")
        # written by a child: Linux carries a process's peak RSS across exec, so a parent
        # that had built the models would lend every timed command its own peak
        writer = [sys.executable, __file__, "--write", str(folder), "--tokens", str(args.tokens)]
        subprocess.run(writer, check=True, stdout=subprocess.DEVNULL)
        for model in (folder / "gpt2", folder / "marian"):
            path = model / "prompt.txt"
            new = str(args.new)
            commands = {
                "attnctl --generate": [sys.executable, "-m", "attnctl", "run", "--file", str(path),
                                       "--model", str(model), "--generate", new, "--json",
                                       "--device", "cpu"],
                "transformers eager": [sys.executable, str(script), str(model), str(path), new],
            }  # fmt: skip
            samples: dict[str, list[tuple[float, int]]] = {name: [] for name in commands}
            for _ in range(args.rounds):
                for name, command in commands.items():
                    samples[name].append(run(command))
            rounds = f"{args.rounds} interleaved rounds (medians)"
            print(f"{model.name}: {args.tokens} prompt tokens, {args.new} new, {rounds}")
            failed |= report(samples, "attnctl --generate", "transformers eager")
    return failed


if __name__ == "__main__":
    sys.exit(main())
