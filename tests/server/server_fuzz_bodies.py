"""Hypothesis strategies for request bodies of /v1/completions and /v1/chat/completions.

Each body is either valid (every field in range) or wild (now and then a value out of range,
or any JSON at all), so that about half reach the engine. Generation is always kept tiny
(max_tokens 1-2, short prompts) so the fuzz run stays fast.
"""

from __future__ import annotations

from hypothesis import strategies as st

# 500 bodies in all; fewer chat ones, as the chat template makes their prompts longer.
NUM_COMPLETION_BODIES = 300
NUM_CHAT_BODIES = 200
VOCAB = 49152

any_json = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=5)


def sometimes_wrong(valid: st.SearchStrategy, *wrong) -> st.SearchStrategy:
    """A valid value in a valid body; in a wild body, now and then an out-of-range one or any JSON."""
    wrong_values = st.sampled_from(wrong) if wrong else st.nothing()
    return st.shared(st.booleans(), key="wild").flatmap(
        lambda wild: st.one_of(valid, wrong_values, any_json) if wild else valid)


short_text = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12) | st.sampled_from(
    ["Hello", "<|im_start|>", "<|endoftext|>", " ", "\n\n", "日本語", "🙂", "a b c"])
in_vocab = st.integers(0, VOCAB - 1)
token_ids = st.lists(in_vocab, min_size=1, max_size=6)
# Never a long generation: no valid count above 2, and no null (= the rest of the context).
tiny_max_tokens = sometimes_wrong(st.integers(1, 2), 0, -1, "1", 1.5).filter(
    lambda v: v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v > 2))

SAMPLING = dict(
    n=sometimes_wrong(st.integers(1, 2), 0, -1, 1000),
    temperature=sometimes_wrong(st.sampled_from([0, 0.0, 1e-300, 1e-8, 0.5, 1, 2.5, 1e300]), -1, -0.0),
    top_p=sometimes_wrong(st.floats(1e-6, 1), 0, -0.5, 1.5),
    top_k=sometimes_wrong(st.integers(-1, 60000) | st.just(2**40), -2),
    min_p=sometimes_wrong(st.floats(0, 1), -0.5, 1.5),
    presence_penalty=sometimes_wrong(st.floats(-2, 2), 3),
    frequency_penalty=sometimes_wrong(st.floats(-2, 2), -3),
    repetition_penalty=sometimes_wrong(st.floats(1e-3, 3), 0, -1),
    seed=sometimes_wrong(st.integers(0, 2**63 - 1), -1, 2**64),
    stop=sometimes_wrong(short_text | st.lists(short_text, max_size=3), "", [""]),
    stop_token_ids=sometimes_wrong(st.lists(in_vocab, max_size=3), [-1], [VOCAB]),
    ignore_eos=sometimes_wrong(st.booleans()),
    min_tokens=sometimes_wrong(st.integers(0, 2), -1, 3),
    skip_special_tokens=sometimes_wrong(st.booleans()),
    include_stop_str_in_output=sometimes_wrong(st.booleans()),
    logit_bias=sometimes_wrong(st.dictionaries(in_vocab.map(str), st.floats(-100, 100), max_size=3),
                               {"x": 1}, {"-1": 1}, {"5": 101}),
    allowed_token_ids=sometimes_wrong(token_ids, [], [VOCAB]),
    stream=sometimes_wrong(st.booleans()),
    stream_options=sometimes_wrong(st.fixed_dictionaries({"include_usage": st.booleans()})),
    echo=sometimes_wrong(st.booleans()),
    model=sometimes_wrong(st.just("SmolLM2-135M-Instruct"), "other"),
)
completion_bodies = st.fixed_dictionaries(
    {"max_tokens": tiny_max_tokens,
     "prompt": sometimes_wrong(short_text | st.lists(short_text, min_size=1, max_size=3) | token_ids
                               | st.lists(token_ids, min_size=1, max_size=2), "", [], [[]], [-1], [VOCAB])},
    optional={"logprobs": sometimes_wrong(st.integers(0, 5), -1, 6), **SAMPLING})
message = st.fixed_dictionaries(
    {"role": sometimes_wrong(st.sampled_from(["system", "user", "assistant", "developer"]), "tool", "wizard"),
     "content": sometimes_wrong(short_text | st.lists(
         st.fixed_dictionaries({"type": st.just("text"), "text": short_text}), max_size=2), None,
         [{"type": "image_url"}])},
    optional={"name": short_text})
chat_bodies = st.fixed_dictionaries(
    {"max_completion_tokens": tiny_max_tokens,
     "messages": sometimes_wrong(st.lists(message, min_size=1, max_size=3), [])},
    optional={"logprobs": sometimes_wrong(st.booleans()), "top_logprobs": sometimes_wrong(st.integers(0, 5), -1, 6),
              "add_generation_prompt": sometimes_wrong(st.booleans()),
              "continue_final_message": sometimes_wrong(st.booleans()), **SAMPLING})
