"""Tokenizers trained in the test process on local text (no downloads): a byte-level BPE with the
`tokenizers` library and SentencePiece models with the `sentencepiece` package, and the corpus the
tokenizer tests encode and decode (multi-byte UTF-8, emoji, combining marks, ZWJ sequences)."""
from __future__ import annotations

import io
import json
from pathlib import Path

# Training text: several scripts, so merges span multi-byte characters.
TRAINING = [
    "The quick brown fox jumps over the lazy dog, again and again.",
    "Grüße aus Köln! Ça va très bien, merci. Žluťoučký kůň úpěl ďábelské ódy.",
    "日本語のテキストを少し書きます。東京は大きな都市です。",
    "Привет, как дела? Всё хорошо, спасибо.",
    "Emoji are text too 🎉🚀 and 👍🏽 and the family 👨‍👩‍👧 says hi.",
    "Numbers 12345 and 3.14159, symbols #@$%^&*() and tabs\tand\nnewlines.",
    "مرحبا بالعالم، هذا نص عربي قصير.",
    "한국어 문장도 하나 있습니다.",
] * 20

# What the tests encode and decode: not only the training text.
CORPUS = [
    "Hello, world!",
    "Grüße aus Köln — ça va?",
    "日本語のテキスト、そして東京。",
    "Emoji: 🎉🚀👍🏽 👨‍👩‍👧 🇫🇷",
    "Combining: e\u0301 a\u0308 and precomposed é ä",
    "  leading spaces, trailing  ",
    "tabs\tand\nnew\nlines",
    "Привет 世界 مرحبا 한국어 🦜",
    "x" * 40 + " 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math 𝟙𝟚𝟛",
]


def byte_bpe(folder: Path, vocab_size: int = 400, *, added: bool = True, regex_split: str | None = None,
             nfc: bool = False, add_prefix_space: bool = False, ignore_merges: bool = False) -> Path:
    """A byte-level BPE tokenizer.json trained on TRAINING, with <|endoftext|> (special) and, if
    `added`, one non-special added token; `regex_split` puts a Split(regex) before ByteLevel (the
    Qwen2 style); `nfc` an NFC normaliser (Qwen2, GPT-NeoX); `ignore_merges` as Llama 3's. Returns
    the file's path."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    if regex_split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex_split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator(TRAINING, trainer)
    if added:
        tok.add_tokens([AddedToken("colibri bird", special=False)])
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tokenizer.json"
    tok.save(str(path))
    if ignore_merges:  # the trainer's model has no such option: set in the file, as Llama 3's has it
        spec = json.loads(path.read_text())
        spec["model"]["ignore_merges"] = True
        path.write_text(json.dumps(spec))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>",
                                                               "bos_token": "<|endoftext|>"}))
    return path


def sentencepiece_model(folder: Path, vocab_size: int = 600, *, model_type: str = "bpe", byte_fallback: bool = True,
                        add_dummy_prefix: bool = True, remove_extra_whitespaces: bool = False,
                        user_defined_symbols: tuple[str, ...] = ()) -> Path:
    """A SentencePiece tokenizer.model trained on TRAINING (identity normaliser, as Llama's)."""
    import sentencepiece

    out = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(TRAINING), model_writer=out, vocab_size=vocab_size, model_type=model_type,
        byte_fallback=byte_fallback, normalization_rule_name="identity", character_coverage=1.0,
        add_dummy_prefix=add_dummy_prefix, remove_extra_whitespaces=remove_extra_whitespaces,
        hard_vocab_limit=False, minloglevel=2, num_threads=1,
        **({"user_defined_symbols": list(user_defined_symbols)} if user_defined_symbols else {}))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tokenizer.model"
    path.write_bytes(out.getvalue())
    return path
