"""Input processing: validate a request once and turn it into frozen `EngineRequest`s.

A request with n > 1 becomes n child requests sharing the prompt (the prefix cache shares its
full blocks); output processing reports them as one RequestOutput with n CompletionOutputs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from jaxserve.config import EngineConfig
from jaxserve.lora.request import LoRARequest
from jaxserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineRequest:
    """One sequence to generate, as the engine core receives it."""
    request_id: str                 # the child's id: the user's id, or "id#i" when n > 1
    parent_id: str                  # the user's request id
    index: int                      # which of the parent's n samples
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    seed: int
    arrival_time: float
    lora_request: LoRARequest | None = None   # its adapter (None: the base model)


class InputProcessor:
    def __init__(self, config: EngineConfig, eos_token_ids: tuple[int, ...], num_blocks: int,
                 grammars=None):
        self.config = config
        self.grammars = grammars     # structured.compiler.GrammarCompiler; None: no tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.num_blocks = num_blocks
        self._rng = random.Random(config.seed)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (naming the field and the limit) for a request that cannot run."""
        limit = self.config.scheduler.max_model_len
        vocab = self.config.model.vocab_size
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab - 1}]")
        if len(prompt_token_ids) >= limit:
            raise ValueError(f"prompt is {len(prompt_token_ids)} tokens; this model's max_model_len is "
                             f"{limit}, so the prompt must be at most {limit - 1} tokens")
        params.validate(max_logprobs=self.config.max_logprobs, vocab_size=vocab)
        if params.max_tokens is not None and len(prompt_token_ids) + params.max_tokens > limit:
            raise ValueError(f"max_tokens is {params.max_tokens} but the prompt is {len(prompt_token_ids)} "
                             f"tokens and max_model_len is {limit}: max_tokens must be at most "
                             f"{limit - len(prompt_token_ids)}")
        longest = min(limit, len(prompt_token_ids) + (params.max_tokens or limit))
        blocks = -(-longest // self.config.cache.block_size)
        if blocks > self.num_blocks - 1:
            raise ValueError(f"the request needs up to {blocks} KV blocks but the cache holds "
                             f"{self.num_blocks - 1}; lower max_tokens or raise num_kv_blocks")
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise ValueError("structured_outputs needs the model's tokenizer; this model has none")
            self.grammars.check(params.structured_outputs)   # ValueError: invalid or too slow

    def process(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                arrival_time: float, lora_request: LoRARequest | None = None) -> list[EngineRequest]:
        """The validated request's child requests (one unless n > 1)."""
        self.validate(prompt_token_ids, params)
        if lora_request is not None and self.config.lora is None:
            raise ValueError(f"lora_request {lora_request.lora_name!r}: this engine serves no "
                             "adapters; start it with enable_lora=True (--enable-lora)")
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(31)
        ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        prompt = tuple(prompt_token_ids)
        return [EngineRequest(child, request_id, i, prompt, params, self.eos_token_ids,
                              base_seed + i, arrival_time, lora_request) for i, child in enumerate(ids)]
