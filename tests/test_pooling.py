"""Pooling models in the engine: embeddings and cross-encoder scores from `LLM` against
sentence-transformers on the same random weights (BERT and XLM-RoBERTa encoders, a decoder
embedder against transformers' last hidden state), and the scheduler's pooling requests."""
from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

from tokenmill import LLM, PoolingParams

LETTERS = "abcdefghijklmnopqrstuvwxyz"
WORDS = ["the", "cat", "sat", "on", "mat", "dog", "ran", "fast", "paris", "is", "capital", "of", "france", "what"]
# heads of 16: the encoders take tokenmill's attention kernel on AVX-512 (test_encoder covers SDPA's path)
SMALL = dict(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
             max_position_embeddings=64, hidden_act="gelu")
TEXTS = ["the cat sat on the mat", "what is the capital of france", "dog", "paris is the capital of france " * 2]
QUERY = "what is the capital of france"
DOCS = ["paris is the capital of france", "the cat sat on the mat", "dog ran fast", "france"]


def _tokenizer(path, roberta: bool) -> None:
    """A WordPiece tokenizer with BERT's or RoBERTa's special tokens, saved as transformers does."""
    specials = ["<s>", "<pad>", "</s>", "<unk>"] if roberta else ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {t: i for i, t in enumerate(specials + list(LETTERS) + [f"##{c}" for c in LETTERS] + WORDS)}
    unk = "<unk>" if roberta else "[UNK]"
    tok = Tokenizer(models.WordPiece(vocab, unk_token=unk))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    if roberta:
        tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
        names = dict(bos_token="<s>", eos_token="</s>", sep_token="</s>", cls_token="<s>", pad_token="<pad>",
                     model_input_names=["input_ids", "attention_mask"])
    else:
        tok.post_processor = processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2))
        names = dict(sep_token="[SEP]", cls_token="[CLS]", pad_token="[PAD]", mask_token="[MASK]",
                     model_input_names=["input_ids", "token_type_ids", "attention_mask"])
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=unk, **names).save_pretrained(path)


def _encoder_dir(path, kind: str, head: bool) -> str:
    torch.manual_seed(hash(kind) % 1000 + head)
    roberta = kind == "xlm-roberta"
    cfg_cls = tf.XLMRobertaConfig if roberta else tf.BertConfig
    extra = {"pad_token_id": 1, "type_vocab_size": 1} if roberta else {}
    cfg = cfg_cls(**SMALL, **extra, num_labels=1)
    if head:
        model = (tf.XLMRobertaForSequenceClassification if roberta else tf.BertForSequenceClassification)(cfg)
    else:
        model = (tf.XLMRobertaModel if roberta else tf.BertModel)(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.eval().save_pretrained(path, safe_serialization=True)
    _tokenizer(path, roberta)
    return str(path)


@pytest.fixture(scope="module", params=["bert", "xlm-roberta"])
def embedder(request, tmp_path_factory):
    """An encoder saved as a sentence-transformers model (mean pooling, then Normalize)."""
    from sentence_transformers import SentenceTransformer, models as st

    path = tmp_path_factory.mktemp(f"st-{request.param}")
    _encoder_dir(path, request.param, head=False)
    word = st.Transformer(str(path))
    ref = SentenceTransformer(modules=[word, st.Pooling(word.get_embedding_dimension(), "mean"), st.Normalize()],
                              device="cpu")
    ref.save(str(path))
    return str(path), ref


@pytest.fixture(scope="module", params=["bert", "xlm-roberta"])
def cross_encoder(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"ce-{request.param}")
    return _encoder_dir(path, request.param, head=True)


def test_encoder_embeddings_equal_sentence_transformers(embedder):
    path, ref = embedder
    llm = LLM(path, task="embed")
    got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    want = torch.tensor(ref.encode(TEXTS, convert_to_numpy=True))
    cos = torch.nn.functional.cosine_similarity(got, want)
    assert cos.min() > 0.9999, cos
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # one input is the same alone as beside others (each attends over itself only)
    alone = llm.embed(TEXTS[1], use_tqdm=False)[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(alone), got[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("options", [dict(quantization="int8"), dict(quantization="int8", activation_bits=8),
                                     dict(dtype="bfloat16")])
def test_encoders_run_on_the_integer_kernels_and_in_bfloat16(embedder, options):
    """The decoders' options: int8 weights (round-to-nearest at load) on the integer kernels, or
    bfloat16; close to float32, not equal."""
    path, ref = embedder
    llm = LLM(path, task="embed", **options)
    got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    want = torch.tensor(ref.encode(TEXTS, convert_to_numpy=True))
    assert torch.nn.functional.cosine_similarity(got, want).min() > 0.99
    assert llm.engine.activation_bits == (options.get("activation_bits", 16) if "quantization" in options else None)


def test_cross_encoder_scores_equal_sentence_transformers(cross_encoder):
    from sentence_transformers import CrossEncoder

    ref = CrossEncoder(cross_encoder, device="cpu")
    want = ref.predict([(QUERY, d) for d in DOCS], convert_to_numpy=True)
    llm = LLM(cross_encoder)
    got = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want).flatten().float(), rtol=1e-4, atol=1e-4)
    assert sorted(range(len(DOCS)), key=lambda i: -got[i]) == sorted(range(len(DOCS)), key=lambda i: -want[i])
    with pytest.raises(ValueError, match="embed"):
        llm.embed("dog", use_tqdm=False)  # a cross-encoder classifies; it has no embedding task
    with pytest.raises(ValueError, match="generate"):
        llm.generate("dog")


def test_truncation_keeps_the_special_tokens(embedder):
    path, _ = embedder
    llm = LLM(path, task="embed", max_model_len=12)
    long = " ".join(WORDS * 3)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.embed(long, use_tqdm=False)
    out = llm.embed(long, truncate_prompt_tokens=12, use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert len(out.prompt_token_ids) == 12
    assert out.prompt_token_ids[-1] == tok.encode("")[-1]  # the closing separator survives the cut


@pytest.fixture(scope="module")
def decoder_embedder(tmp_path_factory):
    from conftest import make_tiny_hf

    path = make_tiny_hf("qwen2", str(tmp_path_factory.mktemp("qwen2-embed")))
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    cfg["matryoshka_dimensions"] = [16, 32, 64]
    with open(f"{path}/config.json", "w") as f:
        json.dump(cfg, f)
    return path


def test_decoder_embeddings_are_the_last_tokens_final_hidden_state(decoder_embedder):
    """Last-token pooling, normalized, Matryoshka-cut before normalizing; chunked prefill and a
    prefix-cache hit give the same vector."""
    ref = tf.AutoModel.from_pretrained(decoder_embedder, dtype=torch.float32).eval()
    prompts = [[5, 9, 33, 2, 90, 11, 4] * 5, [7, 8], list(range(40, 100))]
    llm = LLM(decoder_embedder, task="embed", skip_tokenizer_init=True, max_num_batched_tokens=32,
              quantization="none", dtype="float32", kv_cache_memory="64MiB", kv_cache_dtype="float32")
    outs = llm.embed(prompts, use_tqdm=False)
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            last = ref(torch.tensor([ids])).last_hidden_state[0, -1]
        _close(out.outputs.embedding, torch.nn.functional.normalize(last, dim=-1))
        short = llm.embed([ids], PoolingParams(dimensions=16), use_tqdm=False)[0]  # its prefix now cached
        _close(short.outputs.embedding, torch.nn.functional.normalize(last[:16], dim=-1))
    assert llm.engine.block_manager.num_hits > 0
    with pytest.raises(ValueError, match="dimensions 65"):
        llm.embed([[1, 2]], PoolingParams(dimensions=65), use_tqdm=False)
    with pytest.raises(ValueError, match="generate"):
        llm.generate([[1, 2]])


@pytest.fixture(scope="module", params=["bert", "nomic-bert"])
def bert_gguf(request, tmp_path_factory):
    """A tiny random BERT (or Nomic BERT) as a sentence-transformers directory and as llama.cpp's
    converter writes it to GGUF (benchmarks/make_bert.py: the same weights), F32 and F16. llama.cpp
    runs both files (checked by hand: cosine 1.0 to tokenmill's vectors)."""
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
    import make_bert

    path = tmp_path_factory.mktemp(f"{request.param}-gguf")
    tokens = make_bert.vocabulary(2000)
    make_bert.save_hf(str(path / "hf"), make_bert.SHAPES["tiny"], tokens, arch=request.param)
    for kind in ("F32", "F16"):
        make_bert.write_gguf(str(path / "hf"), str(path / f"model-{kind}.gguf"), kind)
    ws = make_bert.words(tokens)
    texts = [" ".join(ws[i:i + 7]) + f", {ws[i + 9].upper()}!" for i in range(0, 60, 7)] + ["qqqqqqqqqqqqqqqq (xyz)"]
    return path, texts


def test_a_gguf_bert_embeds_as_its_sentence_transformers_twin(bert_gguf):
    """llama.cpp's `bert` and `nomic-bert` layouts: WordPiece rebuilt from the phantom-space
    vocabulary (same ids as the Hugging Face tokenizer), CLS or mean pooling from the metadata,
    normalized; the Hugging Face directory itself too (Nomic BERT under Nomic's tensor names)."""
    from sentence_transformers import SentenceTransformer

    path, texts = bert_gguf
    ref = SentenceTransformer(str(path / "hf"), device="cpu")
    want = torch.tensor(ref.encode(texts))
    for kind, floor in (("F32", 0.99999), ("F16", 0.999), ("hf", 0.99999)):
        llm = LLM(str(path / f"model-{kind}.gguf") if kind != "hf" else str(path / "hf"))
        outs = llm.embed(texts, use_tqdm=False)
        assert [o.prompt_token_ids for o in outs] == [ref.tokenizer(t)["input_ids"] for t in texts]
        got = torch.tensor([o.outputs.embedding for o in outs])
        assert torch.nn.functional.cosine_similarity(got, want).min() > floor


def _close(got: list[float], want: torch.Tensor) -> None:
    """Equal up to the kernels' summation order (float32 weights, activations and KV cache)."""
    got = torch.tensor(got)
    assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.99999
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_a_generating_decoder_also_embeds_and_refuses_dimensions(tiny_llama):
    llm = LLM(tiny_llama, skip_tokenizer_init=True, kv_cache_memory="64MiB")
    assert llm.engine.tasks == {"generate", "embed"}
    vec = llm.embed([[3, 4, 5]], use_tqdm=False)[0].outputs.embedding
    assert abs(sum(v * v for v in vec) - 1) < 1e-4
    with pytest.raises(ValueError, match="Matryoshka"):
        llm.embed([[3, 4, 5]], PoolingParams(dimensions=8), use_tqdm=False)
    out = llm.generate([[3, 4, 5]])[0]  # and still generates
    assert out.outputs[0].token_ids


def test_a_decoder_reranker_scores_yes_against_no(decoder_embedder):
    """classifier_from_token (Qwen3-Reranker): the probability of the second token against the
    first after the input's last token; the same prompt's logits in transformers are the reference."""
    ref = tf.AutoModelForCausalLM.from_pretrained(decoder_embedder, dtype=torch.float32).eval()
    llm = LLM(decoder_embedder, classifier_from_token="17,42", skip_tokenizer_init=True, quantization="none",
              dtype="float32", kv_cache_memory="64MiB", kv_cache_dtype="float32")
    assert llm.engine.tasks == {"classify"}
    prompts = [[5, 9, 33, 2, 90, 11, 4] * 3, [7, 8, 1]]
    for ids, out in zip(prompts, llm.classify(prompts, use_tqdm=False)):
        with torch.no_grad():
            last = ref(torch.tensor([ids])).logits[0, -1]
        want = torch.softmax(last[[17, 42]], dim=-1)[1].item()
        assert abs(out.outputs.score - want) < 1e-4
    with pytest.raises(ValueError, match="classify"):
        llm.embed([[1, 2]], use_tqdm=False)
    with pytest.raises(ValueError, match="two tokens"):
        LLM(decoder_embedder, classifier_from_token="17", skip_tokenizer_init=True)


def test_pooling_params_are_validated():
    for bad in (dict(dimensions=0), dict(dimensions=True), dict(task="generate"), dict(normalize="yes"),
                dict(task="classify", dimensions=4)):
        with pytest.raises(ValueError):
            PoolingParams(**bad)


# ---------------------------------------------------------------- the HTTP routes, official client
@pytest.fixture(scope="module")
def st_bert(tmp_path_factory):
    from sentence_transformers import SentenceTransformer, models as st

    path = tmp_path_factory.mktemp("st-served")
    _encoder_dir(path, "bert", head=False)
    word = st.Transformer(str(path))
    ref = SentenceTransformer(modules=[word, st.Pooling(word.get_embedding_dimension(), "cls"), st.Normalize()],
                              device="cpu")
    ref.save(str(path))
    return str(path), ref


@pytest.fixture(scope="module")
def embed_server(st_bert):
    from test_server import serving

    with serving("--model", st_bert[0], "--served-model-name", "embedder") as base:
        yield base


@pytest.fixture(scope="module")
def rerank_server(tmp_path_factory):
    from test_server import serving

    path = _encoder_dir(tmp_path_factory.mktemp("ce-served"), "bert", head=True)
    with serving("--model", path, "--served-model-name", "reranker") as base:
        yield base, path


def test_embeddings_route_with_the_openai_client(embed_server, st_bert):
    import base64

    import numpy as np
    import openai

    from test_server import metric

    client = openai.OpenAI(base_url=embed_server + "/v1", api_key="x", max_retries=0)
    want = st_bert[1].encode(TEXTS, convert_to_numpy=True)
    before = {n: metric(embed_server, n) for n in ("tokenmill:prompt_tokens_total", "tokenmill:request_success_total",
                                                   "tokenmill:e2e_request_latency_seconds_count")}
    got = client.embeddings.create(model="embedder", input=TEXTS)  # the client asks for base64 and decodes it
    # each input is one request in the metrics, its tokens prompt tokens
    assert metric(embed_server, "tokenmill:prompt_tokens_total") - before["tokenmill:prompt_tokens_total"] == \
        got.usage.prompt_tokens
    for n in ("tokenmill:request_success_total", "tokenmill:e2e_request_latency_seconds_count"):
        assert metric(embed_server, n) - before[n] == len(TEXTS)
    assert [d.index for d in got.data] == list(range(len(TEXTS)))
    np.testing.assert_allclose(np.array([d.embedding for d in got.data]), want, rtol=1e-4, atol=1e-5)
    floats = client.embeddings.create(model="embedder", input=TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, want[0], rtol=1e-4, atol=1e-5)
    raw = client.embeddings.create(model="embedder", input=TEXTS[:2], encoding_format="base64")
    decoded = np.frombuffer(base64.b64decode(raw.data[1].embedding), dtype="<f4")
    np.testing.assert_allclose(decoded, want[1], rtol=1e-4, atol=1e-5)
    tok = st_bert[1].tokenizer
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(len(tok(t)["input_ids"]) for t in TEXTS)
    ids = tok(TEXTS[2])["input_ids"]
    by_ids = client.embeddings.create(model="embedder", input=[ids, ids], encoding_format="float")
    np.testing.assert_allclose(by_ids.data[1].embedding, want[2], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": "dog", "dimensions": 8}, None),
    ({"input": "dog", "encoding_format": "hex"}, None), ({"input": "dog", "truncate_prompt_tokens": 0}, None),
    ({"input": [[1, 10**6]]}, None), ({"input": [-14265871, 3]}, None), ({"input": "dog", "nonsense": 1}, None),
    ({"input": "dog", "dimensions": -2006576}, "dimensions"), ({"input": "dog", "dimensions": 0}, "dimensions"),
    ({"input": "the cat " * 40}, None),
])
def test_bad_embedding_requests_are_400s_and_the_server_serves_on(embed_server, body, param):
    import httpx

    r = httpx.post(embed_server + "/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] and "Traceback" not in err["message"]
    if param:
        assert err["param"] == param
    ok = httpx.post(embed_server + "/v1/embeddings", json={"input": "dog"}, timeout=60)
    assert ok.status_code == 200


def test_truncation_and_no_generation_on_an_encoder(embed_server):
    import httpx

    long = "the cat " * 40
    r = httpx.post(embed_server + "/v1/embeddings", json={"input": long, "truncate_prompt_tokens": -1}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 64
    assert r.json()["timings"]["e2e"] > 0
    r = httpx.post(embed_server + "/v1/completions", json={"prompt": "dog", "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and "generate" in r.json()["error"]["message"]
    # an embedding model scores by cosine similarity
    r = httpx.post(embed_server + "/rerank", json={"query": QUERY, "documents": DOCS}, timeout=60)
    assert r.status_code == 200 and len(r.json()["results"]) == len(DOCS)


def test_rerank_and_score_routes_equal_the_cross_encoder(rerank_server):
    import httpx
    from sentence_transformers import CrossEncoder

    base, path = rerank_server
    want = CrossEncoder(path, device="cpu").predict([(QUERY, d) for d in DOCS], convert_to_numpy=True).flatten()
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    for route in ("/rerank", "/v1/rerank"):
        r = httpx.post(base + route, json={"model": "reranker", "query": QUERY, "documents": DOCS, "top_n": 3},
                       timeout=60).json()
        assert [x["index"] for x in r["results"]] == order[:3]
        for x in r["results"]:
            assert abs(x["relevance_score"] - float(want[x["index"]])) < 1e-4
            assert x["document"]["text"] == DOCS[x["index"]]
        assert r["usage"]["total_tokens"] > 0
    r = httpx.post(base + "/rerank", json={"query": QUERY, "documents": [{"text": d} for d in DOCS],
                                           "return_documents": False}, timeout=60).json()
    assert "document" not in r["results"][0] and len(r["results"]) == len(DOCS)
    for route in ("/score", "/v1/score"):
        r = httpx.post(base + route, json={"text_1": QUERY, "text_2": DOCS}, timeout=60).json()
        assert [x["index"] for x in r["data"]] == list(range(len(DOCS)))
        assert max(abs(x["score"] - float(w)) for x, w in zip(r["data"], want)) < 1e-4
    r = httpx.post(base + "/score", json={"text_1": [QUERY, QUERY], "text_2": DOCS}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "text_2"
    r = httpx.post(base + "/v1/embeddings", json={"input": "dog"}, timeout=60)
    assert r.status_code == 400 and "embed" in r.json()["error"]["message"]
    r = httpx.post(base + "/rerank", json={"query": QUERY, "documents": []}, timeout=60)
    assert r.status_code == 400


def test_a_rag_stack_behind_one_router(embed_server, rerank_server, st_bert):
    """Embedder, reranker and chat model, one server each, one router in front: each request goes
    to the replica that serves its `model` (the official client for embeddings and chat)."""
    import httpx
    import numpy as np
    import openai
    from test_router import KEY, start_router, stop
    from test_server import start_server

    chat_proc, chat = start_server("--served-model-name", "chat")  # each replica also serves the tests' MODEL name
    router_proc, router = start_router(embed_server, rerank_server[0], chat)
    try:
        client = openai.OpenAI(base_url=router + "/v1", api_key=KEY, max_retries=0, timeout=120)
        got = client.embeddings.create(model="embedder", input=TEXTS[:2])
        np.testing.assert_allclose(np.array([d.embedding for d in got.data]),
                                   st_bert[1].encode(TEXTS[:2], convert_to_numpy=True), rtol=1e-4, atol=1e-5)
        r = httpx.post(router + "/v1/rerank", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": "reranker", "query": QUERY, "documents": DOCS, "top_n": 2}, timeout=60)
        assert r.status_code == 200 and len(r.json()["results"]) == 2
        answer = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=4)
        assert answer.choices[0].message.content
        # the chat model embeds too (its last token's hidden state): the chat replica answers it
        assert len(client.embeddings.create(model="chat", input="dog").data[0].embedding) == 576
    finally:
        stop(router_proc, chat_proc)
