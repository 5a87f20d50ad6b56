"""A model's own output formats, as text: reasoning parsers (thinking vs answer) and tool-call
parsers (a family's call syntax -> OpenAI tool calls), vLLM's names.

Text in, text out: nothing here knows the engine or the server, so both the server's chat
path and the offline `LLM.chat` use the same code (a layer below the engine).
"""


def by_name(registry: dict, flag: str, name: str):
    """A new parser of `registry` named `name`; an unknown name is refused (ValueError) with
    the flag that named it and the known names."""
    try:
        return registry[name]()
    except KeyError:
        raise ValueError(f"{flag} {name!r} is not known; the known parsers are "
                         f"{', '.join(sorted(registry))}") from None


def held_prefix(text: str, tags: tuple[str, ...]) -> int:
    """The length of the longest tail of `text` that is the start of one of `tags`: what a
    stream holds back until the next delta says whether a tag (or marker) begins there."""
    for keep in range(min(len(text), max(len(t) for t in tags) - 1), 0, -1):
        tail = text[-keep:]
        if any(t.startswith(tail) for t in tags):
            return keep
    return 0
