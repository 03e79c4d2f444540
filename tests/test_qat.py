"""Quantization-aware training on tiny random models: the exported checkpoint holds exactly the
integers the fake-quantized forward trained against and serves them on the int4/int8 kernels; QAT
lowers the held-out KL to the teacher below its PTQ start; a crashed run resumes to the same
result as one that never stopped; bad flags exit 2 and write nothing."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tokenmill.cli import build_parser
from tokenmill.compress import commands, distill, export, qat
from tokenmill.compress import quantize as quant
from tokenmill.layers.linear import Linear
from tokenmill.models import loader
from tokenmill.quant import int4, int8, packed

CLI = [sys.executable, "-m", "tokenmill.cli", "--log-level", "WARNING"]
CPU = torch.device("cpu")


def load(path: str, quantization: str = "none", activation_bits: int | str = "auto"):
    return loader.load(path, "float32", CPU, load_tokenizer=False, quantization=quantization,
                       activation_bits=activation_bits).model


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(ids.numel())))


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def start(model, cfg: qat.QATConfig) -> dict:
    """The PTQ start on the model, fake quantizers attached."""
    calib = [torch.tensor(tokens(64, seed=i)) for i in range(8)]
    results = quant.quantize_model(model, cfg.quantize_config(), calib, progress=False)
    qat.latent_start(model, results)
    qat.attach(model, results)
    return results


@pytest.mark.parametrize("cfg", [qat.QATConfig(4, 32, "rtn"), qat.QATConfig(4, 32, "awq"),
                                 qat.QATConfig(4, 32, "gptq", act_order=True),
                                 qat.QATConfig(4, 64, "gptq", allow_partial_groups=True),
                                 qat.QATConfig(8, -1, "rtn")],
                         ids=["rtn-g32", "awq-g32", "gptq-act-order", "gptq-partial-groups", "int8-per-channel"])
def test_exported_checkpoint_serves_the_integers_trained_against(tiny_llama, tmp_path, cfg):
    teacher, student = load(tiny_llama), load(tiny_llama)
    before = {n: r.q.clone() for n, r in start(student, cfg).items()}
    for name, m in student.named_modules():   # step 0 is the PTQ start, integer for integer
        if name in before:
            assert torch.equal(m.parametrizations.weight[0].quantized(m.parametrizations.weight.original).q,
                               before[name]), name
    train = distill.DistillConfig(steps=6, batch_size=2, seq_len=32, lr=3e-3, warmup_steps=1, eval_every=0)
    qat.train(teacher, student, tokens(2000, 5), None, train, 1e-2, str(tmp_path / "w"), progress=False)
    ids = torch.tensor(tokens(24, 3))
    fake_quant = logits(student, ids)
    trained = qat.finish(student)
    assert sum(int((trained[n].q != q).sum()) for n, q in before.items()) > 0   # training moved integers
    torch.testing.assert_close(logits(student, ids), fake_quant, rtol=0, atol=0)

    tensors = export.float_tensors(student, skip=set(trained))
    tensors.update(quant.checkpoint_tensors(student, trained, cfg.quantize_config()))
    with export.atomic_output_dir(str(tmp_path / "q")) as tmp:
        export.write_checkpoint(tmp, loader.load(tiny_llama, "float32", CPU, load_tokenizer=False,
                                                 quantization="none").arch, None, tensors, "float32",
                                cfg.quantization_config())
    stored = load_file(str(tmp_path / "q" / "model.safetensors"))
    modules = dict(student.named_modules())
    for name, qw in trained.items():   # the stored integers, zeros and scales are the trained ones, exactly
        for shard, q in export.split_rows(name, modules[name], qw.q).items():
            parts = {k.rsplit(".", 1)[1]: v for k, v in stored.items() if k.rsplit(".", 1)[0] == shard}
            got = packed.unpack_awq(parts) if cfg.init == "awq" else packed.unpack_gptq(parts, cfg.bits)
            rows = export.split_rows(name, modules[name], torch.stack([qw.zeros, qw.scales]).permute(1, 0, 2))
            assert torch.equal(got[0], q), shard
            assert torch.equal(got[1], rows[shard][:, 0].long()) and torch.equal(got[2], rows[shard][:, 1]), shard

    torch.testing.assert_close(logits(load(str(tmp_path / "q")), ids), fake_quant, rtol=1e-5, atol=1e-5)
    method = cfg.quantization_config()["quant_method"]
    served = load(str(tmp_path / "q"), method, activation_bits=16)
    kinds = {type(m.qweight) for n, m in served.named_modules() if isinstance(m, Linear) and "layers" in n}
    assert kinds == {int8.Int8Weight if cfg.bits == 8 else int4.Int4Weight}
    got = logits(served, ids)
    assert (got - fake_quant).abs().max() < 0.05 * fake_quant.abs().max()  # bf16 activations in the kernels
    assert (got.argmax(-1) == fake_quant.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("init", ["rtn", "gptq"])
def test_qat_lowers_the_held_out_kl_below_its_ptq_start(tiny_llama, tmp_path, init):
    teacher, student = load(tiny_llama), load(tiny_llama)
    start(student, qat.QATConfig(4, 32, init))
    cfg = distill.DistillConfig(steps=60, batch_size=4, seq_len=64, lr=3e-4, warmup_steps=2, eval_every=0)
    held_out = tokens(2048, seed=100)                              # never trained on
    before = distill.held_out_kl(teacher, student, held_out)
    qat.train(teacher, student, tokens(8000, 5), None, cfg, 1e-3, str(tmp_path / "w"), progress=False)
    assert distill.held_out_kl(teacher, student, held_out) < 0.95 * before   # measured 0.93 (gptq, act-order start)


def test_a_crashed_run_resumes_to_the_same_checkpoint(tiny_llama_tok, calib_text, tmp_path, monkeypatch):
    def args(out: str):
        return build_parser().parse_args(
            ["qat", "--model", tiny_llama_tok, "--init", "gptq", "--group-size", "32", "--data", calib_text,
             "--calib-samples", "4", "--calib-seq-len", "64", "--steps", "8", "--batch-size", "2", "--seq-len", "32",
             "--save-every", "3", "--lr", "1e-3", "--scale-lr", "1e-2", "--warmup-steps", "1", "--eval-every", "0",
             "--dtype", "float32", "--quiet", "--output", out])

    straight = commands.run_qat(args(str(tmp_path / "straight")))
    real_loss, calls = distill._loss, {"n": 0}

    def crash_in_step_five(*a, **k):   # after the checkpoint of step 3
        calls["n"] += 1
        if calls["n"] > 4 * 2:
            raise KeyboardInterrupt
        return real_loss(*a, **k)

    monkeypatch.setattr(distill, "_loss", crash_in_step_five)
    with pytest.raises(KeyboardInterrupt):
        commands.run_qat(args(str(tmp_path / "resumed")))
    monkeypatch.setattr(distill, "_loss", real_loss)
    assert not (tmp_path / "resumed").exists()
    assert sorted(os.listdir(tmp_path / "resumed.ckpt")) == ["progress.json", "start.pt", "state.pt"]

    def no_second_calibration(*a, **k):
        raise AssertionError("a resumed run starts from the saved PTQ start")

    monkeypatch.setattr(quant, "quantize_model", no_second_calibration)
    resumed = commands.run_qat(args(str(tmp_path / "resumed")))
    assert [h["loss"] for h in resumed["history"]] == [h["loss"] for h in straight["history"]]
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("straight", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not (tmp_path / "resumed.ckpt").exists()


@pytest.mark.parametrize("flags,message", [
    (["--bits", "3"], "--bits must be 4 or 8"),
    (["--init", "hqq"], "--init must be one of"),
    (["--bits", "8", "--group-size", "128"], "per-channel symmetric int8"),
    (["--bits", "4", "--group-size", "-1"], "--bits 4 needs a --group-size"),
    (["--group-size", "48"], "--group-size must be one of"),
    (["--group-size", "64"], "does not divide the input dimension 96"),
    (["--scale-lr", "2"], "--scale-lr must lie in [0, 1)"),
    (["--init", "awq", "--act-order"], "it does not apply to awq"),
    (["--steps", "0"], "--steps >= 1"),
    (["--init", "awq", "--calib", "/nonexistent.txt"], "not found"),
    (["--teacher", "/nonexistent"], "nonexistent"),
])
def test_bad_flags_exit_2_and_write_nothing(tiny_llama_tok, calib_text, tmp_path, flags, message):
    out = tmp_path / "out"
    steps = [] if "--steps" in flags else ["--steps", "2"]
    r = subprocess.run(CLI + ["qat", "--model", tiny_llama_tok, "--data", calib_text, "--group-size", "32", *steps,
                              *flags, "--output", str(out), "--quiet"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert os.listdir(tmp_path) == []


def test_qat_command_end_to_end_and_served(tiny_llama_tok, calib_text, tmp_path):
    out = tmp_path / "qat"
    r = subprocess.run(CLI + ["qat", "--model", tiny_llama_tok, "--init", "awq", "--group-size", "32",
                              "--data", calib_text, "--eval-data", calib_text, "--eval-tokens", "600",
                              "--eval-every", "2", "--calib-samples", "4", "--calib-seq-len", "64", "--steps", "4",
                              "--batch-size", "2", "--seq-len", "64", "--output", str(out), "--quiet"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "awq" and cfg["quantization_config"]["group_size"] == 32
    report = json.loads((out / "compression.json").read_text())
    assert report["method"] == "qat-awq" and [h["step"] for h in report["history"] if "eval_ppl" in h] == [0, 2, 4]
    assert not (tmp_path / "qat.ckpt").exists()
    import openai

    from test_server import start_server

    proc, base = start_server("--model", str(out))   # the checkpoint as `tokenmill serve` runs it
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
        c = client.completions.create(model=client.models.list().data[0].id, prompt="The quick", max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert c.usage.completion_tokens == 6
    finally:
        proc.terminate()
        proc.wait(timeout=60)
