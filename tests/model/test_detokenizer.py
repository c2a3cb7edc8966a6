"""Incremental detokenization on SmolLM2's real byte-level BPE tokenizer."""

from __future__ import annotations

import pytest

from worker.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello 🤗 世界 naïve café",
    "🦙🦙 日本語のテキスト, 한국어 텍스트 and Ελληνικά.",
    "Plain ASCII: it's 42 , spaced . oddly",
    "emoji at the end 👩‍👩‍👧",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Say something."}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n") and 1 in ids  # 1: <|im_start|>, a special token
    return ids


def stream(detok: IncrementalDetokenizer, token_ids: list[int], per_push: int = 1) -> list[str]:
    deltas = [detok.push(token_ids[i : i + per_push]) for i in range(0, len(token_ids), per_push)]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_join_to_decode_and_never_split_a_character(tokenizer, prompt_ids, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    # The texts really split characters across tokens, or the test would prove nothing.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids) or text.isascii()
    deltas = stream(IncrementalDetokenizer(tokenizer, prompt_ids), ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text


def test_several_tokens_per_push(tokenizer, prompt_ids):
    ids = tokenizer.encode(TEXTS[1], add_special_tokens=False)
    assert "".join(stream(IncrementalDetokenizer(tokenizer, prompt_ids), ids, per_push=3)) == TEXTS[1]


def test_first_token_keeps_its_leading_space(tokenizer):
    prompt = tokenizer.encode("Hello", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    assert detok.push(tokenizer.encode(" world", add_special_tokens=False)) == " world"


def test_special_tokens_are_skipped(tokenizer, prompt_ids):
    ids = tokenizer.encode("done", add_special_tokens=False) + [tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    assert "".join(stream(detok, ids)) == "done"
    kept = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=False)
    assert "".join(stream(kept, ids)) == "done<|im_end|>"


def _run_with_stop(tokenizer, prompt_ids, text: str, stop: tuple[str, ...]):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop=stop)
    emitted = ""
    for i in range(len(ids)):
        emitted += detok.push(ids[i : i + 1])
        # Never a character of a stop string on the way (checked after every token).
        assert not any(s in emitted for s in stop)
        if detok.stopped:
            break
    emitted += detok.flush()
    return detok, emitted


def test_stop_string_spanning_tokens_is_cut_and_never_emitted(tokenizer, prompt_ids):
    text = "The answer is 42. Then more text follows here."
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert "42. Then" not in [tokenizer.decode([i]) for i in ids]  # spans several tokens
    detok, emitted = _run_with_stop(tokenizer, prompt_ids, text, ("42. Then",))
    assert detok.stopped and detok.stop_string == "42. Then"
    assert emitted == "The answer is " == detok.text


def test_stop_string_inside_a_multibyte_run(tokenizer, prompt_ids):
    detok, emitted = _run_with_stop(tokenizer, prompt_ids, "Hello 🤗 世界 naïve café", ("世界",))
    assert detok.stopped and emitted == "Hello 🤗 "


def test_earliest_of_several_stop_strings_wins(tokenizer, prompt_ids):
    detok, emitted = _run_with_stop(tokenizer, prompt_ids, "alpha beta gamma delta", ("delta", "beta g"))
    assert detok.stopped and emitted == "alpha "


def test_a_stop_prefix_that_does_not_complete_is_released(tokenizer, prompt_ids):
    ids = tokenizer.encode("Hello world war", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop=("world peace",))
    deltas = [detok.push([i]) for i in ids]
    # " world" could begin "world peace": held back until " war" rules it out.
    assert deltas[0] == "Hello" and deltas[1] in ("", " ")
    assert "".join(deltas) + detok.flush() == "Hello world war"
    assert not detok.stopped


def test_held_back_prefix_is_flushed_at_finish(tokenizer, prompt_ids):
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop=("world!",))
    assert "".join(detok.push([i]) for i in ids) == "Hello "
    assert detok.flush() == "world" and not detok.stopped


def test_nothing_after_stop(tokenizer, prompt_ids):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop=("b",))
    assert detok.push(tokenizer.encode("a b", add_special_tokens=False)) == "a "
    assert detok.stopped
    assert detok.push(tokenizer.encode(" c", add_special_tokens=False)) == "" and detok.flush() == ""


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_byte_level_table_and_windows_give_decode_on_random_ids(tokenizer, prompt_ids, skip_special_tokens):
    # Random ids (byte tokens, specials, pieces of multi-byte characters, invalid UTF-8 included): the byte
    # table's text is decode()'s, and the window algorithm's too once flushed.
    import random

    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(0, 49152) if rng.random() < 0.6 else rng.randrange(0, 300)
               for _ in range(rng.randint(1, 10))]
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        for byte_level in (True, False):
            detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens,
                                           byte_level=byte_level)
            if byte_level:
                assert detok._table is not None  # SmolLM2's tokenizer is byte-level BPE
            deltas = stream(detok, ids, per_push=rng.randint(1, 3))
            assert "".join(deltas) == detok.text
            if byte_level or not any("\ufffd" in d for d in deltas):
                assert "".join(deltas) == expected, (ids, byte_level)


def test_window_algorithm_still_serves_the_stop_strings_tests(tokenizer, prompt_ids):
    text = "The answer is 42. Then more text follows here."
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop=("42. Then",), byte_level=False)
    emitted = "".join(detok.push([i]) for i in ids) + detok.flush()
    assert detok.stopped and emitted == "The answer is "
