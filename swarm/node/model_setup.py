"""What a node trains: its data, its model (compiled or not), its error feedback, DiLoCo around it.

Each turns a setting that does not fit into NodeError (one line, no traceback) rather than a
crash deep inside torch.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from swarm.model.configs import ModelConfig
from swarm.model.data import TokenData, load_data
from swarm.model.diloco import DiLoCo
from swarm.model.error_feedback import ErrorFeedback
from swarm.model.llama import build_model, count_parameters
from swarm.node.config import NodeConfig
from swarm.node.errors import NodeError

logger = logging.getLogger(__name__)

__all__ = ["build_node_model", "load_node_data", "node_diloco", "node_error_feedback"]


def load_node_data(config: NodeConfig) -> TokenData:
    try:
        return load_data(config.data, tokenizer=config.tokenizer)
    except ValueError as e:
        raise NodeError(str(e)) from None


def build_node_model(config: NodeConfig, model_config: ModelConfig) -> nn.Module:
    device = config.torch_device()
    if device.type == "cuda" and not torch.cuda.is_available():
        raise NodeError(f"--device {config.device}: no CUDA device here")
    logger.info("model %s: %d parameters on %s", config.model, count_parameters(model_config), device)
    model = build_model(model_config, config.seed, device=device)
    if config.compile:
        from torch._dynamo import config as dynamo_config

        # a compile that fails (no C compiler, an op inductor cannot lower) runs that code eager,
        # with torch's warning, rather than ending the node mid-run
        dynamo_config.suppress_errors = True
        model.compile()  # in place: the parameters keep their names (the state, DiLoCo's groups)
    return model


def node_error_feedback(config: NodeConfig, codec: str, block_size: int) -> ErrorFeedback | None:
    """--error-feedback: the codec's residual, kept by this node alone; None without a lossy codec."""
    if config.error_feedback > 0 and codec != "none":
        return ErrorFeedback(codec, block_size, config.error_feedback)
    return None


def node_diloco(model: Any, config: NodeConfig, inner_optimizer: Any) -> DiLoCo:
    """DiLoCo around the model; NodeError (one line, no traceback) when the config does not fit
    it (more --fragments than the model has parameter tensors)."""
    try:
        return DiLoCo(model, config.diloco_config(), inner_optimizer=inner_optimizer)
    except ValueError as e:
        raise NodeError(str(e)) from None
