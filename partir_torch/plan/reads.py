"""Where a module reads its tensors in another sharding than they have: the resharding a backend must
apply at a module's boundary (its input, its parameters) or at a torch-function call inside its forward
(`call_constraints`) so that the engine runs the plan's collectives once, where the cost model puts them,
instead of resolving the conflict its own way."""

from __future__ import annotations

from dataclasses import dataclass

from partir_torch.ir.sharding import Sharding
from partir_torch.propagate import ShardingState


def _forward_modules(program) -> tuple[dict[str, list[int]], dict[str, int]]:
    """({module path: its forward ops, submodules' included, in op order}, {module path: calls})."""
    from partir_torch.ir.program import Phase

    ops_of: dict[str, list[int]] = {}
    calls: dict[str, int] = {}
    prev = ""
    for op in program.ops:
        if op.phase is not Phase.FORWARD or not op.module:
            prev = ""
            continue
        parts = op.module.split(".")
        for i in range(1, len(parts) + 1):
            path = ".".join(parts[:i])
            if not (prev == path or prev.startswith(path + ".")):  # entered from outside: a call
                calls[path] = calls.get(path, 0) + 1
            ops_of.setdefault(path, []).append(op.id)
        prev = op.module
    return ops_of, calls


def module_outputs(program) -> dict[str, int]:
    """The value each module's forward returns, by module path: the one forward activation made inside the
    module (its ops or its submodules') and used outside it. Modules whose output is not one such value
    (several outputs, tuples, modules called more than once) are left out."""
    from partir_torch.ir.program import Role

    ops_of, calls = _forward_modules(program)
    made = {path: {o for i in ids for o in program.ops[i].outputs if o >= 0} for path, ids in ops_of.items()}
    users, ops = program.users, program.ops
    out: dict[str, int] = {}
    for path, vals in made.items():
        sub = path + "."
        escaping = []
        for v in sorted(vals):
            if program.values[v].role is not Role.ACTIVATION:
                continue
            if any(not (m := ops[u].module) or not (m == path or m.startswith(sub)) for u in users[v]):
                escaping.append(v)
        if len(escaping) == 1:
            out[path] = escaping[0]
    return {p: v for p, v in out.items() if calls.get(p, 1) <= 1}


def output_shardings(state: ShardingState) -> dict[str, Sharding]:
    """{module path: the sharding a backend constrains its output (and the output's gradient) to}: the
    output's sharding, or, when that is a pending sum (a row-parallel linear's), the one sharding its
    readers reduce it to. A pending sum has no spec: constrained as its dims alone it would be all-reduced
    to replicated at the module's end, and the engine would then gather the other operands of its readers
    to meet it (a GPT's residual add under a plan that reduce-scatters the MLP's output). Sums its readers
    take in several shardings are left unconstrained."""
    program = state.program
    out: dict[str, Sharding] = {}
    for path, v in module_outputs(program).items():
        sh = state.shard[v]
        if sh.partial:
            sh = _read_as(state, v, set(program.users[v]))
        if sh is not None:
            out[path] = sh
    return out


def grad_shardings(state: ShardingState) -> dict[str, Sharding]:
    """{parameter: the sharding a backend constrains its gradient to}: the gradient's sharding, or, for a
    pending sum over every mesh axis its reader does not tile it on, the one sharding the optimizer reads it
    in. Constrained as its dims alone such a sum is all-reduced over all its
    axes and then sliced where the plan reduce-scatters over one and all-reduces a slice over the others (GNS's
    edge weights, summed over edges tiled on `batch` and `model`). A sum with an idle axis keeps its dims:
    constrained tiled, GSPMD reduce-scatters it over the idle axis too and moves the tiles with
    collective-permutes the plan does not have (docs/apply.md, "idle-axis trick")."""
    program, names = state.program, state.mesh.names
    out: dict[str, Sharding] = {}
    for n, v in program.grads.items():
        sh = state.shard[v]
        if sh.partial:
            need = _read_as(state, v, set(program.users[v]))
            if need is not None and all(a in sh.partial or a in need.axes for a in names):
                sh = need
        out[n] = sh
    return out


def grads_made(state: ShardingState, ends: dict[str, Sharding]) -> dict[str, Sharding]:
    """{parameter: the tiling the plan makes its gradient in} for a gradient made as a sum that the optimizer
    reads reduce-scattered: each summed axis added as a tiling of a dim, none all-reduced (`ends`: where it
    ends, `grad_shardings`). A backend constrains the gradient to this tiling first: XLA's dot partitioner then
    computes the tile as the plan does and all-reduces it before the slice, its reduce-scatter in the CPU's
    form; constrained to where it ends only, it re-tiles the dot's operands with all-to-alls the plan does not
    have (a GPT's MLP weights stored tiled over `(model, batch)` with the tokens on `batch`: docs/apply.md)."""
    program = state.program
    out: dict[str, Sharding] = {}
    for n, v in program.grads.items():
        sh, end = state.shard[v], ends[n]
        if not sh.partial or end.partial:
            continue
        made = Sharding(sh.dims)  # (made replicated: XLA reduces it whole and slices it by itself)
        if made.axes and end != made and _slices(made, end) and set(end.axes) - set(made.axes) == set(sh.partial):
            out[n] = made
    return out


def module_inputs(state: ShardingState) -> dict[str, tuple[int, Sharding, Sharding | None]]:
    """{module path: (its input value, the sharding the module reads it in, the sharding of the gradient it
    sends back for it or None)} where the plan reshards a module's
    one outside input as the module's first step: `lower` reshards the input (or a same-size single-operand
    view of it, the sharding then taken back to the input's dims) at every use inside the module, all to the
    same sharding. A backend constrains the module's input to it, so that the engine reshards where the cost
    model does (an all-gather of LayerNorm's input, not the all-to-all of its output GSPMD would choose).
    Modules called more than once, with several outside inputs, or whose input is used as it is are left out."""
    from partir_torch.ir.program import Role

    program = state.program
    ops_of, calls = _forward_modules(program)
    producer = {v: op.id for op in program.ops for v in op.outputs if v >= 0}
    out: dict[str, tuple[int, Sharding, Sharding | None]] = {}
    for path, ids in ops_of.items():
        if calls.get(path, 1) > 1:
            continue
        inside = set(ids)
        outer = {v for i in ids for v in program.ops[i].inputs if v >= 0 and producer.get(v, -1) not in inside
                 and program.values[v].role in (Role.ACTIVATION, Role.INPUT)}
        if len(outer) != 1:
            continue
        v = outer.pop()
        need = _read_as(state, v, inside)
        if need is not None and need != state.shard[v]:
            out[path] = (v, need, _grad_read_as(state, v, path))
    return out


def param_reads(state: ShardingState) -> dict[str, Sharding]:
    """{parameter name: the sharding its module's forward reads it in} for parameters the plan stores sharded
    and gathers (or re-tiles) before use, read inside one module called once, all in one sharding. A
    backend hands that module the parameter in that sharding, so that the engine reshards it once and the
    backward reuses it as the cost model does (XLA otherwise re-gathers a linear's transposed weight in
    the backward). A tied parameter is handed by the module around all its uses (the model, for tied
    embeddings) to all of them. Left out: parameters whose views the plan's backward reshards with a
    collective of its own (the engine is left to do so too)."""
    from partir_torch.ir.program import Phase
    from partir_torch.lower import lower

    program = state.program
    ops_of, calls = _forward_modules(program)
    users = program.users
    again = {c.value for c in lower(state) if c.op >= 0 and program.ops[c.op].phase is Phase.BACKWARD}
    out: dict[str, Sharding] = {}
    ops_of[""] = [op.id for op in program.ops if op.phase is Phase.FORWARD and op.module]  # the model itself
    for name, v in program.params.items():
        fwd = [u for u in users[v] if program.ops[u].phase is Phase.FORWARD]
        around = list(zip(*[(program.ops[u].module or "").split(".") for u in fwd], name.split(".")[:-1]))
        n = next((i for i, names in enumerate(around) if len(set(names)) > 1), len(around))
        owner = ".".join(names[0] for names in around[:n])  # the innermost module around every use
        if not fwd or calls.get(owner, 1) > 1 or owner not in ops_of:
            continue
        inside = set(ops_of[owner])
        if any(u not in inside for u in fwd):
            continue
        need = _read_as(state, v, inside)
        if need is None or need == state.shard[v] or _views(program, v) & again:
            continue  # (the backward reshards it again: the plan does not reuse the forward's copy)
        out[name] = need
    return out


def read_grads(state: ShardingState, reads: dict[str, Sharding]) -> dict[str, Sharding]:
    """{parameter: the tiling the plan makes the gradient of its read in} for a parameter of `reads` (what
    `param_reads` hands over) read by several ops (a tied weight): autograd sums their gradients at the one
    read, and the plan makes each term as a sum pending over the same axes, in one tiling. A backend
    constrains the read's gradient to it: XLA then reduces the terms as the plan does, instead of making a
    scatter-add's term directly in the stored tiling with an all-to-all the plan does not have (the demo
    GPT's tied token table: docs/apply.md)."""
    from partir_torch.ir.program import Phase

    program = state.program
    out: dict[str, Sharding] = {}
    for name in reads:
        v, g = program.params[name], program.grads.get(name)
        readers = [u for u in program.users[v] if program.ops[u].phase is Phase.FORWARD]
        made_by = program.values[g].producer if g is not None else -1
        if len(readers) < 2 or made_by < 0 or program.ops[made_by].target != "aten.add.Tensor":
            continue
        terms = [state.shard[t.value] for t in state.rules[made_by].operands]
        made = {Sharding(t.dims) for t in terms}
        if len(made) == 1 and all(t.partial for t in terms):
            out[name] = made.pop()
    return out


def model_output(state: ShardingState) -> tuple[int, Sharding, Sharding | None] | None:
    """(the model's output, the sharding the loss function reads it in, the sharding of the gradient the
    loss's backward sends back for it or None) when the loss reshards the one activation the model returns
    (a GPT's logits tiled on vocab, gathered for the softmax): a backend constrains the model's output to it,
    so the engine reshards there as the cost model does (XLA would otherwise compute the softmax on the tiles
    with statistics the plan does not have); None when the loss reads it as it is, or in several shardings."""
    from partir_torch.ir.program import Phase, Role

    program = state.program
    ops, users = program.ops, program.users
    loss = {op.id for op in ops if op.phase is Phase.FORWARD and op.module is None}
    made = [o for op in ops if op.phase is Phase.FORWARD and op.module is not None for o in op.outputs if o >= 0]
    out = [v for v in made if program.values[v].role is Role.ACTIVATION and any(u in loss for u in users[v])]
    if len(out) != 1:
        return None
    v = out[0]
    need = _read_as(state, v, loss)
    if need is None or need == state.shard[v]:
        return None
    back = {op.id for op in ops if op.phase is Phase.BACKWARD and op.module is None}
    return v, need, _grad_sent(state, v, back)


def _calls(program) -> dict[tuple[str, int], list[int]]:
    """{(module path, call number): its forward ops in op order} for the torch-function calls a module's own
    forward makes (`capture.attribution.CallTracker`; the root's path is "")."""
    from partir_torch.ir.program import Phase

    out: dict[tuple[str, int], list[int]] = {}
    for op in program.ops:
        if op.phase is Phase.FORWARD and op.module is not None and op.call is not None:
            out.setdefault((op.module, op.call), []).append(op.id)
    return out


@dataclass(frozen=True)
class PendingSum:
    """A call's result the plan makes as a sum over the mesh axes `over` that its readers reduce-scatter:
    the rule of the op that sums (`by`, through the data movement after it), the sum reduced in place
    (`reduced`: its dims without the summed axes) and the sharding the call's backward reads the result's
    gradient in (`grad`, None when it is not one)."""

    over: tuple[str, ...]
    by: str | None
    reduced: Sharding
    grad: Sharding | None

    def to_json(self) -> dict:
        return {"over": list(self.over), "by": self.by, "reduced": self.reduced.to_spec(),
                "grad": self.grad.to_spec() if self.grad is not None else None}


def call_constraints(state: ShardingState) -> dict[tuple[str, int], dict]:
    """{(module path, call number): {"ins": [(shape, nth, sharding, gradient's sharding or None)], "out":
    (shape, sharding, summed) or None, "fn": the function's name}} for the torch-function calls inside
    modules' forwards where the plan reshards an activation operand before the call's ops read it (`ins`: the
    operand is the `nth` tensor of its shape among the call's tensor arguments, as the engine meets them) and
    the sharding of the one activation the call makes for the ops after it (`out`; a pending sum as its
    readers reduce it). A backend constrains them at the call, so the engine reshards where the cost model
    does, inside a module as at its boundary (`module_inputs`, `output_shardings`): a `torch.cat` in a
    model's own forward whose operand the plan re-tiles, say; it checks it meets the function named.

    `summed` is None, or, for a result the plan makes as a sum its readers reduce-scatter, its `PendingSum`:
    what a backend needs to choose how its engine reduces it (`backends.xla` has GSPMD reduce a dot's sum
    in place first when a mesh axis is idle on it: docs/apply.md). The plan states the facts; which engine
    does what with them is the backend's knowledge."""
    from partir_torch.ir.program import Phase, Role

    program = state.program
    ops, values, users = program.ops, program.values, program.users
    backward: dict[tuple[str, int], set[int]] = {}
    for op in ops:
        if op.phase is Phase.BACKWARD and op.module is not None and op.call is not None:
            backward.setdefault((op.module, op.call), set()).add(op.id)
    out: dict[tuple[str, int], dict] = {}
    for key, ids in _calls(program).items():
        inside = set(ids)
        made = {o for i in ids for o in ops[i].outputs if o >= 0}
        operands: list[int] = []  # every tensor operand from before the call, in first-use order
        for i in ids:
            operands += [v for v in ops[i].inputs if v >= 0 and v not in made and v not in operands]
        ins = []
        for v in operands:
            if values[v].role not in (Role.ACTIVATION, Role.INPUT):
                continue
            need = _read_as(state, v, inside)
            if need is None or need == state.shard[v]:
                continue
            shape = values[v].shape
            nth = sum(values[w].shape == shape for w in operands[:operands.index(v)])
            ins.append((shape, nth, need, _grad_sent(state, v, backward.get(key, set()))))
        shape = ops[ids[-1]].call_shape  # the call's result as the engine meets it
        escaping = [v for v in sorted(made) if values[v].role is Role.ACTIVATION and values[v].shape == shape
                    and any(ops[u].phase is Phase.FORWARD and u not in inside for u in users[v])]
        res = None
        if len(escaping) == 1:
            v = escaping[0]
            sh = state.shard[v]
            pending = sh.partial
            if sh.partial:
                sh = _read_as(state, v, set(users[v]))
            if sh is not None and not sh.chunks:
                summed = None
                if pending & sh.axes:  # reduce-scattered by its readers
                    reduced = Sharding(tuple(tuple(a for a in d if a not in pending) for d in sh.dims))
                    summed = PendingSum(tuple(sorted(pending)), _summed_by(state, v), reduced,
                                        _grad_received(state, v, backward.get(key, set())))
                res = (values[v].shape, sh, summed)
        if ins or res is not None:
            out[key] = {"ins": ins, "out": res, "fn": ops[ids[-1]].call_fn}
    return out


def _views(program, v: int) -> set[int]:
    """`v` and the values made from it by chains of same-size single-operand ops (its views and casts)."""
    seen, todo = {v}, [v]
    while todo:
        c = todo.pop()
        for u in program.users[c]:
            op = program.ops[u]
            outs = [o for o in op.outputs if o >= 0]
            if len([i for i in op.inputs if i >= 0]) == 1 and len(outs) == 1 and outs[0] not in seen \
                    and program.values[outs[0]].numel == program.values[c].numel:
                seen.add(outs[0])
                todo.append(outs[0])
    return seen


def _grad_read_as(state: ShardingState, v: int, path: str) -> Sharding | None:
    """The sharding of the gradient the module at `path` sends back for its input `v`: the one value of v's
    shape that its backward ops make and ops outside them use, as they make it, or, when that is a pending
    sum, as its first user reads it (reduce-scattered there: the tiled form); None when that is not one
    value or stays a sum."""
    from partir_torch.ir.program import Phase

    program = state.program
    sub = path + "."
    mine = {op.id for op in program.ops if op.phase is Phase.BACKWARD and op.module
            and (op.module == path or op.module.startswith(sub))}
    return _grad_sent(state, v, mine)


def _grad_sent(state: ShardingState, v: int, mine: set[int]) -> Sharding | None:
    """The sharding of the gradient the backward ops `mine` send back for `v` (`_grad_read_as`)."""
    from partir_torch.ir.program import Role
    from partir_torch.lower import op_shardings, required_operand

    program = state.program
    shape = program.values[v].shape
    users = program.users
    sent = {w for o in mine for w in program.ops[o].outputs if w >= 0 and program.values[w].role is Role.ACTIVATION
            and program.values[w].shape == shape and any(u not in mine for u in users[w])}
    if len(sent) != 1:
        return None
    g = sent.pop()
    maker = program.values[g].producer
    made = op_shardings(state, maker)[1][[t.value for t in state.rules[maker].results].index(g)]
    first = min(u for u in users[g] if u not in mine)
    rule = state.rules[first]
    slot = next((i for i, t in enumerate(rule.operands) if t.value == g), None)
    read = required_operand(state, first, slot) if slot is not None else state.shard[g]
    for sh in (made, read):
        if not sh.partial and not sh.chunks:
            return sh
    return None


def _summed_by(state: ShardingState, v: int) -> str | None:
    """The rule of the op that makes the pending sum `v`, through the data movement after it."""
    from partir_torch.propagate import SUMS_PASS

    program = state.program
    while True:
        o = program.values[v].producer
        if o is None or o < 0:
            return None
        rule = state.rules[o]
        if rule.name in SUMS_PASS and len(rule.operands) == 1 and state.shard[rule.operands[0].value].partial:
            v = rule.operands[0].value
            continue
        return rule.name


def _grad_received(state: ShardingState, v: int, mine: set[int]) -> Sharding | None:
    """The sharding the backward ops `mine` (a call's) read the gradient of its result `v` in: the one value
    of v's shape made outside them that they read, the coarsest of their reads when the others are local
    slices of it (a weight gradient reads the tiles of what the input gradient reads gathered); None when it
    is not one value or the reads disagree otherwise."""
    from partir_torch.ir.program import Role

    program = state.program
    shape = program.values[v].shape
    got = {w for o in mine for w in program.ops[o].inputs if w >= 0 and program.values[w].shape == shape
           and program.values[w].role is Role.ACTIVATION and program.values[w].producer not in mine}
    if len(got) != 1:
        return None
    need = _read(state, got.pop(), mine, coarsest=True)
    return None if need is None or need.partial or need.chunks else need


def _read_as(state: ShardingState, v: int, inside: set[int]) -> Sharding | None:
    """The one sharding the ops of `inside` read `v` in, following same-size single-operand ops (views,
    casts) to where their results are resharded, back through them; None when the uses disagree, a way
    back does not map dims, or the read is a pending sum or a chunked layout."""
    need = _read(state, v, inside)
    return None if need is None or need.partial or need.chunks else need


def _read(state: ShardingState, cur: int, inside: set[int], coarsest: bool = False) -> Sharding | None:
    from partir_torch.lower import op_reshards, pull_back

    program = state.program
    uses = [u for u in program.users[cur] if u in inside]
    if not uses:
        return None
    reads = set()
    for u in uses:
        moved = [dst for w, _, dst in op_reshards(state, u) if w == cur]
        rule = state.rules[u]
        if moved:
            reads.add(moved[0])
            continue
        a = program.values[cur]
        b = program.values[rule.results[0].value] if len(rule.results) == 1 else None
        if len(rule.operands) != 1 or b is None or a.numel != b.numel or a.dtype.itemsize != b.dtype.itemsize:
            reads.add(state.shard[cur])  # read as it is
            continue
        res = rule.results[0].value
        made = [dst for w, _, dst in op_reshards(state, u) if w == res]
        if made:  # the view resharded where it is made (`lower.relayout_root`: one collective for its readers)
            got = made[0]
            if any(u2 in inside and any(w == res and dst != got and not (coarsest and _slices(got, dst))
                                        for w, _, dst in op_reshards(state, u2))
                   for u2 in program.users[res]):
                return None  # ... and re-sliced to another sharding by the module
        else:
            got = _read(state, res, inside, coarsest)
        back = None if got is None else pull_back(state, rule, got)
        if back is None:
            return None
        reads.add(back)
    if coarsest:  # (the one read all the others are local slices of)
        reads = {r for r in reads if all(_slices(r, s) for s in reads)}
    return reads.pop() if len(reads) == 1 else None


def _slices(src: Sharding, dst: Sharding) -> bool:
    """Whether `dst` is a local slice of `src`: each dim keeps its axes and may add minor ones, nothing summed
    or chunked (an engine holding `src` makes `dst` with no collective)."""
    return (not src.partial and not dst.partial and not src.chunks and not dst.chunks
            and all(b[:len(a)] == a for a, b in zip(src.dims, dst.dims)))
