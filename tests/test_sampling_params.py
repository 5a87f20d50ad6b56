"""SamplingParams: vLLM defaults and normalization; invalid values name the field and range."""

import pytest

from jaxserve.sampling_params import MAX_LOGIT_BIAS_ENTRIES, SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids) == (16, 0, [], [])
    assert p.logprobs is None and p.prompt_logprobs is None and p.seed is None
    assert not p.include_stop_str_in_output and not p.ignore_eos and p.skip_special_tokens
    assert not p.greedy and not p.uses_penalties


def test_normalization():
    p = SamplingParams(stop="###", top_k=-1, logit_bias={"42": -100, 7: 2.5}, temperature=0)
    assert p.stop == ["###"] and p.top_k == 0 and p.greedy
    assert p.logit_bias == {42: -100, 7: 2.5}
    assert SamplingParams(repetition_penalty=1.2).uses_penalties


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("nan")),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("top_k", 2.5),
    ("min_p", -0.1), ("min_p", 1.1), ("n", 0),
    ("max_tokens", 0), ("min_tokens", -1), ("repetition_penalty", 0.0),
    ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
    ("logprobs", -1), ("prompt_logprobs", -1), ("seed", 1.5),
    ("stop", ["ok", ""]), ("stop_token_ids", [-1]),
    ("logit_bias", {5: 101.0}), ("logit_bias", {-3: 1.0}), ("logit_bias", {"x": 1.0}),
    ("allowed_token_ids", []), ("allowed_token_ids", [3, -1]),
])
def test_invalid_value_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(4\)"):
        SamplingParams(min_tokens=5, max_tokens=4)


def test_too_many_logit_bias_entries():
    with pytest.raises(ValueError, match=f"logit_bias must be at most {MAX_LOGIT_BIAS_ENTRIES}"):
        SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)})


def test_engine_limits():
    SamplingParams(logprobs=20, prompt_logprobs=20).validate(max_logprobs=20, vocab_size=100)
    with pytest.raises(ValueError, match=r"logprobs must be an integer in \[0, 20\]"):
        SamplingParams(logprobs=21).validate(max_logprobs=20)
    with pytest.raises(ValueError, match=r"prompt_logprobs must be an integer in \[0, 5\]"):
        SamplingParams(prompt_logprobs=6).validate(max_logprobs=5)
    for field, value in [("logit_bias", {100: 1.0}), ("allowed_token_ids", [99, 100]),
                         ("stop_token_ids", [100])]:
        p = SamplingParams(**{field: value})   # fine without a vocabulary to check against
        with pytest.raises(ValueError, match=rf"{field} must be token ids in \[0, 99\]"):
            p.validate(vocab_size=100)
