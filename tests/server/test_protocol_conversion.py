"""Engine outputs -> OpenAI shapes, without an engine: stream deltas, choice indexes, logprobs."""

from __future__ import annotations

import math

from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.server.errors import loc_to_param
from jaxserve.server.logprobs import CompletionLogprobs, chat_logprobs
from jaxserve.server.streaming import ChoiceCursor, StreamFormatter


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


def _out(texts: list[str], finished: bool = False, prompt_ids=(1, 2)) -> RequestOutput:
    outs = [CompletionOutput(i, t, list(range(len(t))), finish_reason="length" if finished else None)
            for i, t in enumerate(texts)]
    return RequestOutput("r", None, list(prompt_ids), outs, finished=finished)


def test_cursor_passes_delta_outputs_on_and_finishes_once():
    cursor = ChoiceCursor()
    deltas = [cursor.advance(_out([t], finished=f).outputs[0]) for t, f in
              (("He", False), ("llo", False), ("", False), ("!", True))]
    assert [d.text for d in deltas] == ["He", "llo", "", "!"]
    assert [d.first for d in deltas] == [True, False, False, False]
    assert [len(d.token_ids) for d in deltas] == [2, 3, 0, 1] and cursor.tokens_sent == 6
    assert [d.finish_reason for d in deltas] == [None, None, None, "length"]
    assert cursor.advance(_out([""], finished=True).outputs[0]) is None


class _TextStream(StreamFormatter):
    object_name = "test"

    def choice(self, index, prompt_index, out, c, delta):
        return {"index": index, "text": delta.text, "finish_reason": delta.finish_reason} if delta.text or \
            delta.finish_reason else None


def test_choice_index_is_prompt_index_times_n_plus_sample_index():
    fmt = _TextStream(request_id="r", model="m", created=0, n=2, include_usage=True)
    chunks = fmt.chunks([(0, _out(["a", "b"])), (1, _out(["c", ""]))])
    chunks += fmt.chunks([(0, _out(["b", ""], True)), (1, _out(["", ""], True))])
    assert [(c["choices"][0]["index"], c["choices"][0]["text"]) for c in chunks] == \
        [(0, "a"), (1, "b"), (2, "c"), (0, "b"), (1, ""), (2, ""), (3, "")]
    assert all(c["usage"] is None for c in chunks)
    # usage counts the completion tokens the stream carried: "a"+"b", "b", "c"
    (usage,) = fmt.end([_out(["", ""], True), _out(["", ""], True)])
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 4, "completion_tokens": 4,
                                                         "total_tokens": 8}


def test_completion_logprobs_shape_and_offsets_run_on():
    pos = [{5: Logprob(-0.5, 1, "A"), 6: Logprob(-1.5, 2, "B")},
           {7: Logprob(-math.inf, 3, "C"), 8: Logprob(-0.1, 1, "D")}]
    fmt = CompletionLogprobs(_Tok(), text_offset=10)
    first = fmt.format([5], pos[:1])
    second = fmt.format([7], pos[1:])
    assert first == {"tokens": ["A"], "token_logprobs": [-0.5], "top_logprobs": [{"A": -0.5, "B": -1.5}],
                     "text_offset": [10]}
    assert second["token_logprobs"] == [-9999.0] and second["text_offset"] == [11]   # -inf floored
    prompt = CompletionLogprobs(_Tok()).format([3, 4], [None, None])      # echoed prompt: no logprobs
    assert prompt == {"tokens": ["<3>", "<4>"], "token_logprobs": [None, None], "top_logprobs": [None, None],
                      "text_offset": [0, 3]}


def test_chat_logprobs_top_n_by_rank():
    pos = [{9: Logprob(-2.0, 3, "z"), 1: Logprob(-0.2, 1, "x"), 2: Logprob(-1.0, 2, "y")}]
    (entry,) = chat_logprobs(_Tok(), [9], pos, top_n=2)["content"]
    assert entry["token"] == "z" and entry["logprob"] == -2.0 and entry["bytes"] == [122]
    assert [t["token"] for t in entry["top_logprobs"]] == ["x", "y"]
    assert chat_logprobs(_Tok(), [9], pos, top_n=0)["content"][0]["top_logprobs"] == []


def test_validation_error_locations_read_as_params():
    assert loc_to_param(("messages", 0, "role")) == "messages[0].role"
    assert loc_to_param(("prompt", "list[int]", 0)) == "prompt[0]"
    assert loc_to_param(("messages", 1, "content", "str")) == "messages[1].content"
