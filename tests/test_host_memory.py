"""Huge-page host memory (tokenmill/utils.py): zero-filled, writable, values kept when weights move
into the shared arena, and a quantized model's weights really live there."""
from types import SimpleNamespace

import torch

from tokenmill import LLM
from tokenmill.utils import HUGE_PAGE_MIN_BYTES, gather_in_huge_pages, huge_page_zeros


def test_huge_page_zeros_is_a_zeroed_writable_tensor():
    t = huge_page_zeros((3, HUGE_PAGE_MIN_BYTES // 2), torch.float16)
    assert t.shape == (3, HUGE_PAGE_MIN_BYTES // 2) and t.dtype == torch.float16 and t.is_contiguous()
    assert not t.any()
    t[1, 5] = 2.5
    assert t[1, 5].item() == 2.5 and t.sum().item() == 2.5
    small = huge_page_zeros((4, 2), torch.int64)  # below the threshold: an ordinary tensor
    assert small.shape == (4, 2) and not small.any()


def test_gather_keeps_values_shapes_and_shares_one_aligned_arena():
    g = torch.Generator().manual_seed(0)
    objs = [SimpleNamespace(w=torch.randint(0, 255, (7, 13), generator=g, dtype=torch.uint8)),
            SimpleNamespace(w=torch.randn(5, 3, 16, generator=g)),
            SimpleNamespace(w=torch.randn(2 << 20, generator=g).half())]
    before = [o.w.clone() for o in objs]
    big = objs[2].w  # 4 MiB: packed into huge pages of its own (the packers do), left where it is
    gather_in_huge_pages([(o, "w") for o in objs])
    for o, b in zip(objs, before):
        assert o.w.dtype == b.dtype and o.w.shape == b.shape and torch.equal(o.w, b)
        assert o.w.data_ptr() % 64 == 0
    assert len({o.w.untyped_storage().data_ptr() for o in objs[:2]}) == 1
    assert objs[0].w.data_ptr() < objs[1].w.data_ptr()  # in the order given
    assert objs[2].w is big


def test_quantized_weights_live_in_one_arena(tiny_llama):
    llm = LLM(tiny_llama, quantization="int4", quantization_group_size=32, kv_cache_memory="16MiB",
              skip_tokenizer_init=True)
    weights = llm.engine.runner.model.quantized_weights()
    assert weights and all(w.panels is not None for w in weights)
    assert len({w.panels.q.untyped_storage().data_ptr() for w in weights}) == 1
