"""--expert-parallel-size reaches the engine; vLLM's --enable-expert-parallel is accepted where
it maps onto the expert x model mesh and otherwise refused with what to pass instead."""

from __future__ import annotations

import pytest

from jaxserve import cli
from jaxserve.engine.args import engine_kwargs
from jaxserve.engine.checks import StartupError


def _kwargs(*argv: str) -> dict:
    return engine_kwargs(cli.build_parser().parse_args(["serve", *argv]))


@pytest.mark.parametrize("flags,ep", [
    ((), 1),
    (("--expert-parallel-size", "4"), 4),
    (("--expert-parallel-size", "2", "--tensor-parallel-size", "2"), 2),
    (("--enable-expert-parallel",), 1),                                   # one TP rank: no change
    (("--enable-expert-parallel", "--expert-parallel-size", "2", "-tp", "2"), 2),
])
def test_expert_parallel_size_reaches_the_engine(flags, ep):
    assert _kwargs(*flags)["expert_parallel_size"] == ep


def test_enable_expert_parallel_over_tp_ranks_says_what_to_pass():
    with pytest.raises(StartupError, match="--expert-parallel-size 4 --tensor-parallel-size 1"):
        _kwargs("--enable-expert-parallel", "--tensor-parallel-size", "4")


def test_expert_parallel_size_below_one_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        _kwargs("--expert-parallel-size", "0")
    assert "--expert-parallel-size" in capsys.readouterr().err
