"""Grammars compiled with llguidance against the model's vocabulary, cached, with a time limit.

`GrammarCompiler.check(params)` compiles (or finds in the cache) a request's grammar and
raises ValueError naming the problem: an invalid schema, regex or grammar, or one that took
longer than `timeout_s` to compile. `matcher(params)` gives a fresh matcher (a copy of the
cached, compiled one) for one request. The cache is keyed by the grammar's text, so 64
requests with one schema compile it once.

NOTE: llguidance drops the GIL while it builds a matcher, so compiling on a worker thread
and waiting with a timeout keeps the caller's thread free and bounds its wait; a compile
that times out still runs to the end on its thread (llguidance's fuel limits bound it) and
its result is then cached as usual.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import threading

from jaxserve.structured.params import StructuredOutputsParams

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_CACHE_SIZE = 512


def _llguidance_grammar(kind: str, text: str) -> str:
    import llguidance

    base = kind.split(":")[0]
    if base in ("json", "json_object"):
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(
                text, defaults={"whitespace_flexible": kind.endswith(":flexible")})
        except ValueError as e:
            raise ValueError(f"structured_outputs.json is not a valid JSON schema: {e}") from None
    if base == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if base == "choice":
        # A Lark grammar of quoted alternatives (json.dumps quotes as Lark strings want).
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in json.loads(text)))
    try:   # Lark as is; GBNF (llama.cpp's) converted to Lark
        return llguidance.grammar_from("grammar", text)
    except ValueError as e:
        raise ValueError(f"structured_outputs.grammar could not be read: {e}") from None


class GrammarCompiler:
    """One per engine: the llguidance tokenizer, the compile cache and the mask executor."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids, *,
                 timeout_s: float = DEFAULT_TIMEOUT_S, cache_size: int = DEFAULT_CACHE_SIZE):
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        # Reentrant: a compile that is already done runs its done-callback (_store) at once,
        # in the thread that is adding it while holding the lock.
        self._lock = threading.RLock()
        self._ll_tokenizer = None
        self._executor = None
        self._cache: collections.OrderedDict[tuple, object] = collections.OrderedDict()
        self._compiling: dict[tuple, concurrent.futures.Future] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="jaxserve-grammar")
        self.compile_seconds: list[float] = []     # per compile (not cache hits), for benchmarks

    @property
    def ll_tokenizer(self):
        """llguidance's view of the vocabulary (built on first use: about 0.5 s)."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                # NOTE: the model's vocabulary may have padding rows past the tokenizer's
                # (never allowed) or, rarely, fewer rows (the extra tokens are cut from the mask)
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._hf, n_vocab=max(self.vocab_size, len(self._hf)),
                    eos_token=self.eos_token_ids or None)
            return self._ll_tokenizer

    @property
    def mask_words(self) -> int:
        """int32 words of one llguidance mask."""
        return -(-self.ll_tokenizer.vocab_size // 32)

    @property
    def executor(self):
        """The thread pool that fills many requests' masks in one call (llguidance's own)."""
        with self._lock:
            if self._executor is None:
                import llguidance

                self._executor = llguidance.LLExecutor()
            return self._executor

    def _compile(self, key: tuple):
        import time

        import llguidance

        t0 = time.perf_counter()
        grammar = _llguidance_grammar(*key)
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{key[0].split(':')[0]} is invalid: "
                             f"{matcher.get_error().strip()}")
        self.compile_seconds.append(time.perf_counter() - t0)
        return matcher

    def _compiled(self, params: StructuredOutputsParams):
        key = params.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                entry = self._cache[key]
                if isinstance(entry, ValueError):     # an invalid grammar is refused at once
                    raise ValueError(str(entry))
                return entry
            future = self._compiling.get(key)
            if future is None:
                future = self._compiling[key] = self._pool.submit(self._compile, key)
                future.add_done_callback(lambda f, key=key: self._store(key, f))
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise ValueError(f"structured_outputs.{params.kind} took longer than {self.timeout_s:g} s "
                             f"to compile; simplify the schema or grammar") from None

    def _store(self, key: tuple, future: concurrent.futures.Future) -> None:
        with self._lock:
            self._compiling.pop(key, None)
            error = future.exception()
            if error is None or isinstance(error, ValueError):   # a grammar's own error is kept too
                self._cache[key] = future.result() if error is None else error
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)

    def check(self, params: StructuredOutputsParams) -> None:
        """Compile (or find) the grammar; ValueError names what is wrong with it."""
        self._compiled(params)

    def matcher(self, params: StructuredOutputsParams, tokens=()):
        """A new matcher for one request, having consumed `tokens` (output so far)."""
        matcher = self._compiled(params).deep_copy()
        if tokens:
            matcher.consume_tokens(list(tokens))
        return matcher
