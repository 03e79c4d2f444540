"""Sampler: greedy, top-k / top-p / min-p support, penalties, seeds, and the sampled distribution."""
import math

import pytest
import torch

from tokenmill.sampling.sampler import Sampler, SamplingRow, noise_seed
from tokenmill.sampling_params import SamplingParams


def row(seed=None, tokens=(), prompt_len=0, banned=(), index=0, **kw):
    """A row of a request seeded `seed`, sampling its output token number `index`."""
    noise = noise_seed(seed, index) if seed is not None else None
    return SamplingRow(SamplingParams(seed=seed, **kw), list(tokens), prompt_len, noise, list(banned))


def sample(logits, rows):
    return Sampler()(torch.as_tensor(logits, dtype=torch.float32), rows)


def test_greedy_is_argmax_and_banned_tokens_are_skipped():
    logits = [[0.0, 3.0, 1.0], [5.0, 4.0, 0.0]]
    out = sample(logits, [row(temperature=0), row(temperature=0, banned=[0])])
    assert out.token_ids.tolist() == [1, 1]


def test_top_k_and_top_p_and_min_p_restrict_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    seen = {t for j in range(50)
            for t in sample(logits, [row(seed=i, index=j, top_k=2) for i in range(3)]).token_ids.tolist()}
    assert seen <= {0, 1} and len(seen) == 2
    # top_p=0.7: {0.5} has 0.5 < 0.7 so 0.3 is needed too; 0.15 never
    seen = {t for i in range(150) for t in sample(logits[:1], [row(seed=i, top_p=0.7)]).token_ids.tolist()}
    assert seen == {0, 1}
    # min_p=0.5: tokens below 0.25 are dropped
    seen = {t for i in range(150) for t in sample(logits[:1], [row(seed=i, min_p=0.5)]).token_ids.tolist()}
    assert seen == {0, 1}


def test_sampled_distribution_matches_softmax_with_temperature():
    logits = torch.tensor([[1.0, 0.0, -1.0, 0.5]])
    temp = 0.8
    expected = torch.softmax(logits[0] / temp, dim=0)
    n = 6000
    rows_ = [row(temperature=temp) for _ in range(n)]
    counts = torch.bincount(sample(logits.expand(n, -1), rows_).token_ids, minlength=4).float()
    chi2 = (((counts - n * expected) ** 2) / (n * expected)).sum().item()
    assert chi2 < 16.3, (counts / n, expected)  # p = 0.001 for 3 degrees of freedom


def test_seed_gives_same_tokens_whatever_the_batch():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(3))
    alone = [sample(logits, [row(seed=42, temperature=1.0)]).token_ids.item() for _ in range(1)]
    batch = sample(logits.expand(4, -1), [row(seed=7), row(seed=42), row(), row(seed=1)]).token_ids.tolist()
    assert batch[1] == alone[0]
    # each output position draws its own noise: a sequence of draws is reproducible from the seed
    # alone, whichever order or batches the positions are sampled in
    seq1 = [sample(logits, [row(seed=5, index=j)]).token_ids.item() for j in range(10)]
    seq2 = sample(logits.expand(10, -1), [row(seed=5, index=j) for j in reversed(range(10))]).token_ids.tolist()
    assert seq1 == seq2[::-1] and len(set(seq1)) > 1


def test_repetition_frequency_presence_penalties():
    logits = [[2.0, 2.0, -1.0, 1.9]]
    # token 0 seen in the prompt: repetition penalty 2 halves its positive logit
    out = sample(logits, [row(temperature=0, tokens=[0], prompt_len=1, repetition_penalty=2.0)])
    assert out.token_ids.item() == 1
    # frequency penalty over output tokens: token 1 twice -> 2 - 2*0.1 = 1.8 < 1.9 (and 0 wins)
    out = sample(logits, [row(temperature=0, tokens=[1, 1], prompt_len=0, frequency_penalty=0.1)])
    assert out.token_ids.item() == 0
    # presence penalty: tokens 0 and 1 present -> 1.9 wins
    out = sample(logits, [row(temperature=0, tokens=[0, 1], prompt_len=0, presence_penalty=0.5)])
    assert out.token_ids.item() == 3
    # prompt tokens do not count for frequency/presence
    out = sample(logits, [row(temperature=0, tokens=[0], prompt_len=1, presence_penalty=0.5)])
    assert out.token_ids.item() == 0


def test_logprobs_are_raw_log_softmax_with_ranks():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    out = sample(logits, [row(temperature=0, logprobs=2, repetition_penalty=1.0)])
    lsm = torch.log_softmax(logits[0], 0)
    assert math.isclose(out.logprobs.item(), lsm[1].item(), rel_tol=1e-6)
    assert out.ranks.item() == 1
    assert out.top_ids[0].tolist() == [1, 2]
    out = sample(logits, [row(temperature=0, logprobs=0, banned=[1])])
    assert out.token_ids.item() == 2 and out.ranks.item() == 2 and out.top_ids is None


@pytest.mark.parametrize("kw,match", [
    ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n must"), ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -5}, "max_tokens"),
    ({"top_k": -3}, "top_k"), ({"min_p": 2.0}, "min_p"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"frequency_penalty": 3.0}, "frequency_penalty"), ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"logprobs": 50}, "logprobs"), ({"stop": [""]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
])
def test_invalid_sampling_params_are_rejected_with_the_field_named(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)
