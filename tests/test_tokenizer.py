"""Tokenizer and chat template built from GGUF metadata equal Hugging Face's on the same file."""
import pytest

from tokenmill.models.gguf_loader import GGUFFile
from tokenmill.models.tokenizer import Tokenizer

CORPUS = [
    "Hello, world! The year 2024 had 366 days; π ≈ 3.14159.",
    "안녕하세요, 세계! 한국어 문장을 토큰으로 나눕니다.",
    "你好，世界。这是一个中文句子，用来测试分词器。",
    "Emoji: 😀🎉👍🏽 and a family 👨‍👩‍👧‍👦, flags 🇰🇷🇫🇷.",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "   leading spaces,\ttabs\t\tand\n\n\n   newlines   \n",
    "I'm sure they'll say we've DONE it, haven't we?",
    "<|im_start|>user\nspecial tokens stay whole<|im_end|>\n",
    "Ünïcödé façade — naïve café «quotes» ‘single’",
    "x" * 50 + " " * 17 + "y",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi 😀"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "한국어로 말해 줘"}],
]


@pytest.fixture(scope="module")
def ours(default_model):
    return Tokenizer.from_gguf(GGUFFile(default_model).meta)


@pytest.mark.parametrize("text", CORPUS)
def test_ids_equal_hugging_face(ours, hf_default_tokenizer, text):
    ids = ours.encode(text)
    assert ids == hf_default_tokenizer(text)["input_ids"]
    assert ours.decode(ids, skip_special_tokens=False) == hf_default_tokenizer.decode(ids)


@pytest.mark.parametrize("conv", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_apply_chat_template(ours, hf_default_tokenizer, conv, add_generation_prompt):
    expected = hf_default_tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(conv, add_generation_prompt=add_generation_prompt) == expected


def test_chat_template_is_sandboxed(ours):
    evil = Tokenizer(ours.tok, None, None, set(), "{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ValueError, match="chat template"):
        evil.apply_chat_template([{"role": "user", "content": "x"}])


def test_special_tokens_of_the_default_model(ours):
    assert ours.eos_token == "<|im_end|>" and ours.eos_token_ids == {2}


def _write_sentencepiece_gguf(path: str) -> None:
    """A small SentencePiece-style vocabulary (scores, byte fallback, no merges), as Llama 2 /
    TinyLlama GGUF files carry it."""
    import gguf
    import numpy as np

    pieces = {"▁"}
    for w in ["hello", "world", "low", "lower", "newest", "wide", "the", "a"]:
        s = "▁" + w
        pieces |= {s[:i] for i in range(1, len(s) + 1)}
        pieces |= {w[i:j] for i in range(len(w)) for j in range(i + 1, len(w) + 1)}
    pieces = sorted(pieces, key=lambda p: (len(p), p))
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_sentencepiece_gguf_vocabulary_matches_hugging_face(tmp_path):
    from transformers import AutoTokenizer

    _write_sentencepiece_gguf(str(tmp_path / "spm.gguf"))
    ours = Tokenizer.from_gguf(GGUFFile(str(tmp_path / "spm.gguf")).meta)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for text in ["hello world", "the newest lower wide", "  hello  world ", "héllo wörld 한국", "a\nb", "xyz"]:
        ids = ours.encode(text)
        assert ids == ref(text)["input_ids"], text
        assert ids[0] == 1  # BOS, as the file asks
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_sentencepiece_merges_skip_what_no_split_can_build():
    """Loading is linear in the vocabulary: a piece of two million characters (a hostile file)
    costs its length a few times, not its length squared, and changes no other merge."""
    from tokenmill.models.tokenizer import _sentencepiece_bpe

    pieces = ["<unk>", "▁", "a", "b", "ab", "▁a", "▁ab", "ba", "bab"]
    types = [2] + [1] * (len(pieces) - 1)
    plain = _sentencepiece_bpe(pieces, [0.0] + [-float(i) for i in range(1, len(pieces))], types)
    huge = "ab" * 1_000_000
    hostile = _sentencepiece_bpe(pieces + [huge], [0.0] + [-float(i) for i in range(1, len(pieces) + 1)],
                                 types + [1])
    for text in ["ab ba bab", "a b ab", "abababab"]:
        assert hostile.encode(text).ids == plain.encode(text).ids
