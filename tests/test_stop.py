"""Stop strings: matches across token boundaries, cut position, streaming hold-back."""

from jaxserve.engine.stop import StopStrings


def feed(stops: StopStrings, pieces: list[str]):
    """Grow the text piece by piece (as tokens detokenize) until a stop matches."""
    text = ""
    for piece in pieces:
        text += piece
        match = stops.find(text, len(piece))
        if match:
            return match
    return None


def test_stop_spanning_several_tokens_is_cut():
    stops = StopStrings.of(["</answer>"])
    match = feed(stops, ["The", " result", " is 4", "</", "ans", "wer", ">", " trailing"])
    assert match.text == "The result is 4" and match.stop == "</answer>"
    included = feed(StopStrings.of(["</answer>"], include_in_output=True),
                    ["4", "</", "ans", "wer>", " more"])
    assert included.text == "4</answer>"


def test_text_after_the_stop_in_the_same_token_is_dropped():
    assert feed(StopStrings.of(["\n\n"]), ["a", "b\n", "\nc d"]).text == "ab"


def test_earliest_stop_wins_and_ties_go_to_the_first_listed():
    stops = StopStrings.of(["world", "lo w"])
    assert feed(stops, ["hel", "lo world"]).stop == "lo w"
    tie = StopStrings.of(["ab", "abc"], include_in_output=True)
    assert tie.find("xxabc").text == "xxab"
    assert StopStrings.of(["abc", "ab"], include_in_output=True).find("xxabc").text == "xxabc"


def test_no_match_and_old_text_not_rescanned():
    stops = StopStrings.of(["STOP"])
    assert feed(stops, ["no", " stop", " here"]) is None
    # Only the last 3 characters are new: a stop wholly inside the old text is not re-found.
    assert stops.find("STOP and more", 3) is None
    assert stops.find("xxSTO" + "P", 1).text == "xx"


def test_held_back_for_streaming():
    stops = StopStrings.of(["</answer>", "###"])
    assert stops.held_back("result </ans") == 5
    assert stops.held_back("result ##") == 2
    assert stops.held_back("result #") == 1
    assert stops.held_back("result") == 0
    assert stops.held_back("") == 0
    assert StopStrings.of(["</answer>"], include_in_output=True).held_back("x </ans") == 0
