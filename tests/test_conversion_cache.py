"""The GGUF conversion cache: the first load converts and caches, later loads read the cache and
give the same weights and tokenizer; damaged or unwritable caches fall back cleanly."""

from __future__ import annotations

import json
import os

import pytest

from agentrl.models.conversion_cache import cache_root, cached_conversion, entry_dir


@pytest.fixture
def source(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTRL_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "weights.gguf"
    path.write_bytes(b"gguf")
    return str(path)


class _Counter:
    """convert/save/load of a JSON 'model', counting conversions."""

    def __init__(self, value):
        self.value, self.converted = value, 0

    def convert(self):
        self.converted += 1
        return dict(self.value)

    @staticmethod
    def save(obj, out):
        with open(os.path.join(out, "model.json"), "w") as f:
            json.dump(obj, f)

    @staticmethod
    def load(directory):
        with open(os.path.join(directory, "model.json")) as f:
            return json.load(f)

    def __call__(self, src):
        return cached_conversion(src, "model", convert=self.convert, save=self.save, load=self.load)


def test_converts_once_then_loads_from_the_cache(source):
    model = _Counter({"w": [1, 2]})
    assert model(source) == {"w": [1, 2]} and model(source) == {"w": [1, 2]}
    assert model.converted == 1
    entry = entry_dir(source, "model")
    assert entry.is_dir() and str(entry).startswith(str(cache_root()))
    assert not [p for p in entry.parent.iterdir() if p.name.startswith(".tmp-")]  # nothing half-written left


def test_a_changed_source_file_is_converted_again(source):
    model = _Counter({"w": 1})
    model(source)
    with open(source, "ab") as f:
        f.write(b"more")  # a new size: a new key
    model(source)
    assert model.converted == 2


def test_a_damaged_entry_is_replaced(source):
    model = _Counter({"w": 1})
    model(source)
    (entry_dir(source, "model") / "model.json").write_text("{truncated")
    with pytest.warns(UserWarning, match="ignoring the damaged cache entry"):
        assert model(source) == {"w": 1}
    assert model.converted == 2 and model(source) == {"w": 1} and model.converted == 2


def test_an_unwritable_cache_only_costs_the_speed_up(source, tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    monkeypatch.setenv("AGENTRL_CACHE_DIR", str(blocker))
    model = _Counter({"w": 1})
    with pytest.warns(UserWarning, match="could not cache the converted model"):
        assert model(source) == {"w": 1}
    with pytest.warns(UserWarning):
        assert model(source) == {"w": 1}
    assert model.converted == 2


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("AGENTRL_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "agentrl"
    monkeypatch.setenv("AGENTRL_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"


@pytest.mark.slow
def test_smollm2_from_the_cache_equals_the_gguf_conversion(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    pytest.importorskip("gguf")
    from agentrl.models import loading

    try:
        loading.smollm2_gguf_dir()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    monkeypatch.setenv("AGENTRL_CACHE_DIR", str(tmp_path / "cache"))
    first = loading.load_model("smollm2-135m")  # converts the GGUF and fills the cache
    gguf = os.path.join(loading.smollm2_gguf_dir(), loading.SMOLLM2_GGUF)
    assert entry_dir(gguf, "model").is_dir() and entry_dir(gguf, "tokenizer").is_dir()

    import transformers

    def no_gguf(*args, **kwargs):
        if kwargs.get("gguf_file"):
            raise AssertionError("parsed the GGUF again")
        return original(*args, **kwargs)

    original = transformers.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_gguf)
    second = loading.load_model("smollm2-135m", dtype="bfloat16")
    a, b = first.model.state_dict(), second.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k].to(torch.bfloat16), b[k]) for k in a)
    assert second.model.lm_head.weight.data_ptr() == second.model.model.embed_tokens.weight.data_ptr()  # still tied
    messages = [{"role": "user", "content": "What is 12*7? <tool_call> é 🙂"}]
    ta, tb = first.tokenizer, second.tokenizer
    assert ta.get_vocab() == tb.get_vocab() and ta.chat_template == tb.chat_template
    assert ta.apply_chat_template(messages, tokenize=False) == tb.apply_chat_template(messages, tokenize=False)
    assert first.chat_format().stop_token_ids == second.chat_format().stop_token_ids
