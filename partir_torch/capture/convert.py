"""The traced FX graph of a step as a `Program`: values with roles and names, ops with module and source line."""

from __future__ import annotations

import operator
import os
from collections.abc import Mapping
from typing import Any

import torch

from partir_torch.ir.program import Op, Phase, Program, Ref, Role, Value

TORCH_DIR = os.path.dirname(torch.__file__)
OUR_DIR = os.path.dirname(os.path.dirname(__file__))


def to_program(gm: torch.fx.GraphModule, in_roles, out_roles, mode: str,
               flops: Mapping[str, float] | None = None) -> Program:
    """`flops`: the measured FLOPs per call of opaque ops, by target (`OpaqueModules.flops`), kept on their ops."""
    flops = flops or {}
    values: list[Value] = []
    ops: list[Op] = []
    env: dict[torch.fx.Node, Any] = {}  # node -> value id, or tuple of value ids for multi-output ops
    fwd_module_by_seq: dict[int, str] = {}
    fwd_source_by_seq: dict[int, str] = {}
    fwd_call_by_seq: dict[int, int] = {}

    def new_value(name: str, val: Any, role: Role, producer: int) -> int:
        if not isinstance(val, torch.Tensor):
            return -1
        vid = len(values)
        values.append(Value(vid, name, tuple(int(s) for s in val.shape), val.dtype, role, producer))
        return vid

    def ref(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            v = env[a]
            return Ref(v) if isinstance(v, int) else tuple(Ref(x) for x in v)
        if isinstance(a, (list, tuple)):
            return type(a)(ref(x) for x in a)
        return a

    placeholders = gm.graph.find_nodes(op="placeholder")
    for node, (role, name) in zip(placeholders, in_roles):
        env[node] = new_value(name, node.meta["val"], role, -1)
    placeholder_ids = {env[n] for n in placeholders}
    mutated: list[tuple[int, int]] = []  # (input value, its new value): functionalized buffer mutations
    constants: dict[str, int] = {}

    for node in gm.graph.nodes:
        if node.op == "get_attr":  # a tensor constant the model created (e.g. torch.tensor(-inf))
            if node.target not in constants:
                const = getattr(gm, node.target)
                constants[node.target] = new_value(f"constant[{node.target}]", const, Role.BUFFER, -1)
            env[node] = constants[node.target]
            continue
        if node.op != "call_function":
            continue
        if node.target is torch.ops.aten.copy_.default and env.get(node.args[0]) in placeholder_ids:
            mutated.append((env[node.args[0]], env[node.args[1]]))
            env[node] = env[node.args[1]]
            continue
        if node.target is torch.ops.aten.copy_.default and _same_meta(*node.args[:2]):
            # a copy into an intermediate the decompositions make below functionalization (batch norm's
            # running statistics of a repeated buffer, as `instance_norm` passes them): its value from then on
            env[node] = env[node.args[0]] = env[node.args[1]]
            continue
        if node.target is operator.getitem:
            env[node] = env[node.args[0]][node.args[1]]
            continue
        oid = len(ops)
        val = node.meta.get("val")
        if isinstance(val, (tuple, list)):
            outs = tuple(new_value(f"{node.name}.{i}", v, Role.ACTIVATION, oid) for i, v in enumerate(val))
            env[node] = outs
        else:
            outs = (new_value(node.name, val, Role.ACTIVATION, oid),)
            env[node] = outs[0]
        inputs: list[int] = []
        for a in node.all_input_nodes:
            v = env[a]
            inputs += [v] if isinstance(v, int) else [x for x in v if x >= 0]
        custom = node.meta.get("custom") or {}
        module, source = custom.get("module"), custom.get("source") or user_line(node.meta.get("stack_trace"))
        seq = node.meta.get("seq_nr")
        if module is not None and seq is not None:
            fwd_module_by_seq.setdefault(seq, module)
        elif module is None and seq is not None:
            module = fwd_module_by_seq.get(seq)
        if source is not None and seq is not None:
            fwd_source_by_seq.setdefault(seq, source)
        elif source is None and seq is not None:
            source = fwd_source_by_seq.get(seq)
        stamp = custom.get("call")  # a `CallStamp` at capture, an int (and "call_shape", "call_fn") after
        call, call_shape = getattr(stamp, "k", stamp), getattr(stamp, "shape", custom.get("call_shape"))
        call_fn = getattr(stamp, "fn", custom.get("call_fn"))
        if call is not None and seq is not None:
            fwd_call_by_seq.setdefault(seq, call)
        elif call is None and seq is not None and custom.get("backward"):
            call = fwd_call_by_seq.get(seq)
        # kept on the node, so a re-trace that decomposes it (rules/decompose.py) attributes its parts too
        node.meta["custom"] = {"module": module, "source": source, "call": call, "call_shape": call_shape,
                               "call_fn": call_fn}
        ops.append(
            Op(
                oid,
                str(node.target),
                tuple(inputs),
                outs,
                tuple(ref(a) for a in node.args),
                tuple((k, ref(a)) for k, a in node.kwargs.items()),
                Phase.FORWARD,
                module,
                node.target,
                source,
                call,
                call_shape if call is not None else None,
                call_fn if call is not None else None,
                flops.get(str(node.target)),
            )
        )

    (out_args,) = gm.graph.find_nodes(op="output")[0].args
    outputs = [env[a] for a in out_args]
    for old, new in mutated:
        outputs.append(new)
        out_roles = [*out_roles, (Role.OUTPUT, f"updated[{values[old].name}]", old)]
    updates: dict[int, int] = {}
    renamed: set[int] = set()
    for vid, (role, name, src) in zip(outputs, out_roles):
        if vid < 0 or values[vid].producer < 0 or vid in renamed:
            continue
        renamed.add(vid)
        v = values[vid]
        values[vid] = Value(vid, name, v.shape, v.dtype, role, v.producer)
        if src is not None:
            updates[vid] = src

    if mode == "train":
        assign_phases(ops, values, outputs)
    program = Program(values, ops, {}, {}, [], {}, {}, updates, outputs, None, [], mode, None, graph_module=gm)
    program.constants = constants
    program.n_graph_outputs = len(out_args)
    return program


def _same_meta(dst: Any, src: Any) -> bool:
    """Whether `src` has `dst`'s shape and dtype (a `copy_` that replaces the value, no broadcast or cast)."""
    a, b = (getattr(n, "meta", {}).get("val") for n in (dst, src))
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype


def user_line(stack_trace: str | None) -> str | None:
    """`modeling_gpt2.py:123` of the innermost frame outside torch and partir_torch in an FX stack trace."""
    if not stack_trace:
        return None
    found = None
    for line in stack_trace.splitlines():
        line = line.strip()
        if line.startswith('File "'):
            path, _, rest = line[6:].partition('", line ')
            if not path.startswith(TORCH_DIR) and not path.startswith(OUR_DIR) and "<" not in path:
                found = f"{os.path.basename(path)}:{rest.split(',')[0]}"
    return found


def assign_phases(ops: list[Op], values: list[Value], outputs: list[int]) -> None:
    """Forward = ancestors of the loss; backward = other ancestors of the gradients; the rest optimizer."""

    def ancestors(roots: list[int]) -> set[int]:
        seen: set[int] = set()
        todo = [values[r].producer for r in roots if r >= 0 and values[r].producer >= 0]
        while todo:
            o = todo.pop()
            if o in seen:
                continue
            seen.add(o)
            todo += [values[i].producer for i in ops[o].inputs if values[i].producer >= 0]
        return seen

    fwd = ancestors(outputs[:1])
    bwd = ancestors([v for v in outputs if v >= 0 and values[v].role is Role.GRADIENT]) - fwd
    for i, op in enumerate(ops):
        phase = Phase.FORWARD if i in fwd else Phase.BACKWARD if i in bwd else Phase.OPTIMIZER
        if phase is not Phase.FORWARD:
            ops[i] = Op(op.id, op.target, op.inputs, op.outputs, op.args, op.kwargs, phase, op.module, op.overload,
                        op.source, op.call, op.call_shape, op.call_fn, op.flops)
