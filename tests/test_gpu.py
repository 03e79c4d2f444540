"""The same engine on a CUDA device: logits against transformers, greedy output against the CPU
float32 path, batching invariance, and a quantized checkpoint served from its dequantized weights.
Marked `gpu`; skipped without CUDA (run them all with scripts/gpu_check.sh)."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "서울은 한국의"]


def test_tiny_model_logits_match_transformers_on_cuda(tiny_model):
    from transformers import AutoModelForCausalLM

    from tokenmill.models import loader

    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(0))
    ref = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()(ids[None]).logits[0]
    ours = loader.load(tiny_model, "float32", torch.device("cuda"), load_tokenizer=False).model
    got = ours.compute_logits(ours(ids.cuda(), torch.arange(40, device="cuda"))).cpu()
    torch.testing.assert_close(got, ref.float(), rtol=1e-3, atol=1e-3)


@pytest.fixture(scope="module")
def cpu_greedy(default_model):
    from tokenmill import LLM, SamplingParams

    llm = LLM(default_model, dtype="float32", quantization="none", device="cpu", kv_cache_memory="512MiB")
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0))]


def test_default_model_greedy_on_cuda_equals_cpu(default_model, cpu_greedy):
    from tokenmill import LLM, SamplingParams

    llm = LLM(default_model, dtype="float32", device="cuda", gpu_memory_utilization=0.2)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0))
    same = [o.outputs[0].token_ids == ref for o, ref in zip(outs, cpu_greedy)]
    assert sum(same) >= len(PROMPTS) - 1, same  # float32 on both; one near-tie may flip


def test_batch_invariance_on_cuda(default_model):
    from tokenmill import LLM, SamplingParams

    llm = LLM(default_model, dtype="float32", device="cuda", gpu_memory_utilization=0.2)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    solo = [llm.generate([p], params)[0].outputs[0].token_ids for p in PROMPTS]
    batch = [o.outputs[0].token_ids for o in llm.generate(PROMPTS * 4, params)]
    assert batch == solo * 4


def test_quantized_checkpoint_serves_dequantized_on_cuda(tiny_llama, tmp_path):
    from tokenmill.compress import export
    from tokenmill.compress import quantize as quant
    from tokenmill.models import loader

    src = loader.load(tiny_llama, "float32", torch.device("cpu"), load_tokenizer=False, quantization="none")
    cfg = quant.QuantizeConfig("gptq", group_size=32, calib_samples=4, calib_seq_len=64)
    results = quant.quantize_model(src.model, cfg, [torch.randint(0, 256, (64,)) for _ in range(4)], progress=False)
    tensors = export.float_tensors(src.model, skip=set(results))
    tensors.update(quant.checkpoint_tensors(src.model, results, cfg))
    with export.atomic_output_dir(str(tmp_path / "q")) as tmp:
        export.write_checkpoint(tmp, src.arch, None, tensors, "float32", cfg.hf_quantization_config())
    ids = torch.arange(20)
    ref = src.model.compute_logits(src.model(ids, torch.arange(20)))
    gpu = loader.load(str(tmp_path / "q"), "float32", torch.device("cuda"), load_tokenizer=False, quantization="gptq")
    got = gpu.model.compute_logits(gpu.model(ids.cuda(), torch.arange(20, device="cuda"))).cpu()
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)


def test_more_tensor_parallel_ranks_than_devices_are_refused(tiny_llama):
    """One rank per CUDA device (NCCL): asking for more ranks than devices is a clear error before any
    worker starts, not a CUDA failure inside one."""
    from tokenmill import LLM

    n = torch.cuda.device_count() + 1
    with pytest.raises(ValueError, match=f"tensor_parallel_size {n} runs one rank per CUDA device"):
        LLM(tiny_llama, tensor_parallel_size=n, device="cuda", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="'ray' places CPU ranks"):
        LLM(tiny_llama, tensor_parallel_size=2, device="cuda", distributed_executor_backend="ray",
            skip_tokenizer_init=True)
