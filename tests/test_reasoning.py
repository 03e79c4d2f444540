"""Reasoning parsers (server/reasoning.py): thinking and answer split the same whether the text
arrives whole or in any cut of deltas."""
import random

import pytest

from tokenmill.server import reasoning as R

CASES = [
    ("deepseek_r1", "Let me think.\nA step.</think>\n\nThe answer is 4.", "Let me think.\nA step.", "The answer is 4."),
    ("deepseek_r1", "<think>Hmm <b>bold</b> idea</think>Yes.", "Hmm <b>bold</b> idea", "Yes."),
    ("deepseek_r1", "Still thinking when max_tokens hit", "Still thinking when max_tokens hit", None),
    ("qwen3", "<think>\nplan</think>\n\nDone.", "\nplan", "Done."),
    ("qwen3", "Direct answer, no thinking.", None, "Direct answer, no thinking."),
    ("qwen3", "<think></think>Empty thoughts.", None, "Empty thoughts."),
]


@pytest.mark.parametrize("parser,text,reasoning,content", CASES)
def test_split_and_streaming_agree(parser, text, reasoning, content):
    assert R.split(parser, text) == (reasoning, content)
    rng = random.Random(1)
    for _ in range(40):
        s, pos, r_out, c_out = R.StreamingReasoning(parser), 0, "", ""
        while pos < len(text):
            step = rng.randint(1, 5)
            r, c = s.feed(text[pos:pos + step])
            r_out, c_out, pos = r_out + r, c_out + c, pos + step
        r, c = s.feed("", final=True)
        r_out, c_out = r_out + r, c_out + c
        assert (r_out or None, c_out or None) == (reasoning, content), text
