"""Text in: the bundled tokenizer and checkpoints' tokenizers (``tokenize``) and
SentencePiece models (``sentencepiece``)."""
