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
