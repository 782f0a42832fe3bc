"""auto_shard a GPT of your own with torch_xla SPMD on the 8-device XLA CPU mesh and train it with a plain loop.

    .venv-xla/bin/python examples/quickstart.py            # a 4-layer GPT, 10 steps (the XLA environment)
    .venv-xla/bin/python examples/quickstart.py --tiny     # seconds (what the test runs)

On torch.distributed (the default backend) the README's quickstart and `examples/torchrun_gpt.py` do the same.

The model is an ordinary `nn.Module` written here (not the zoo's); the optimizer is the user's own AdamW.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import partir_torch


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def lm_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    mesh = {"batch": 2, "model": 4}
    partir_torch.start_runtime(mesh)  # torch_xla's runtime before any backward of this process
    torch.manual_seed(0)
    vocab, d, heads, layers, seq, batch = (128, 32, 4, 2, 16, 8) if args.tiny else (4096, 256, 8, 4, 128, 16)
    model = TinyGPT(vocab, d, heads, layers, seq)
    data = torch.randint(0, vocab, (batch, seq + 1))
    tokens, targets = data[:, :-1], data[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # a per-device memory limit below what pure data parallelism needs: the plan must shard the weights
    model, optimizer = partir_torch.auto_shard(model, (tokens, targets), mesh, backend="xla",
                                               loss_fn=lm_loss, optimizer=optimizer,
                                               memory="400KiB" if args.tiny else "40MiB", budget=80)
    print(model.partir_plan.table())
    import torch_xla

    for step in range(args.steps if not args.tiny else 3):
        loss = lm_loss(model, *partir_torch.shard_batch(model, tokens, targets))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch_xla.sync()  # one XLA graph per step
        print(f"step {step}: loss {float(loss.detach()):.4f}")


if __name__ == "__main__":
    main()
