"""Regenerate the byte-level BPE vocabulary shipped for the built-in tiny models.

The files are committed (tritonlm/models/tiny_tokenizer/); this script documents
how they were made. Byte-level BPE like GPT-2's: any UTF-8 text encodes, and
multi-byte characters split across tokens (what streaming has to handle).
"""

from pathlib import Path

from tokenizers import ByteLevelBPETokenizer

CORPUS = """
The quick brown fox jumps over the lazy dog. A language model predicts the next token from the ones before it.
Serving a model means keeping the hardware busy: batch requests together, reuse the key and value cache,
and stream each new piece of text to the client as soon as it is ready. Triton Inference Server runs models
from many frameworks behind HTTP and gRPC endpoints. The capital of France is Paris. The capital of Italy is Rome.
Once upon a time there was a small robot who wanted to learn how to write stories about the sea and the stars.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159. Code: def main(): return print("hello, world")
Café, naïve, résumé, jalapeño, Straße, smörgåsbord. Привет, мир. 你好，世界。こんにちは世界。안녕하세요. 🙂🚀✨
"""


def main() -> None:
    out = Path(__file__).resolve().parent.parent / "tritonlm" / "models" / "tiny_tokenizer"
    out.mkdir(parents=True, exist_ok=True)
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator([CORPUS] * 4, vocab_size=512, min_frequency=2, special_tokens=["<|endoftext|>"])
    tok.save(str(out / "tokenizer.json"))


if __name__ == "__main__":
    main()
