"""The offline API: `LLM(...).generate(prompts)` and `LLM(...).chat(messages)`, as in vLLM.

All prompts of a call go through the engine together (continuous batching); outputs come
back in input order.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from jaxserve.engine import LLMEngine, builder
from jaxserve.lora.request import LoRARequest
from jaxserve.outputs import RequestOutput
from jaxserve.parsers.reasoning import reasoning_parser as reasoning_parser_named
from jaxserve.sampling_params import SamplingParams

PromptType = str | dict[str, Any]


class LLM:
    """An engine for offline use.

    Args:
        model: a .gguf file, a HF model directory, or None for the embedded default model.
        dtype: "float32", "bfloat16" or "float16" (default: bfloat16 on GPU, float32 on CPU).
        **engine_args: engine options such as max_model_len, max_num_seqs,
            max_num_batched_tokens, block_size, num_kv_blocks, enable_prefix_caching, seed,
            load_format, tensor_parallel_size, max_logprobs, attention_impl, warmup,
            warmup_all (also wait for the logprobs/top-k/penalty programs at start-up),
            program_cache (keep compiled step programs on disk for the next start, on a GPU;
            off by default here: a program is keyed on jaxserve's source files, so code
            changed in memory, e.g. a notebook's patch, would not be seen),
            speculative_config (vLLM's dict: {"method": "ngram" | "draft_model" | "mtp" |
            "eagle3", "num_speculative_tokens": 1-8 (mtp, eagle3: 1),
            "prompt_lookup_min"/"prompt_lookup_max" (ngram), "model" (draft_model: a smaller
            model on the same vocabulary; eagle3: the HF head's directory)}; off by default),
            data_parallel_size (N whole engines on their own devices, requests routed by load:
            jaxserve/engine/data_parallel.py). Several hosts: jaxserve/distributed.py.
        reasoning_parser: vLLM's name of the model's thinking format (deepseek_r1, qwen3, ...:
            jaxserve/parsers/reasoning.py): `chat` outputs then carry `reasoning` and
            `content` beside `text`, and a grammar constrains only the answer.
        enable_lora, max_loras, max_lora_rank, max_cpu_loras: serve PEFT LoRA adapters
            beside the base model (jaxserve/lora/); generate(..., lora_request=LoRARequest(
            name, int_id, path)) picks one per call or per prompt.
    """

    def __init__(self, model: str | None = None, *, dtype: str | None = None,
                 reasoning_parser: str | None = None, **engine_args):
        self.reasoning = None if reasoning_parser is None else reasoning_parser_named(reasoning_parser)
        self.engine = builder.from_engine_args(model, dtype=dtype, **engine_args)
        self._ids = itertools.count()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        """Wrap an engine built elsewhere (e.g. sharing loaded weights between engines)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        llm.reasoning = None
        llm._ids = itertools.count()
        return llm

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_metrics(self) -> dict[str, float]:
        """Counters and gauges, named as the server's /metrics without the `jaxserve:` prefix."""
        return self.engine.get_metrics()

    def _to_token_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.engine.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass {'prompt_token_ids': [...]}")
            return prompt, self.engine.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" in prompt:
                return self._to_token_ids(prompt["prompt"])
        raise ValueError("each prompt must be a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}; "
                         f"got {type(prompt).__name__}")

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params must be one SamplingParams or one per prompt "
                             f"({len(prompts)}); got {len(sampling_params)}")
        # Only finished outputs are returned, so the engine need not build the others.
        final = {id(p): p.clone(output_kind="final_only") for p in sampling_params}
        sampling_params = [final[id(p)] for p in sampling_params]
        loras = (list(lora_request) if isinstance(lora_request, (list, tuple))
                 else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request must be one LoRARequest or one per prompt "
                             f"({len(prompts)}); got {len(loras)}")
        encoded = [self._to_token_ids(p) for p in prompts]
        for (text, ids), params in zip(encoded, sampling_params):
            self.engine.validate_request(ids, params)   # fail before anything is queued
        ids_in_order = []
        for (text, ids), params, lora in zip(encoded, sampling_params, loras):
            rid = str(next(self._ids))
            self.engine.add_request(rid, ids, params, prompt=text, lora_request=lora)
            ids_in_order.append(rid)
        return self._run(ids_in_order, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate.
        `chat_template_kwargs` reach the template (`{"enable_thinking": False}`, ...). With the
        LLM's reasoning parser each output's `reasoning` and `content` are set."""
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        kwargs = dict(chat_template_kwargs or {})
        prompts = []
        for conv in conversations:
            text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                           chat_template=chat_template, **kwargs)
            # The template already carries special tokens such as BOS.
            prompts.append({"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        params = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if self.reasoning is not None and len(params) == len(prompts):   # (else generate refuses it)
            encode = lambda t: tok.encode(t, add_special_tokens=False)   # noqa: E731
            keep_special = self.reasoning.needs_special_tokens(tok.is_special_token)
            sampling_params = [self._reasoning_params(p or SamplingParams(), encode, prompt["prompt"], kwargs,
                                                      keep_special) for p, prompt in zip(params, prompts)]
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        if self.reasoning is not None:
            for prompt, out in zip(prompts, outputs):
                for c in out.outputs:
                    c.reasoning, c.content = self.reasoning.split(c.text, prompt["prompt"], kwargs)
        return outputs

    def _reasoning_params(self, params: SamplingParams, encode, prompt: str, kwargs: dict,
                          keep_special: bool) -> SamplingParams:
        """A chat request's params under the reasoning parser: its grammar after the thinking,
        special tokens kept when the tags are special (the split reads them as text)."""
        if params.structured_outputs is not None:
            params = params.clone(structured_outputs=self.reasoning.grammar_after_thinking(
                params.structured_outputs, encode, prompt, kwargs))
        return params.clone(skip_special_tokens=False) if keep_special else params

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            try:                      # a notebook bar needs ipywidgets; without it, a plain bar
                import ipywidgets  # noqa: F401
                from tqdm.auto import tqdm
            except ImportError:
                from tqdm import tqdm
            bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in request_ids:       # leave nothing behind on Ctrl-C or an error
                self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[rid] for rid in request_ids]
