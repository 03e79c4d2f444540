"""The weight cache (models/weight_cache.py): a second load maps the packed model the first wrote and
computes exactly the same; entries that do not read back, or whose source changed, are replaced;
a pickle naming anything outside tokenmill, torch and numpy is refused."""
import io
import os
import pickle
import shutil

import pytest
import torch

from tokenmill.models import loader, weight_cache
from tokenmill.sampling_params import SamplingParams


def _load(path, cache, load_tokenizer=True):
    return loader.load(str(path), "auto", torch.device("cpu"), load_tokenizer=load_tokenizer, weight_cache=str(cache))


def _tensors(model) -> list[torch.Tensor]:
    p = weight_cache._Pickler(io.BytesIO())
    p.dump(model)
    return p.keep


def _entries(d) -> list[str]:
    return sorted(p.name for p in d.glob("*.bin"))


@pytest.mark.parametrize("source", ["default_model", "tiny_llama"])
def test_second_load_maps_the_cache_and_holds_the_same_weights(source, tmp_path, request):
    path = request.getfixturevalue(source)
    first = _load(path, tmp_path, source == "default_model")
    assert not first.from_cache
    weight_cache.wait_for_writes()
    assert len(_entries(tmp_path)) == 1
    second = _load(path, tmp_path, source == "default_model")
    assert second.from_cache
    a, b = _tensors(first.model), _tensors(second.model)
    assert len(a) == len(b) > 10
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
    if source == "default_model":  # the embedding is read through a mapping of the GGUF, not copied
        assert second.model.model.embed_tokens._raw.filename == os.path.realpath(path)


def test_an_engine_on_the_cache_generates_the_same(default_model, tmp_path):
    from tokenmill import LLM

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = "The capital of France is"
    texts = []
    for cache in ("off", tmp_path, tmp_path):  # from the file, writing the entry, from the entry
        llm = LLM(default_model, kv_cache_memory="256MiB", weight_cache=str(cache))
        texts.append(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)
        weight_cache.wait_for_writes()
        del llm
    assert texts[0] == texts[1] == texts[2]
    assert len(_entries(tmp_path)) == 1


def test_an_entry_that_does_not_read_back_is_replaced(default_model, tmp_path):
    _load(default_model, tmp_path)
    weight_cache.wait_for_writes()
    (entry,) = tmp_path.glob("*.bin")
    with open(entry, "r+b") as f:
        f.truncate(entry.stat().st_size // 2)
    again = _load(default_model, tmp_path)
    assert not again.from_cache
    weight_cache.wait_for_writes()
    assert _load(default_model, tmp_path).from_cache


def test_a_changed_source_gets_a_new_entry_and_the_old_one_goes(default_model, tmp_path):
    model = tmp_path / "model.gguf"
    shutil.copyfile(default_model, model)
    cache = tmp_path / "cache"
    _load(model, cache)
    weight_cache.wait_for_writes()
    old = _entries(cache)
    st = model.stat()
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file was replaced
    assert not _load(model, cache).from_cache
    weight_cache.wait_for_writes()
    new = _entries(cache)
    assert len(old) == len(new) == 1 and old != new
    assert not list(cache.glob("*.tmp"))


def test_a_pickle_naming_a_foreign_callable_is_refused(default_model, tmp_path):
    entry = weight_cache.Entry(tmp_path, [default_model], {})
    skeleton = pickle.dumps(os.system)  # a `find_class` of posix.system
    with open(entry.path, "wb") as f:
        f.write(weight_cache._HEAD.pack(weight_cache.MAGIC, weight_cache.VERSION, len(skeleton), 0,
                                        weight_cache._data_start(len(skeleton), 0)) + skeleton)
        f.truncate(weight_cache._data_start(len(skeleton), 0))
    assert entry.read() is None
    assert not entry.path.exists()


def test_auto_leaves_a_small_model_uncached(default_model, tmp_path):
    """`auto` writes entries only for models of WEIGHT_CACHE_MIN_BYTES or more (the default model is ~0.1 GB)."""
    model = _load(default_model, "off").model
    entry = weight_cache.Entry(tmp_path, [default_model], {})
    entry.write_later(model, weight_cache.WEIGHT_CACHE_MIN_BYTES)
    weight_cache.wait_for_writes()
    assert not _entries(tmp_path)
    entry.write_later(model)
    weight_cache.wait_for_writes()
    assert _entries(tmp_path) == [entry.path.name]


def test_weight_cache_flag_is_validated():
    from tokenmill.config import ModelConfig

    with pytest.raises(ValueError, match="weight_cache"):
        ModelConfig(weight_cache="")


def test_a_path_without_a_model_is_a_clear_error_with_the_cache_on(tmp_path):
    """The cache's key is the model's files: a folder without them is refused with the loader's own
    message before any key is made."""
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ValueError, match="has no config.json"):
        loader.load(str(tmp_path), "auto", torch.device("cpu"), weight_cache=str(tmp_path / "cache"))
