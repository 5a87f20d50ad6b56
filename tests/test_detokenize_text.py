"""A request's text is its tokens' text (issue 70): for non-ASCII output (CJK, emoji whose
UTF-8 bytes span tokens) the text equals `tokenizer.decode` of the output ids, whole and as
concatenated deltas (a stream), one token a step or several (speculation, multi-step decode),
with stop strings cut where they match; a SentencePiece-style (Metaspace) tokenizer keeps the
first output token's leading space. Tiny tokenizers are built here with the `tokenizers`
library (nothing downloaded); the output processor is driven with the steps' updates."""

from __future__ import annotations

import time

import pytest

from jaxserve import SamplingParams
from jaxserve.core.request import RequestStatus
from jaxserve.core.scheduler import RequestUpdate
from jaxserve.core.step_messages import RunnerOutput
from jaxserve.engine.input_processor import EngineRequest
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.metrics import EngineMetrics
from jaxserve.tokenizer import Tokenizer

TEXT = "你好，世界！日本語のテキスト 😀🎉 naïve café ☕ 한국어 👩‍💻"


def byte_level_tokenizer() -> Tokenizer:
    """Byte-level BPE trained on a little multilingual text: characters of 2-4 UTF-8 bytes
    whose bytes are split over several tokens (and tokens holding parts of two characters)."""
    from tokenizers import Tokenizer as Tk, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tk(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(["你好 世界 你好世界 日本語 テキスト 😀 😀🎉 café naïve"] * 20, trainer)
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>",
                                             clean_up_tokenization_spaces=False))


def metaspace_tokenizer() -> Tokenizer:
    """SentencePiece-style: words carry a leading '▁' (a space), which the decoder turns back
    into a space, except at the start of what it decodes."""
    from tokenizers import Tokenizer as Tk, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "</s>", "▁Say", "▁Hello", "▁world", "!", "▁", "H", "e", "l", "o", "w", "r", "d", "S",
              "a", "y"]
    tk = Tk(models.Unigram([(p, -1.0 if len(p) > 1 else -5.0) for p in pieces], unk_id=0))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tk.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>", unk_token="<unk>",
                                             clean_up_tokenization_spaces=False))


def run(tok: Tokenizer, prompt: list[int], output: list[int], params: SamplingParams, per_step: int = 1):
    """Feed `output` to an OutputProcessor `per_step` tokens a step, as the scheduler would
    (the last step finishing it: length). Returns (the outputs it produced, the last one)."""
    proc = OutputProcessor(tok, EngineMetrics())
    proc.add([EngineRequest("r", "r", 0, tuple(prompt), params, (), 0, time.monotonic())], None)
    outs = []
    for i in range(0, len(output), per_step):
        if proc.samples.get("r") is None or "r" in proc.ended:
            break
        ids = output[i:i + per_step]
        last = i + per_step >= len(output)
        up = RequestUpdate("r", ids, RequestStatus.FINISHED_LENGTH if last else None, None, 0)
        outs += proc.process([up], RunnerOutput(["r"], [ids], [None]))
    return outs


def split_chars(tok: Tokenizer, ids: list[int]) -> int:
    """How many of `ids` decode alone to an incomplete character (U+FFFD)."""
    return sum("\ufffd" in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("per_step", [1, 3, 4])
def test_non_ascii_text_equals_decode_of_its_ids(per_step):
    tok = byte_level_tokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert tok.decode(ids) == TEXT and split_chars(tok, ids) >= 6      # bytes span tokens
    prompt = tok.encode("Q: ", add_special_tokens=False)
    whole = run(tok, prompt, ids, SamplingParams(max_tokens=len(ids)), per_step)[-1].outputs[0]
    assert whole.text == tok.decode(whole.token_ids) == TEXT
    deltas = run(tok, prompt, ids, SamplingParams(max_tokens=len(ids), output_kind="delta"), per_step)
    assert "".join(o.outputs[0].text for o in deltas) == TEXT
    assert all("\ufffd" not in o.outputs[0].text for o in deltas)
    assert [t for o in deltas for t in o.outputs[0].token_ids] == ids


@pytest.mark.parametrize("per_step", [1, 4])
@pytest.mark.parametrize("stop", ["世界", "😀", "☕ 한"])
def test_non_ascii_stop_strings_cut_the_text_at_the_match(stop, per_step):
    tok = byte_level_tokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)
    want = TEXT[:TEXT.index(stop)]
    for kind in ("cumulative", "delta"):
        params = SamplingParams(max_tokens=len(ids), stop=[stop], output_kind=kind)
        outs = run(tok, [], ids, params, per_step)
        text = "".join(o.outputs[0].text for o in outs) if kind == "delta" else outs[-1].outputs[0].text
        token_ids = [t for o in outs for t in o.outputs[0].token_ids] if kind == "delta" else \
            outs[-1].outputs[0].token_ids
        assert text == want, kind
        assert (outs[-1].outputs[0].finish_reason, outs[-1].outputs[0].stop_reason) == ("stop", stop)
        # the ids end at the token that completes the stop; their text is the output's plus it
        assert stop in tok.decode(token_ids) and stop not in tok.decode(token_ids[:-1]), kind
        assert tok.decode(token_ids).startswith(want)


def test_metaspace_first_output_token_keeps_its_leading_space():
    tok = metaspace_tokenizer()
    prompt = tok.encode("Say", add_special_tokens=False)
    output = tok.encode("Hello world!", add_special_tokens=False)
    assert tok.decode(output) == "Hello world!"           # alone, the decoder drops the space
    want = tok.decode(prompt + output)[len(tok.decode(prompt)):]
    assert want == " Hello world!"
    for kind in ("cumulative", "delta"):
        outs = run(tok, prompt, output, SamplingParams(max_tokens=3, output_kind=kind))
        text = "".join(o.outputs[0].text for o in outs) if kind == "delta" else outs[-1].outputs[0].text
        assert text == want, kind
