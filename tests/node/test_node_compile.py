"""swarm-node --compile: the model is compiled in place, so the state's and DiLoCo's parameter
names stay those of the eager model (a wrapper would prefix them with `_orig_mod.`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from swarm.model.presets import preset
from swarm.node import model_setup
from swarm.node.config import NodeConfig

# The tiny model with one layer: parameter names and the eager fall back do not depend on depth,
# and dynamo has one layer to trace instead of six.
ONE_LAYER = preset("tiny", n_layers=1)


@pytest.fixture(autouse=True)
def dynamo_config_restored() -> Iterator[None]:
    """_build --compile sets torch._dynamo's suppress_errors for the process: not for later tests."""
    from torch._dynamo import config

    before = config.suppress_errors
    yield
    config.suppress_errors = before


def test_compile_compiles_the_model_in_place_and_keeps_its_parameter_names() -> None:
    eager = model_setup.build_node_model(NodeConfig(device="cpu"), ONE_LAYER)
    compiled = model_setup.build_node_model(NodeConfig(device="cpu", compile=True), ONE_LAYER)
    assert eager._compiled_call_impl is None and compiled._compiled_call_impl is not None
    assert [name for name, _ in compiled.named_parameters()] == [name for name, _ in eager.named_parameters()]
    assert list(compiled.state_dict()) == list(eager.state_dict())


def test_a_compile_that_fails_runs_the_model_eager_instead_of_ending_the_node(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._inductor.compile_fx as inductor

    def no_compiler(*args: object, **kwargs: object) -> object:
        raise RuntimeError("no C compiler here")

    monkeypatch.setattr(inductor, "compile_fx", no_compiler)
    eager = model_setup.build_node_model(NodeConfig(device="cpu"), ONE_LAYER)
    compiled = model_setup.build_node_model(NodeConfig(device="cpu", compile=True), ONE_LAYER)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(compiled(tokens), eager(tokens))
