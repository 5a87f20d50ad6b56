"""Structured output in the engine (jaxserve/structured/): grammars, matchers and masks.

On the tiny random-weight Llama checkpoint with a 256-token byte-level tokenizer made here
(the checkpoint has none): random weights sample anything, so every output's shape comes
from the grammar alone. Through the server and the default model:
tests/server/server_structured_tests.py.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.sample.sampler import processed_logits
from jaxserve.sample.tensors import make_sampling_tensors, mask_width
from jaxserve.structured import StructuredOutputsParams as SO
from jaxserve.structured import masks
from jaxserve.structured.compiler import GrammarCompiler

CKPT = os.path.join(os.path.dirname(__file__), "golden", "ckpt", "llama")
SCHEMA = {"type": "object", "properties": {"ab": {"enum": ["a", "b"]}, "n": {"type": "integer", "minimum": 0,
                                                                               "maximum": 99}},
          "required": ["ab", "n"], "additionalProperties": False}


def tiny_tokenizer():
    """Byte-level BPE over printable ASCII plus some pairs: exactly the checkpoint's 256 ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>"]
    byte_level = lambda s: s.replace(" ", "\u0120")   # GPT-2's alphabet writes a space as Ġ
    vocab = {t: i for i, t in enumerate(specials + [byte_level(chr(c)) for c in range(32, 127)])}
    merges = []
    for a, b in itertools.product('"{}:,ab0123 ', 'abcdefghijklmnop"0123456789:,} '):
        if len(vocab) == 256:
            break
        if byte_level(a + b) not in vocab:
            vocab[byte_level(a + b)] = len(vocab)
            merges.append((byte_level(a), byte_level(b)))
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(s, special=True) for s in specials])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    """The tiny checkpoint with tokenizer files beside it."""
    path = tmp_path_factory.mktemp("tiny_with_tokenizer")
    for name in os.listdir(CKPT):
        shutil.copy(os.path.join(CKPT, name), path / name)
    tiny_tokenizer().save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def llm(ckpt_dir):
    return LLM(ckpt_dir, dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
               warmup=False)


def _matches(so: SO, text: str) -> bool:
    if so.regex is not None:
        return re.fullmatch(so.regex, text) is not None
    if so.choice is not None:
        return text in so.choice
    value = json.loads(text)
    return set(value) == {"ab", "n"} and value["ab"] in "ab" and 0 <= value["n"] <= 99


CASES = [SO(regex=r"[ab]{2,5}-\d"), SO(choice=["yes", "no", "maybe"]), SO(json=SCHEMA),
         SO(json=json.dumps(SCHEMA)), SO(grammar='start: "x" ("," "y")*')]


# ---- parameters ----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,text", [
    ({}, "exactly one"), ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"choice": "ab"}, "choice must be a list"), ({"choice": []}, "non-empty list"),
    ({"json": "{not json"}, "not JSON"), ({"json": "[1]"}, "a JSON schema"), ({"regex": ""}, "non-empty"),
])
def test_invalid_params_name_the_field(kwargs, text):
    with pytest.raises(ValueError, match=text):
        SO(**kwargs)


def test_sampling_params_take_a_dict_and_name_unknown_fields():
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs == SO(regex="a+")
    with pytest.raises(ValueError, match="no field 'jsn'"):
        SamplingParams(structured_outputs={"jsn": {}})


@pytest.mark.parametrize("so,text", [
    (SO(regex="a[b"), "structured_outputs.regex is invalid"),
    (SO(json={"type": "objekt"}), "structured_outputs.json is invalid"),
    (SO(grammar="start: undefined_rule"), "structured_outputs.grammar is invalid"),
])
def test_an_invalid_grammar_is_a_value_error_and_disturbs_nothing(llm, so, text):
    with pytest.raises(ValueError, match=text):
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=so), use_tqdm=False)
    out = llm.generate(["x"], SamplingParams(temperature=0, max_tokens=8, structured_outputs=CASES[0]),
                       use_tqdm=False)[0].outputs[0]
    assert _matches(CASES[0], out.text)


# ---- compiling -----------------------------------------------------------------------------

def test_compiles_are_cached_by_grammar_text():
    grammars = GrammarCompiler(tiny_tokenizer(), 256, [2])
    for _ in range(3):
        grammars.check(SO(json=SCHEMA))
        grammars.check(SO(json=json.dumps(SCHEMA)))   # the same text: the same entry
    grammars.check(SO(regex="a+"))
    assert len(grammars.compile_seconds) == 2
    for _ in range(2):              # an invalid one is remembered as invalid
        with pytest.raises(ValueError, match="structured_outputs.regex is invalid"):
            grammars.check(SO(regex="a[b"))
    assert len(grammars._cache) == 3


def test_every_eos_id_of_the_model_is_the_grammars_end():
    # Llama-3 instruct ends on any of three ids (llguidance before 1.9 took only one)
    grammars = GrammarCompiler(tiny_tokenizer(), 256, [2, 3])
    assert list(grammars.ll_tokenizer.eos_tokens) == [2, 3]


def test_a_compile_past_the_time_limit_is_a_value_error(monkeypatch):
    import threading

    release = threading.Event()
    grammars = GrammarCompiler(tiny_tokenizer(), 256, [2], timeout_s=0.05)
    slow = grammars._compile
    monkeypatch.setattr(grammars, "_compile", lambda key: (release.wait(), slow(key))[1])
    with pytest.raises(ValueError, match="structured_outputs.regex took longer than 0.05 s"):
        grammars.check(SO(regex="a+"))
    release.set()
    grammars._pool.shutdown(wait=True)        # the compile ends and its result is cached
    grammars.timeout_s = 0
    grammars.check(SO(regex="a+"))


# ---- masks ---------------------------------------------------------------------------------

def test_filled_masks_equal_each_matchers_own_and_and_with_the_row_mask():
    grammars = GrammarCompiler(tiny_tokenizer(), 256, [2])
    m1, m2 = grammars.matcher(SO(json=SCHEMA)), grammars.matcher(SO(regex="[ab]+"), tokens=[68])  # "a"
    S, V = 4, 256
    allowed = np.full((S, mask_width(V)), 0xFF, np.uint8)
    allowed[3, 1] = 0                                   # a row's own ban (tokens 8-15) stays
    masks.fill_masks(grammars.executor, allowed, [(1, m1), (3, m2)])
    ok = np.unpackbits(allowed, axis=-1, count=V, bitorder="little").astype(bool)
    for row, m in ((1, m1), (3, m2)):
        own = np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8), count=V, bitorder="little")
        expected = own.astype(bool)
        if row == 3:
            expected[8:16] = False
        np.testing.assert_array_equal(ok[row], expected)
    assert ok[0].all() and ok[2].all()
    assert ok[3, 2] and ok[3, 68]           # "a" consumed: more a/b, or EOS (2): the grammar accepts
    assert not ok[1, 2]                     # the schema's object has not started: no EOS


def test_the_device_applies_the_mask_before_sampling():
    S, V = 2, 256
    t = make_sampling_tensors([], S, V, 64, with_extras=False, with_mask=True)
    assert t.allowed_mask.shape == (S, mask_width(V)) and t.token_history.shape == (S, 0)
    t.allowed_mask[0] = np.packbits(np.arange(V) == 7, bitorder="little")
    logits = np.random.default_rng(0).normal(size=(S, V)).astype(np.float32)
    x = np.asarray(jax.jit(processed_logits)(logits, t))
    assert np.isfinite(x[0]).sum() == 1 and np.isfinite(x[0, 7])
    np.testing.assert_array_equal(x[1], logits[1])


# ---- generation ----------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_outputs_match_and_a_batch_equals_each_request_alone(llm, temperature):
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=40, structured_outputs=so)
              for i, so in enumerate(CASES)]
    prompts = ["ab", "cd", "ef", "gh", "ij"]
    batch = llm.generate(prompts, params, use_tqdm=False)
    for so, out, prompt, p in zip(CASES, batch, prompts, params):
        c = out.outputs[0]
        assert _matches(so, c.text) if so.grammar is None else re.fullmatch(r"x(,y)*", c.text), c.text
        assert c.finish_reason == "stop"
        alone = llm.generate([prompt], p, use_tqdm=False)[0].outputs[0]
        assert alone.token_ids == c.token_ids


def test_max_tokens_still_ends_a_constrained_request(llm):
    out = llm.generate(["q"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=False,
                                             structured_outputs=SO(regex="[ab]{10,}")), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 5 and re.fullmatch("[ab]+", c.text)


def test_constrained_and_plain_requests_share_a_batch_and_free_their_matchers(llm, monkeypatch):
    plain = SamplingParams(temperature=0, max_tokens=6)
    alone = llm.generate(["plain"], plain, use_tqdm=False)[0].outputs[0].token_ids
    waits = []                  # the pipeline stays on: masks wait for the in-flight step's ids
    structured = llm.engine.core.structured
    monkeypatch.setattr(structured, "last_sampled", lambda real=structured.last_sampled: waits.append(1) or real())
    outs = llm.generate(["plain", "q"], [plain, SamplingParams(temperature=0, max_tokens=20,
                                                               structured_outputs=CASES[1])],
                        use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone and outs[1].outputs[0].text in CASES[1].choice
    assert waits
    assert not llm.engine.scheduler.requests
    # The runner drops finished requests (and their matchers) with the next step it runs.
    ended = set(llm.engine.runner.batch.requests)
    llm.generate(["next"], plain, use_tqdm=False)
    assert not ended & set(llm.engine.runner.batch.requests)


def test_a_resumed_request_replays_its_tokens_into_a_new_matcher():
    from jaxserve.core.step_messages import NewRequestData

    grammars = GrammarCompiler(tiny_tokenizer(), 256, [2])
    so = SO(choice=["ab", "ba"])
    ids = tiny_tokenizer().encode("b")
    new = NewRequestData("r", [5], ids, SamplingParams(structured_outputs=so), 0, (2,))
    grammar = masks.RequestGrammar.for_request(grammars, new)
    assert grammar.consumed == 1
    allowed = np.full((1, 32), 0xFF, np.uint8)
    masks.fill_masks(grammars.executor, allowed, [(0, grammar.matcher)])
    ok = np.unpackbits(allowed[0], count=256, bitorder="little").nonzero()[0]
    assert [tiny_tokenizer().decode([int(t)]) for t in ok] == ["a"]
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        masks.RequestGrammar.for_request(None, new)


def test_a_pending_token_is_consumed_once_however_often_the_step_is_built():
    """The last step's token is fed to the matcher when the next step's mask is filled (it is
    still on the device then), and not again when the runner reads it back."""
    grammars = GrammarCompiler(tiny_tokenizer(), 256, [2])
    grammar = masks.RequestGrammar(grammars.matcher(SO(choice=["abab"])))
    a, b = tiny_tokenizer().encode("a")[0], tiny_tokenizer().encode("b")[0]
    output = [a]
    grammar.catch_up(output, pending=b)          # "a" read back, "b" still on the device
    grammar.catch_up(output, pending=b)          # the step built again (a failed dispatch)
    output.append(b)                             # the runner reads "b" back
    grammar.catch_up(output)
    assert grammar.consumed == 2 and not grammar.matcher.is_error()
    assert grammar.matcher.consume_tokens([a, b]) and grammar.matcher.is_accepting()


def test_no_compilation_after_warmup_with_constrained_requests(ckpt_dir):
    llm = LLM(ckpt_dir, dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
    llm.engine.runner.wait_for_warmup()
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(event)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    params = [SamplingParams(temperature=0, max_tokens=12, structured_outputs=so) for so in CASES[:3]]
    outs = llm.generate(["a", "bb", "ccc"], params + [], use_tqdm=False)
    assert all(_matches(so, o.outputs[0].text) for so, o in zip(CASES, outs))
    assert compiles == []


def test_preempted_constrained_requests_resume_where_they_were(ckpt_dir, llm):
    small = LLM(ckpt_dir, dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
                num_kv_blocks=8, block_size=4, warmup=False)
    so = SO(regex="[ab]{12,20}")
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=20, structured_outputs=so) for i in range(6)]
    prompts = [f"p{i}" for i in range(6)]
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.get_metrics()["num_preemptions_total"] > 0
    for prompt, p, out in zip(prompts, params, outs):
        assert re.fullmatch("[ab]{12,20}", out.outputs[0].text)
        assert out.outputs[0].token_ids == llm.generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids
