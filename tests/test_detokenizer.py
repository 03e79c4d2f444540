"""Incremental detokenizer: no split UTF-8 characters, stop strings across steps never leak."""
import pytest

from tokenmill.engine.detokenizer import DetokState
from tokenmill.models.gguf_loader import GGUFFile
from tokenmill.models.tokenizer import Tokenizer
from tokenmill.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tok(default_model):
    return Tokenizer.from_gguf(GGUFFile(default_model).meta)


def stream(tok, text, params, prompt="Say:"):
    st = DetokState(tok, tok.encode(prompt), params)
    deltas, stop = [], None
    for t in tok.encode(text):
        stop = st.add_tokens([t])
        deltas.append(st.take_delta(stop is not None))
        if stop is not None:
            break
    else:
        deltas.append(st.take_delta(True))
    return deltas, stop, st.text


@pytest.mark.parametrize("text", ["한국어 문장과 emoji 😀🎉👨‍👩‍👧 그리고 中文字符。", "ancient 𓀀 glyph, 𝄞 clef, naïve café"])
def test_deltas_never_split_a_character(tok, text):
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids), "corpus should contain multi-token characters"
    deltas, stop, full = stream(tok, text, SamplingParams())
    assert stop is None
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == full == text


def test_stop_string_straddling_tokens_is_cut_and_never_streamed(tok):
    text = "The answer is forty-two. END of story"
    params = SamplingParams(stop=["END of"])
    deltas, stop, full = stream(tok, text, params)
    assert stop == "END of"
    assert full == "The answer is forty-two. "
    assert "".join(deltas) == full
    assert all("END" not in d for d in deltas)


def test_include_stop_str_in_output(tok):
    deltas, stop, full = stream(tok, "one two three four", SamplingParams(stop=["three"], include_stop_str_in_output=True))
    assert stop == "three" and full == "one two three" and "".join(deltas) == full


def test_earliest_of_several_stop_strings_wins(tok):
    _, stop, full = stream(tok, "alpha beta gamma delta", SamplingParams(stop=["delta", "beta"]))
    assert stop == "beta" and full == "alpha "
