"""Encoder models (BERT, XLM-RoBERTa) and sentence-transformers pooling against transformers on the
same random weights: hidden states of a ragged batch, classification heads, pooled embeddings."""
from __future__ import annotations

import json
import os

import pytest
import torch
import transformers as tf
from safetensors.torch import save_file

from tokenmill.models.encoder import EncoderConfig, load_encoder
from tokenmill.models.pooling import PoolingConfig

SMALL = dict(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=64)
KINDS = {
    "bert": (tf.BertConfig, tf.BertModel, {}),
    "xlm-roberta": (tf.XLMRobertaConfig, tf.XLMRobertaModel, {"pad_token_id": 1, "type_vocab_size": 1}),
    "bert-head": (tf.BertConfig, tf.BertForSequenceClassification, {"num_labels": 1}),
    "xlm-roberta-head": (tf.XLMRobertaConfig, tf.XLMRobertaForSequenceClassification,
                         {"pad_token_id": 1, "type_vocab_size": 1, "num_labels": 1}),
    "nomic-bert": (tf.NomicBertConfig, tf.NomicBertModel, {"hidden_act": "silu"}),
}
INPUTS = [[5, 17, 33, 2, 90, 11, 4], [7, 8], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70], [9, 8, 7, 6, 5, 4, 3]]  # two of one length


def _save(kind: str, path, seed: int = 0, heads: int = 4):
    cfg_cls, model_cls, extra = KINDS[kind]
    torch.manual_seed(seed)
    ref = model_cls(cfg_cls(**{"hidden_act": "gelu", **SMALL, "num_attention_heads": heads, **extra})).eval()
    with torch.no_grad():  # norms away from 1 and 0, projections larger than the init's: more to get wrong
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ref.save_pretrained(path, safe_serialization=True)
    return ref


def _reference_hidden(ref, ids: list[int]) -> torch.Tensor:
    base = getattr(ref, "bert", None) or getattr(ref, "roberta", None) or ref
    with torch.no_grad():
        return base(torch.tensor([ids])).last_hidden_state[0]


@pytest.mark.parametrize("heads", [4, 2])  # heads of 8: SDPA per run of one length; of 16: tokenmill's kernel
@pytest.mark.parametrize("kind", ["bert", "xlm-roberta", "nomic-bert"])
def test_encoder_hidden_states_equal_transformers_on_a_ragged_batch(kind, heads, tmp_path):
    ref = _save(kind, tmp_path, heads=heads)
    model = load_encoder(str(tmp_path))
    with torch.no_grad():
        got = model(torch.tensor(sum(INPUTS, [])), [len(i) for i in INPUTS])
    want = torch.cat([_reference_hidden(ref, ids) for ids in INPUTS])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_nomic_bert_loads_under_transformers_names_too(tmp_path):
    """save_pretrained writes Nomic's own tensor names (Wqkv, fc11/fc12, norm1/2); a checkpoint
    under transformers' names (q/k/v_proj, up/gate_proj) loads to the same model."""
    ref = _save("nomic-bert", tmp_path)
    native = tmp_path / "native"
    native.mkdir()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(native / "model.safetensors"))
    (native / "config.json").write_text((tmp_path / "config.json").read_text())
    assert "layers.0.self_attn.q_proj.weight" in ref.state_dict()
    ids = torch.tensor(sum(INPUTS, []))
    lengths = [len(i) for i in INPUTS]
    with torch.no_grad():
        torch.testing.assert_close(load_encoder(str(native))(ids, lengths), load_encoder(str(tmp_path))(ids, lengths),
                                   rtol=0, atol=0)


@pytest.mark.parametrize("change, words", [({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1000.0}}, "yarn"),
                                           ({"rotary_emb_interleaved": True}, "interleaved"),
                                           ({"qkv_proj_bias": True}, "biases"),
                                           ({"hidden_act": "gelu"}, "gelu")])
def test_nomic_bert_variants_it_cannot_run_are_refused(tmp_path, change, words):
    _save("nomic-bert", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ValueError, match=words):
        load_encoder(str(tmp_path))


@pytest.mark.parametrize("kind", ["bert-head", "xlm-roberta-head"])
def test_cross_encoder_scores_equal_transformers(kind, tmp_path):
    ref = _save(kind, tmp_path)
    model = load_encoder(str(tmp_path))
    assert model.cfg.num_labels == 1
    lengths = [len(i) for i in INPUTS]
    with torch.no_grad():
        got = model.classify(model(torch.tensor(sum(INPUTS, [])), lengths), lengths)
        want = torch.cat([ref(torch.tensor([ids])).logits for ids in INPUTS])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _write_st(path, pooling: dict, normalize: bool, dense: dict | None = None) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    os.makedirs(path / "1_Pooling")
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, **pooling}))
    if dense is not None:
        modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
        os.makedirs(path / "2_Dense")
        (path / "2_Dense" / "config.json").write_text(json.dumps(
            {"in_features": 32, "out_features": 16, "bias": True,
             "activation_function": "torch.nn.modules.activation.Tanh"}))
        save_file(dense, str(path / "2_Dense" / "model.safetensors"))
    if normalize:
        modules.append({"idx": len(modules), "name": "n", "path": "n", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a, b, dim=-1)


def test_mean_pooling_and_normalization_as_the_sentence_transformers_config_says(tmp_path):
    ref = _save("bert", tmp_path)
    _write_st(tmp_path, {"pooling_mode_mean_tokens": True}, normalize=True)
    pool = PoolingConfig.from_dir(str(tmp_path))
    assert pool.modes == ("mean",) and pool.normalize
    model = load_encoder(str(tmp_path))
    lengths = [len(i) for i in INPUTS]
    with torch.no_grad():
        got = pool(model(torch.tensor(sum(INPUTS, [])), lengths), lengths)
    want = torch.nn.functional.normalize(torch.stack([_reference_hidden(ref, ids).mean(0) for ids in INPUTS]), dim=-1)
    assert _cos(got, want).min() > 0.9999
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_concatenated_modes_then_a_dense_layer(tmp_path):
    ref = _save("xlm-roberta", tmp_path)
    g = torch.Generator().manual_seed(1)
    dense = {"linear.weight": torch.randn(16, 64, generator=g), "linear.bias": torch.randn(16, generator=g)}
    _write_st(tmp_path, {"pooling_mode_cls_token": True, "pooling_mode_max_tokens": True}, normalize=False,
              dense=dense)
    # the Dense module reads the concatenation: 2 x 32 inputs
    cfg = json.loads((tmp_path / "2_Dense" / "config.json").read_text())
    (tmp_path / "2_Dense" / "config.json").write_text(json.dumps({**cfg, "in_features": 64}))
    pool = PoolingConfig.from_dir(str(tmp_path))
    model = load_encoder(str(tmp_path))
    lengths = [len(i) for i in INPUTS]
    with torch.no_grad():
        got = pool(model(torch.tensor(sum(INPUTS, [])), lengths), lengths)
    cat = torch.stack([torch.cat([h[0], h.amax(0)]) for h in (_reference_hidden(ref, ids) for ids in INPUTS)])
    want = torch.tanh(cat @ dense["linear.weight"].t() + dense["linear.bias"])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_refusals(tmp_path):
    with pytest.raises(ValueError, match="not an encoder"):
        EncoderConfig.from_hf({"model_type": "llama"})
    with pytest.raises(ValueError, match="hidden_act"):
        EncoderConfig.from_hf({"model_type": "bert", "hidden_act": "swish"})
    ref = _save("bert", tmp_path)
    model = load_encoder(str(tmp_path))
    with pytest.raises(ValueError, match="longer than the model's 64 positions"):
        model(torch.zeros(65, dtype=torch.long), [65])
    weights = {k: v for k, v in ref.state_dict().items() if "layer.1.output.dense" not in k}
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks weights"):
        load_encoder(str(tmp_path))
    _write_st(tmp_path, {}, normalize=False)
    with pytest.raises(ValueError, match="sets no pooling mode"):
        PoolingConfig.from_dir(str(tmp_path))
