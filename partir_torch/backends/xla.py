"""Run one training step through torch_xla SPMD on a (virtual CPU) device mesh, and read what XLA compiled.

This is the only module that imports torch_xla, and it does so in a worker subprocess: XLA reads
`XLA_FLAGS` (the HLO dump) and `CPU_NUM_DEVICES` once, when its runtime starts, so each compile gets a fresh
process with its own dump directory.

    run_step("tiny-gpt2", mesh, {"h.0.attn.c_attn.weight": ["model", None], ...}, input_specs=[["batch", None], ...])

The parameters, inputs and optimizer states get `xs.mark_sharding` with the given partition specs (torch_xla's
form: one entry per dim, None / axis / tuple of axes); the optimizer states are created up front (zeros,
step 0) so that they can be sharded, and the optimizer runs with `capturable=True` so the whole step is one
graph. The largest partitioned module of the dump is the step.

How the step is set up, and why:
- activation constraints: every module whose output is one value of the plan gets a forward hook that
  applies `xs.mark_sharding_with_gradients` with that value's spec (`plan.PlanSpecs.activations`), so GSPMD
  partitions activations and their gradients as the plan does; without them it shards by its own
  heuristics, and uses mesh axes the plan leaves idle (docs/cost-model.md has both measurements); each
  parameter's gradient gets its spec (`PlanSpecs.grads`) in a tensor hook, so it is reduced as planned;
- gradients are dropped (`zero_grad(set_to_none=True)`) before the step is compiled: a kept `.grad` is an
  output of the step, and torch_xla also materialises the pre-view base of each one (twice the gradient
  bytes as live-out buffers);
- tied parameters stay tied: `Module.to(xla)` makes a new Parameter per module;
- `nn.LayerNorm` runs as reductions over its normalized dims (`plain_layer_norm`): torch_xla lowers
  `native_layer_norm` to batch-norm-training over a [1, B*T, D] reshape and GSPMD all-gathers the batch
  around it, forward and backward;
- `F.scaled_dot_product_attention` runs as einsums over [B, H, T, d]: torch_xla's matmuls over a
  [B*H, T, d] reshape lose the head sharding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from partir_torch.backends.hlo import (
    HloCollective,
    find_step_module,
    read_collectives,
    read_memory_breakdown,
    read_memory_total,
)
from partir_torch.errors import PartirError
from partir_torch.ir.mesh import Mesh


class XlaError(PartirError):
    """The torch_xla worker failed."""


@dataclass
class XlaStep:
    loss: float
    collectives: list[HloCollective]
    memory_total: int | None
    hlo_path: str
    compile_s: float
    params_after: dict[str, list] | None = None
    memory_breakdown: dict[str, int] | None = None


def run_step(
    model: str,
    mesh: Mesh,
    param_specs: dict[str, list],
    input_specs: list[list | None] | None = None,
    state_specs: dict[str, dict[str, list]] | None = None,
    activation_specs: dict[str, list] | None = None,
    grad_specs: dict[str, list] | None = None,
    *,
    overrides: dict[str, str] | None = None,
    optimizer: str = "adamw",
    seed: int = 0,
    dump_dir: str | None = None,
    timeout: float = 900,
    return_params: bool = False,
    plain_layer_norm: bool = True,
) -> XlaStep:
    dump_dir = tempfile.mkdtemp(prefix="partir-xla-", dir=dump_dir)  # fresh: the largest module is the step
    job = {"model": model, "overrides": overrides or {}, "mesh": list(mesh.axes), "params": param_specs,
           "inputs": input_specs, "states": state_specs or {},
           "activations": activation_specs or {}, "grads": grad_specs or {}, "optimizer": optimizer, "seed": seed,
           "dump": dump_dir, "return_params": return_params,
           "plain_layer_norm": plain_layer_norm}
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(mesh.devices),
           "XLA_FLAGS": f"--xla_dump_to={dump_dir} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$",
           "TF_CPP_MIN_LOG_LEVEL": "2"}
    res = subprocess.run([sys.executable, "-m", "partir_torch.backends.xla", json.dumps(job)], env=env,
                         capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise XlaError(f"torch_xla worker failed for {model} on {mesh}:\n{res.stderr[-3000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    hlo, mem = find_step_module(dump_dir)
    return XlaStep(out["loss"], read_collectives(hlo.read_text(), list(mesh.axes)),
                   read_memory_total(mem.read_text()) if mem else None, str(hlo), out["compile_s"],
                   out.get("params_after"), read_memory_breakdown(mem.read_text()) if mem else None)


def _spec(entry: list | None, n: int) -> tuple:
    if entry is None:
        return (None,) * n
    return tuple(tuple(e) if isinstance(e, list) else e for e in entry)


def _to_keeping_ties(model, dev):
    """`model.to(dev)`, with tied parameters still tied: moving to an XLA device makes a new Parameter per
    module (no `set_data` across device types), so a tied LM head would become a second weight."""
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    model = model.to(dev)
    for names in owners.values():
        first = model.get_parameter(names[0])
        for name in names[1:]:
            mod, _, attr = name.rpartition(".")
            setattr(model.get_submodule(mod), attr, first)
    return model


def _plain_layer_norms(model) -> None:
    """torch_xla lowers `native_layer_norm` to batch-norm-training over a [1, B*T, D] reshape, and GSPMD then
    all-gathers the batch around it (forward and backward). The same function written as reductions over the
    normalized dims stays sharded like the rest of the step."""
    import torch
    from torch import nn

    def forward(self, x):
        dims = tuple(range(-len(self.normalized_shape), 0))
        mu = x.mean(dims, keepdim=True)
        xc = x - mu
        y = xc * torch.rsqrt((xc * xc).mean(dims, keepdim=True) + self.eps)
        if self.weight is not None:
            y = y * self.weight
        if self.bias is not None:
            y = y + self.bias
        return y

    for m in model.modules():
        if type(m) is nn.LayerNorm:
            m.forward = forward.__get__(m)


def _einsum_attention() -> None:
    """torch_xla runs `F.scaled_dot_product_attention` as matmuls over a [B*H, T, d] reshape, and GSPMD loses
    the head sharding there (Megatron's attention then runs every head on every device). The same math as
    einsums over [B, H, T, d] keeps batch and heads as batch dims of the dot."""
    import math

    import torch
    import torch.nn.functional as F

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if dropout_p or enable_gqa:
            raise NotImplementedError("einsum attention: dropout and enable_gqa are not supported")
        scores = torch.einsum("...qd,...kd->...qk", q, k) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
        if is_causal:
            rows = torch.arange(q.shape[-2], device=q.device).unsqueeze(1)
            cols = torch.arange(k.shape[-2], device=q.device).unsqueeze(0)
            scores = scores.masked_fill(cols > rows, float("-inf"))
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
        return torch.einsum("...qk,...kd->...qd", torch.softmax(scores, dim=-1), v)

    F.scaled_dot_product_attention = sdpa


def _worker(job: dict[str, Any]) -> dict[str, Any]:
    import time

    import numpy as np
    import torch
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    from partir_torch import workload

    xr.use_spmd()
    torch.manual_seed(job["seed"])
    model, inputs, loss_fn = workload.load(job["model"], job["overrides"], device="cpu")
    names = [a for a, _ in job["mesh"]]
    shape = tuple(s for _, s in job["mesh"])
    mesh = xs.Mesh(np.arange(int(np.prod(shape))), shape, tuple(names))
    dev = torch_xla.device()
    model = _to_keeping_ties(model, dev)
    if job.get("plain_layer_norm", True):
        _plain_layer_norms(model)
    _einsum_attention()
    params = dict(model.named_parameters())
    for n, p in params.items():
        xs.mark_sharding(p, mesh, _spec(job["params"].get(n), p.dim()))

    def constrain_to(spec: tuple):
        def hook(mod, args, out):
            if isinstance(out, torch.Tensor) and out.dim() == len(spec):
                return xs.mark_sharding_with_gradients(out, mesh, spec)
            return None

        return hook

    for path, spec in job["activations"].items():  # module outputs and their gradients follow the plan
        model.get_submodule(path).register_forward_hook(constrain_to(_spec(spec, len(spec))))

    def grad_to(spec: tuple):
        def hook(g):
            xs.mark_sharding(g, mesh, spec)

        return hook

    for n, spec in job.get("grads", {}).items():  # parameter gradients as the plan reduces them
        if n in params and spec is not None:
            params[n].register_hook(grad_to(_spec(spec, params[n].dim())))
    xin = []
    for i, x in enumerate(inputs):
        x = x.to(dev)
        spec = (job["inputs"] or [None] * len(inputs))[i]
        xs.mark_sharding(x, mesh, _spec(spec, x.dim()))
        xin.append(x)
    kind = job["optimizer"]
    if kind == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, foreach=False)
        init = {"momentum_buffer": lambda p: torch.zeros_like(p)}
    else:
        cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
        opt = cls(model.parameters(), lr=1e-3, foreach=False, capturable=True)
        init = {"step": lambda p: torch.zeros((), device=dev), "exp_avg": torch.zeros_like, "exp_avg_sq": torch.zeros_like}
    for n, p in params.items():
        st = {}
        for s, make in init.items():
            t = make(p)
            if t.dim():
                xs.mark_sharding(t, mesh, _spec(job["states"].get(n, {}).get(s, job["params"].get(n)), t.dim()))
            st[s] = t
        opt.state[p] = st
    torch_xla.sync()
    t0 = time.perf_counter()
    loss = loss_fn(model, *xin)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)  # gradients are temporaries of the step, not outputs (see above)
    torch_xla.sync()
    value = float(loss.detach().cpu())
    out = {"loss": value, "compile_s": time.perf_counter() - t0}
    if job.get("return_params"):
        out["params_after"] = {n: p.detach().cpu().flatten()[:64].tolist() for n, p in params.items()}
    return out


if __name__ == "__main__":
    print(json.dumps(_worker(json.loads(sys.argv[1]))))


def reference_step(model: str, *, overrides: dict[str, str] | None = None, optimizer: str = "adamw", seed: int = 0
                   ) -> tuple[float, dict[str, list]]:
    """The same first step as the worker, unsharded on the CPU in eager torch: (loss, first 64 values of
    every updated parameter)."""
    import torch

    from partir_torch import workload

    torch.manual_seed(seed)
    net, inputs, loss_fn = workload.load(model, overrides, device="cpu")
    if optimizer == "sgd":
        opt = torch.optim.SGD(net.parameters(), lr=1e-2, momentum=0.9, foreach=False)
    else:
        cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.Adam
        opt = cls(net.parameters(), lr=1e-3, foreach=False)
    loss = loss_fn(net, *inputs)
    loss.backward()
    if optimizer == "sgd":  # the worker starts from a zero momentum buffer, torch from the first gradient
        for p in net.parameters():
            opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
    opt.step()
    return float(loss.detach()), {n: p.detach().flatten()[:64].tolist() for n, p in net.named_parameters()}
