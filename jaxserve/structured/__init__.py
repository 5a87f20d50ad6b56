"""Structured output: grammars (JSON schema, regex, choice, Lark/GBNF) compiled by llguidance,
a matcher per request and the allowed-token mask each step (see the modules)."""

from jaxserve.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
