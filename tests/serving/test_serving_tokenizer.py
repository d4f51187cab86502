"""The byte tokenizer and chat template: round trips, specials, and the prefix property that
makes a multi-turn chat hit the prefix cache."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tract_async.errors import TractError
from tract_async.serving.errors import ChatTemplateError, TokenizerError
from tract_async.serving.tokenizer import ByteTokenizer, render_chat

TOK = ByteTokenizer()
SYSTEM = {"role": "system", "content": "You are a terse assistant."}


def test_ids_are_bytes_plus_three_specials():
    assert TOK.encode("hé") == [256, 104, 195, 169]
    assert TOK.encode("hé", add_bos=False, add_eos=True) == [104, 195, 169, 257]
    assert (TOK.bos_token_id, TOK.eos_token_id, TOK.pad_token_id, TOK.vocab_size) == (256, 257, 258, 259)


def test_vocab_matches_the_tiny_model():
    from tract_async.serving.model import tiny_llama_config

    cfg = tiny_llama_config()
    assert cfg.vocab_size == TOK.vocab_size
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (256, 257, 258)


@given(st.text())
def test_round_trip(text):
    assert TOK.decode(TOK.encode(text, add_eos=True)) == text


@given(st.text(), st.text())
def test_encoding_is_prefix_preserving(a, b):
    assert TOK.encode(a + b) == TOK.encode(a) + TOK.encode(b, add_bos=False)


def test_decode_specials_and_invalid_utf8():
    assert TOK.decode([256, 104, 105, 257, 258], skip_special_tokens=False) == "<bos>hi<eos><pad>"
    assert TOK.decode([256, 104, 105, 257]) == "hi"
    assert TOK.decode([0xFF, 104]) == "\ufffdh"  # a random model emits arbitrary bytes


def test_bad_input_raises_typed_errors():
    with pytest.raises(TokenizerError, match="259"):
        TOK.decode([104, 259])
    with pytest.raises(TokenizerError):
        TOK.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(ChatTemplateError, match="role"):
        render_chat([{"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="content"):
        render_chat([{"role": "user", "content": 3}])  # type: ignore[dict-item]
    with pytest.raises(ChatTemplateError):
        render_chat([{"role": "user"}])
    assert issubclass(TokenizerError, TractError) and issubclass(ChatTemplateError, ValueError)


def test_render_chat_format():
    text = render_chat([SYSTEM, {"role": "user", "content": "hi"}])
    assert text == (
        "<|system|>\nYou are a terse assistant.<|end|>\n"
        "<|user|>\nhi<|end|>\n"
        "<|assistant|>\n"
    )
    assert not render_chat([SYSTEM], add_generation_prompt=False).endswith("<|assistant|>\n")


@given(st.lists(st.tuples(st.text(max_size=40), st.text(max_size=40)), min_size=1, max_size=5))
def test_each_turn_extends_the_previous_prompt(turns):
    """Turn k's prompt is a prefix of turn k+1's: the whole history is a prefix-cache hit."""
    history = [SYSTEM]
    previous: list[int] | None = None
    for user, assistant in turns:
        history.append({"role": "user", "content": user})
        prompt = TOK.encode_chat(history)
        if previous is not None:
            assert prompt[: len(previous)] == previous
        previous = prompt
        history.append({"role": "assistant", "content": assistant})


def test_chats_with_the_same_system_prompt_share_its_prefix():
    a = TOK.encode_chat([SYSTEM, {"role": "user", "content": "first question"}])
    b = TOK.encode_chat([SYSTEM, {"role": "user", "content": "another one"}])
    shared = len(TOK.encode(render_chat([SYSTEM], add_generation_prompt=False) + "<|user|>\n"))
    assert a[:shared] == b[:shared] and a[shared] != b[shared]
