"""Graph Network Simulator (Sanchez-Gonzalez et al. 2020): encode, process (message passing), decode.

The graph is one big static graph: ``senders``/``receivers`` are int64 edge endpoint indices,
gathered with ``index_select`` and scattered with out-of-place ``index_add`` so shapes stay static.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._common import check_common, example_generator, randint, randn, require, resolve_dtype


@dataclass(frozen=True)
class GNSConfig:
    """Graph sizes and MLP shapes. ``mlp_layers`` is the number of hidden layers of every MLP."""

    nodes: int = 65536
    edges: int = 1048576
    node_in: int = 30
    edge_in: int = 4
    latent: int = 128
    mlp_layers: int = 2
    steps: int = 10
    out: int = 3
    dtype: str = "float32"

    def __post_init__(self) -> None:
        check_common(self)
        for name in ("nodes", "edges", "node_in", "edge_in", "latent", "mlp_layers", "steps", "out"):
            require(getattr(self, name) > 0, f"{name} must be positive")


def make_mlp(inp: int, hidden: int, out: int, layers: int, layer_norm: bool) -> nn.Sequential:
    """``layers`` hidden Linear+ReLU layers, an output Linear and optionally a LayerNorm."""
    mods: list[nn.Module] = []
    width = inp
    for _ in range(layers):
        mods += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    mods.append(nn.Linear(width, out))
    if layer_norm:
        mods.append(nn.LayerNorm(out))
    return nn.Sequential(*mods)


class InteractionNetwork(nn.Module):
    """One message-passing step: edge update from (edge, sender, receiver), sum at receivers, node update."""

    def __init__(self, latent: int, mlp_layers: int) -> None:
        super().__init__()
        self.edge_mlp = make_mlp(3 * latent, latent, latent, mlp_layers, layer_norm=True)
        self.node_mlp = make_mlp(2 * latent, latent, latent, mlp_layers, layer_norm=True)

    def forward(
        self, nodes: Tensor, edges: Tensor, senders: Tensor, receivers: Tensor
    ) -> tuple[Tensor, Tensor]:
        sent = nodes.index_select(0, senders)
        received = nodes.index_select(0, receivers)
        messages = self.edge_mlp(torch.cat([edges, sent, received], dim=-1))
        aggregated = torch.zeros(
            nodes.shape[0], messages.shape[1], device=messages.device, dtype=messages.dtype
        ).index_add(0, receivers, messages)
        updated = self.node_mlp(torch.cat([nodes, aggregated], dim=-1))
        return nodes + updated, edges + messages


class GNS(nn.Module):
    """Encoders -> ``processor`` (``steps`` identical interaction networks) -> decoder."""

    def __init__(self, cfg: GNSConfig) -> None:
        super().__init__()
        self.node_encoder = make_mlp(cfg.node_in, cfg.latent, cfg.latent, cfg.mlp_layers, layer_norm=True)
        self.edge_encoder = make_mlp(cfg.edge_in, cfg.latent, cfg.latent, cfg.mlp_layers, layer_norm=True)
        self.processor = nn.ModuleList(
            InteractionNetwork(cfg.latent, cfg.mlp_layers) for _ in range(cfg.steps)
        )
        self.decoder = make_mlp(cfg.latent, cfg.latent, cfg.out, cfg.mlp_layers, layer_norm=False)

    def forward(self, node_feats: Tensor, edge_feats: Tensor, senders: Tensor, receivers: Tensor) -> Tensor:
        nodes = self.node_encoder(node_feats)
        edges = self.edge_encoder(edge_feats)
        for step in self.processor:
            nodes, edges = step(nodes, edges, senders, receivers)
        return self.decoder(nodes)


def build_model(cfg: GNSConfig) -> GNS:
    return GNS(cfg)


def example_inputs(cfg: GNSConfig, device: torch.device) -> tuple[Tensor, ...]:
    """``(node_feats, edge_feats, senders, receivers, target)``; the random graph is seeded."""
    gen = example_generator()
    dtype = resolve_dtype(cfg.dtype)
    return (
        randn((cfg.nodes, cfg.node_in), dtype, device, gen),
        randn((cfg.edges, cfg.edge_in), dtype, device, gen),
        randint(cfg.nodes, (cfg.edges,), device, gen),
        randint(cfg.nodes, (cfg.edges,), device, gen),
        randn((cfg.nodes, cfg.out), dtype, device, gen),
    )


def gns_loss(
    model: nn.Module,
    node_feats: Tensor,
    edge_feats: Tensor,
    senders: Tensor,
    receivers: Tensor,
    target: Tensor,
) -> Tensor:
    """MSE of predicted vs target per-node accelerations."""
    pred = model(node_feats, edge_feats, senders, receivers)
    return F.mse_loss(pred.float(), target.float())
