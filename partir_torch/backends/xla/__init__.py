"""Apply a `ShardingPlan` with torch_xla SPMD, in the caller's process: the one apply path of the project.

`auto_shard`, `verify` (through `xla_worker`, a fresh process with the HLO dump on) and the calibration all
call `shard_module` / `shard_optimizer` / `shard_batch` here, so the program XLA compiles is the plan that
was searched, applied one way.

What `shard_module` does to the user's model, all of it undone by `unshard(model)`:
1. every parameter and buffer is replaced by a copy on the XLA device (tied weights stay one tensor; a
   model built on meta is materialized there with `torch.empty` and each module's `reset_parameters`, so no
   full host copy is made) and `xs.mark_sharding`ed with the plan's spec; `state_dict()` keeps its keys;
2. each module whose output the plan shards gets a forward hook that applies `mark_sharding_with_gradients`
   with that spec, and each parameter a tensor hook that constrains its gradient: without them GSPMD
   resolves conflicts its own way and runs another program than the one costed (docs/cost-model.md);
3. a forward pre-hook on the root shards the batch tensors that reach `forward` (moving host tensors to
   the device), and checks their shapes against the plan's;
4. while the root's forward runs, a `TorchFunctionMode` (`Lowerings`) runs `F.layer_norm`, `F.group_norm`,
   `F.batch_norm` and `F.instance_norm` as reductions over the normalized dims and
   `F.scaled_dot_product_attention` as einsums over [B, H, T, d]: torch_xla lowers the norms to XLA's
   batch-norm ops (over a [1, B*T, D], [1, N*G, ...] or [1, N*C, ...] reshape for all but batch norm) and
   attention to matmuls over a [B*H, T, d] reshape: GSPMD gathers the batch around the norms and loses the
   head sharding in attention (the same math, so the same numerics); and grouped convolutions
   (and transposed ones) as plain or depthwise ones, a depthwise one's weight gradient computed per kernel
   offset (`_GroupedConv`): given the autodiff's `batch_group_count` convolution with its batch split,
   GSPMD all-reduces the partial sums over every device, not the batch axis alone;
5. each module whose input the plan reshards on entry (`plan.module_inputs`: LayerNorm's input gathered,
   say) gets a forward pre-hook that constrains that input (and its gradient) the same way, so that
   GSPMD reshards there and not after the module.
6. inside modules' own forwards, where no module boundary is (a U-Net's skip `torch.cat` in the model's
   `forward`, an MoE's dispatch einsums), the same `TorchFunctionMode` numbers the calls that make tensors
   per module as the capture numbered them (`capture.attribution.CallTracker`) and applies `plan.calls`: an
   operand the plan reshards before a call is constrained (with its gradient) as the call reads it, and the
   call's result as the plan has it (`CallConstraints`; a dot's sum the plan reduce-scatters first reduced
   in place when a mesh axis is idle on it, so that GSPMD does not split the dot over that axis:
   `reduce_in_place`). Views and in-place results are left
   as they are (a constrained copy would not alias), and a module whose calls stop matching the capture's
   (another function, or a result of another shape: its forward took another path on the device) is left
   to GSPMD, with one warning.
7. the model's output, when the loss function reshards it (a vocab-tiled head's logits gathered for the
   softmax; `plan.output`), is constrained to the sharding the loss reads it in, with the gradient the
   loss's backward sends back: the loss runs outside the model, where no hook reaches.
8. a plan whose program was captured with `assume_compiling=True` (`plan.compiling`) has the model's forward
   run with `torch.compiler.is_compiling()` true too, so the library takes the path that was captured (HF's
   mask helpers keep an all-ones mask that their eager path drops) and the calls match the capture's.
The caller's original tensors are kept (not modified) for `unshard`, which copies the trained values back
into them. The optimizer is rebuilt on the moved parameters (`shard_optimizer`): same class, param groups
and hyperparameters, with `foreach=False` and `capturable=True` (implementation options: one graph per
step, the same arithmetic), its states created up front and sharded as the plan says.

torch_xla is imported only in this package (and in `xla_worker`); a missing install is an error that says how to get
the pinned pair.
"""


from partir_torch.backends.xla.constraints import CallConstraints, constrain, grad_hook, reduce_in_place
from partir_torch.backends.xla.lowerings import Lowerings
from partir_torch.backends.xla.module import (
    Sharded,
    apply,
    discard,
    input_sharding,
    shard_batch,
    shard_module,
    shard_optimizer,
    sharded,
    train_step,
    unshard,
)
from partir_torch.backends.xla.runtime import (
    INSTALL,
    MEMORY_SCHEDULER,
    XlaError,
    device_mesh,
    hardware_preset,
    sharding_of,
    start_runtime,
    sync,
)

__all__ = ["INSTALL", "MEMORY_SCHEDULER", "CallConstraints", "Lowerings", "Sharded", "XlaError", "apply",
           "constrain", "device_mesh", "discard", "grad_hook", "hardware_preset", "input_sharding", "reduce_in_place",
           "shard_batch", "shard_module", "shard_optimizer", "sharded", "sharding_of", "start_runtime", "sync",
           "train_step", "unshard"]
