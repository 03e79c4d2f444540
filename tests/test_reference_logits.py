"""Logits of tiny random Llama / Qwen2 / Gemma models equal Hugging Face transformers' on the same
weights, for prefill (whole and chunked) and for every decode step through the paged KV cache."""
import pytest
import torch

from tokenmill.core.block_manager import BlockManager
from tokenmill.core.request import Request
from tokenmill.core.sched_output import NewRequest, ScheduledRequest, SchedulerOutput
from tokenmill.layers.attention import forward_context
from tokenmill.models import loader
from tokenmill.runner.model_runner import ModelRunner
from tokenmill.sampling_params import SamplingParams

TOL = 1e-4


def hf_logits(path: str, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def feed(r: Request, tokens: list[int], start: int, num_drafts: int = 0) -> ScheduledRequest:
    """One step's entry for `r`, sending its whole block table (a delta from zero blocks)."""
    return ScheduledRequest(r.req_id, tokens, start, 0, list(r.block_table), True, num_drafts)


def paged_logits(runner: ModelRunner, entries: list[ScheduledRequest]) -> torch.Tensor:
    """Logits of every token fed this step, computed through the runner's cache metadata."""
    sched = SchedulerOutput(scheduled=entries)
    sched.new_requests = [NewRequest(e.req_id, [], 0, SamplingParams(), []) for e in entries
                          if e.req_id not in runner.states]
    runner._update_states(sched)
    input_ids, positions, meta, _, _ = runner._prepare(sched)
    with torch.inference_mode(), forward_context(meta):
        return runner.model.compute_logits(runner.model(input_ids, positions))


def test_prefill_and_every_decode_step_match_transformers(tiny_model):
    lm = loader.load(tiny_model, "float32", torch.device("cpu"), load_tokenizer=False)
    bm = BlockManager(num_blocks=64, block_size=4)
    runner = ModelRunner(lm.model, 64, 4, torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (13, 5, 21)]
    refs = [hf_logits(tiny_model, s) for s in seqs]

    # Prefill: the first 9/3/11 tokens of each sequence in one ragged batch.
    reqs = [Request(f"r{i}", s, SamplingParams(), set()) for i, s in enumerate(seqs)]
    cuts = [9, 3, 11]
    entries = []
    for r, cut in zip(reqs, cuts):
        assert bm.allocate(r, cut)
        entries.append(feed(r, r.token_ids[:cut], 0))
    got = paged_logits(runner, entries)
    offset = 0
    for ref, cut in zip(refs, cuts):
        assert (got[offset:offset + cut] - ref[:cut]).abs().max() < TOL
        offset += cut

    # Sequence 2 continues with a second prefill chunk (context read from the cache) while
    # sequence 1 decodes one token per step and sequence 0 decodes with two drafts (three
    # positions scored as three successive decodes), all in the same batches.
    pos = list(cuts)
    while any(p < len(s) for p, s in zip(pos, seqs)):
        entries, owners = [], []
        for i, (r, s) in enumerate(zip(reqs, seqs)):
            if pos[i] >= len(s):
                continue
            n = min((3, 1, 4)[i], len(s) - pos[i])
            assert bm.allocate(r, pos[i] + n)
            entries.append(feed(r, s[pos[i]:pos[i] + n], pos[i], n - 1 if i == 0 else 0))
            owners.append((i, pos[i], n))
            pos[i] += n
        got = paged_logits(runner, entries)
        offset = 0
        for i, start, n in owners:
            diff = (got[offset:offset + n] - refs[i][start:start + n]).abs().max()
            assert diff < TOL, f"seq {i} positions {start}..{start + n}: max diff {diff}"
            offset += n


def test_dense_path_matches_transformers(tiny_llama):
    """No cache attached (evaluation/training path): plain causal attention over the input."""
    lm = loader.load(tiny_llama, "float32", torch.device("cpu"), load_tokenizer=False)
    ids = list(range(3, 40))
    with torch.inference_mode():
        got = lm.model.compute_logits(lm.model(torch.tensor(ids), torch.arange(len(ids))))
    assert (got - hf_logits(tiny_llama, ids)).abs().max() < TOL


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_loads_and_tracks_float32(tiny_llama, dtype):
    lm = loader.load(tiny_llama, dtype, torch.device("cpu"), load_tokenizer=False)
    assert next(lm.model.parameters()).dtype == getattr(torch, dtype)
    ids = list(range(5, 25))
    with torch.inference_mode():
        got = lm.model.compute_logits(lm.model(torch.tensor(ids), torch.arange(len(ids))))
    ref = hf_logits(tiny_llama, ids)
    assert torch.allclose(got, ref, atol=0.1 * ref.abs().max().item())


def test_perplexity_equals_transformers_loss(tiny_llama):
    """One window covering the text: exp(mean NLL) equals transformers' exp(loss); a sliding
    window with overlap scores every token exactly once."""
    import math

    from transformers import AutoModelForCausalLM

    from tokenmill.compress.evaluate import perplexity

    lm = loader.load(tiny_llama, "float32", torch.device("cpu"), load_tokenizer=False)
    ids = torch.randint(0, 256, (90,), generator=torch.Generator().manual_seed(5)).tolist()
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        loss = ref(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    whole = perplexity(lm.model, ids, context_len=128, stride=128, progress=False)
    assert whole["tokens_scored"] == 89
    assert math.isclose(whole["perplexity"], math.exp(loss), rel_tol=1e-4)
    sliding = perplexity(lm.model, ids, context_len=32, stride=16, progress=False)
    assert sliding["tokens_scored"] == 89


def test_perplexity_through_a_paged_cache(tiny_llama):
    """`eval ppl --kv-cache-dtype`: windows fed in chunks through a paged cache. A float32 cache gives
    the dense number (the chunks' attention reads back exactly what was computed); 8-bit caches move it
    a little and not at all the same way; the model's own caches are put back after."""
    import math

    from tokenmill.compress.evaluate import paged_cache, perplexity

    lm = loader.load(tiny_llama, "float32", torch.device("cpu"), load_tokenizer=False)
    ids = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(7)).tolist()
    dense = perplexity(lm.model, ids, context_len=64, stride=32, progress=False)["perplexity"]
    got = {}
    for kv in ["float32", "float16", "int8", "fp8_e5m2"]:
        with paged_cache(lm.model, kv, context_len=64, chunk=10) as scorer:
            got[kv] = perplexity(lm.model, ids, context_len=64, stride=32, progress=False, scorer=scorer)["perplexity"]
    assert math.isclose(got["float32"], dense, rel_tol=1e-5)
    assert got["int8"] != dense and got["fp8_e5m2"] != got["int8"]
    for kv in ["float16", "int8", "fp8_e5m2"]:
        assert math.isclose(got[kv], dense, rel_tol=0.05), got
    assert all(a.k_cache is None for a in lm.model.attention_layers())
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        with paged_cache(lm.model, "q4_0", context_len=64):
            pass
