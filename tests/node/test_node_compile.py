"""swarm-node --compile: the model is compiled in place, so the state's and DiLoCo's parameter
names stay those of the eager model (a wrapper would prefix them with `_orig_mod.`)."""

from __future__ import annotations

from swarm import node
from swarm.model.presets import preset
from swarm.node_config import NodeConfig


def test_compile_compiles_the_model_in_place_and_keeps_its_parameter_names() -> None:
    eager = node._build(NodeConfig(device="cpu"), preset("tiny"))
    compiled = node._build(NodeConfig(device="cpu", compile=True), preset("tiny"))
    assert eager._compiled_call_impl is None and compiled._compiled_call_impl is not None
    assert [name for name, _ in compiled.named_parameters()] == [name for name, _ in eager.named_parameters()]
    assert list(compiled.state_dict()) == list(eager.state_dict())
