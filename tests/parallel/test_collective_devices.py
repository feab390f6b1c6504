"""Every tensor meshtron hands to a collective lives on the mesh's device (issue 18, finding 1).

Under NCCL a CPU tensor in a collective raises "No backend type associated with device type cpu";
gloo accepts it, so on this CPU machine no multi-rank run can show the fault: the mesh's device *is*
the CPU, and a runtime check `tensor.device == mesh device` passes whatever the code does. This test
is therefore static, and cannot pass vacuously on CPU: it reads every module of meshtron with `ast`,
finds each collective (the `torch.distributed` ones, and meshtron's own functions that pass a
parameter on to one, found to a fixed point), and follows each tensor argument back through the
function's assignments. The argument fails when it is built by a tensor factory (`torch.tensor`,
`torch.zeros`, ...) without `device=`, or with a CPU device, or passes through `.cpu()`/`.numpy()`/
`.to("cpu")`. Tensors that come from outside the function (parameters, attributes: gradients,
activations) are on the model's device already; so are values returned by other functions (not
followed: a helper that returns a CPU tensor for a collective is a blind spot, as are tensors put
into containers by mutation). `test_checker_catches_*` feed it the code issue 18 found, so a checker
that stopped seeing those patterns fails here too. Under MESHTRON_TEST_BACKEND=nccl (see
meshtron/testing/multiprocess.py) the multi-rank tests check the same at run time, on GPUs.

A line may opt out with `# collective-device: <why>` (e.g. a group created with backend="gloo"), on the
collective's line or on the line that builds the tensor.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import meshtron

TORCH_COLLECTIVES = {  # name -> positions of tensor arguments
    "all_reduce": (0,), "broadcast": (0,), "reduce": (0,), "send": (0,), "recv": (0,), "isend": (0,),
    "irecv": (0,), "all_gather": (0, 1), "all_gather_into_tensor": (0, 1), "reduce_scatter": (0, 1),
    "reduce_scatter_tensor": (0, 1), "reduce_scatter_single": (0, 1), "all_gather_single": (0, 1),
    "all_to_all": (0, 1), "all_to_all_single": (0, 1), "gather": (0, 1), "scatter": (0, 1),
    "all_reduce_coalesced": (0,), "all_gather_coalesced": (0, 1), "P2POp": (1,),
}
TENSOR_KEYWORDS = {"tensor", "output", "input", "tensor_list", "output_tensor_list", "input_tensor_list",
                   "output_tensor", "input_tensor", "gather_list", "scatter_list"}
FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "linspace", "rand", "randn",
             "randint", "from_numpy", "eye"}
HOST_METHODS = {"cpu", "numpy"}
DIST_MODULES = {"dist", "torch.distributed"}
OPT_OUT = "# collective-device:"


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _is_cpu(node: ast.AST) -> bool:
    """A literal CPU device: "cpu", torch.device("cpu")."""
    if isinstance(node, ast.Constant):
        return node.value == "cpu"
    if isinstance(node, ast.Call) and _dotted(node.func) == "torch.device" and node.args:
        return _is_cpu(node.args[0])
    return False


class FunctionFlow:
    """Assignments of one function, to follow a name back to what built it."""

    def __init__(self, fn: ast.FunctionDef | ast.AsyncFunctionDef):
        self.params = {a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs}
        self.sources: dict[str, list[ast.AST]] = {}  # name -> the values bound to it, in any order
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    self._bind(target, node.value)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and node.value is not None:
                self._bind(node.target, node.value)
            elif isinstance(node, (ast.For, ast.comprehension)):
                self._bind(node.target, node.iter)
            elif isinstance(node, ast.NamedExpr):
                self._bind(node.target, node.value)

    def _bind(self, target: ast.AST, value: ast.AST) -> None:
        if isinstance(target, ast.Name):
            self.sources.setdefault(target.id, []).append(value)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for t in target.elts:  # (a, b) = ...: each name comes from the whole value
                self._bind(t, value)

    def trace(self, expr: ast.AST, before: int, opted_out: set[int]) -> tuple[list[str], set[str]]:
        """(problems, parameters reached) of a tensor expression used at line `before`: names are
        followed to the values bound to them on earlier lines (what a later line binds cannot reach
        it, loops aside); a problem on a line in `opted_out` is not reported."""
        seen: set[str] = set()
        problems: list[str] = []
        params: set[str] = set()

        def visit(node: ast.AST) -> None:
            if isinstance(node, ast.Name):
                if node.id in seen:
                    return
                seen.add(node.id)
                if node.id in self.params and not any(v.lineno < before for v in self.sources.get(node.id, [])):
                    params.add(node.id)
                for value in self.sources.get(node.id, []):
                    if value.lineno < before:
                        visit(value)
                return
            if isinstance(node, ast.Call):
                name = _dotted(node.func)
                kwargs = {k.arg: k.value for k in node.keywords}
                if name.startswith("torch.") and name.split(".")[-1] in FACTORIES and name.count(".") == 1:
                    if "device" not in kwargs:
                        problems.append(f"line {node.lineno}: {name}(...) without device=")
                    elif _is_cpu(kwargs["device"]):
                        problems.append(f"line {node.lineno}: {name}(..., device='cpu')")
                    return  # a factory with a device: its other arguments (sizes, values) are no tensors here
                if isinstance(node.func, ast.Attribute):
                    method = node.func.attr
                    if method in HOST_METHODS:
                        problems.append(f"line {node.lineno}: .{method}() moves it to the host")
                        return
                    if method == "to":
                        moved = list(node.args) + [kwargs[k] for k in ("device",) if k in kwargs]
                        if any(_is_cpu(a) for a in moved):
                            problems.append(f"line {node.lineno}: .to('cpu') moves it to the host")
                            return
                        if "device" in kwargs or any(not _dotted(a).startswith("torch.") for a in node.args):
                            return  # moved to a device the code named
                    visit(node.func.value)  # x.float(), x.contiguous(), x.new_zeros(...): x's device
                for a in node.args:
                    visit(a)
                return
            if isinstance(node, (ast.Attribute, ast.Constant, ast.Lambda)):
                return  # self.x, p.grad: made elsewhere, on the model's device
            for child in ast.iter_child_nodes(node):
                visit(child)

        visit(expr)
        return [p for p in problems if int(p.split(":")[0].split()[1]) not in opted_out], params


def _functions(tree: ast.AST):
    """(function, the name its callers use): `Class.apply` for an autograd Function's forward."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "forward" and any(
                        _dotted(b).endswith("Function") for b in node.bases):
                    yield fn, node.name
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name != "forward":
            yield node, node.name


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Attribute):
        return _dotted(func.value).split(".")[-1] if func.attr == "apply" else func.attr
    return func.id if isinstance(func, ast.Name) else None


def _tensor_args(call: ast.Call, wrappers: dict[str, tuple[int, ...]]) -> list[ast.AST]:
    """The arguments of `call` that a collective sends or fills (none if it is no collective)."""
    func = call.func
    if isinstance(func, ast.Attribute) and _dotted(func.value) in DIST_MODULES:
        positions, keywords = TORCH_COLLECTIVES.get(func.attr, ()), TENSOR_KEYWORDS
    else:
        positions, keywords = wrappers.get(_called_name(call), ()), set()
    args = [call.args[i] for i in positions if i < len(call.args)]
    return args + [k.value for k in call.keywords if positions and k.arg in keywords]


def check_sources(sources: dict[str, str]) -> list[str]:
    """Problems of every collective in `sources` ({file name: code}), as 'file: function: problem'."""
    trees = {name: ast.parse(code) for name, code in sources.items()}
    lines = {name: code.splitlines() for name, code in sources.items()}
    opted_out = {name: {i + 1 for i, line in enumerate(code) if OPT_OUT in line} for name, code in lines.items()}
    functions = []
    for file, tree in trees.items():
        for fn, called_as in _functions(tree):
            calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and OPT_OUT not in lines[file][n.lineno - 1]]
            functions.append((file, fn, called_as, FunctionFlow(fn), calls))
    wrappers: dict[str, tuple[int, ...]] = {}
    while True:  # functions passing a parameter on to a collective are collectives too, to a fixed point
        problems, found = [], dict(wrappers)
        for file, fn, called_as, flow, calls in functions:
            positional = [a.arg for a in fn.args.posonlyargs + fn.args.args]
            offset = 1 if positional[:1] in (["self"], ["cls"], ["ctx"]) else 0
            for call in calls:
                for arg in _tensor_args(call, wrappers):
                    bad, params = flow.trace(arg, call.lineno, opted_out[file])
                    problems += [f"{file}: {fn.name}: {p}" for p in bad]
                    reached = {positional.index(p) - offset for p in params if p in positional[offset:]}
                    if reached - set(found.get(called_as, ())):
                        found[called_as] = tuple(sorted(reached | set(found.get(called_as, ()))))
        if found == wrappers:
            return sorted(set(problems))
        wrappers = found


def package_sources() -> dict[str, str]:
    root = Path(meshtron.__file__).parent
    return {str(p.relative_to(root.parent)): p.read_text() for p in sorted(root.rglob("*.py"))}


def test_every_collective_gets_tensors_on_the_mesh_device():
    problems = check_sources(package_sources())
    assert not problems, "tensors built off the mesh's device reach a collective:\n" + "\n".join(problems)


# ---- the checker sees the faults issue 18 found (the code as it was) --------------------------------

OLD_CODE = {
    "trainer_global_sum": """
        def all_reduce_sum(value, group):
            if group is not None:
                dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
            return value

        class Trainer:
            def _global_sum(self, value):
                return float(all_reduce_sum(torch.tensor(value, dtype=torch.float64), self.group("dp_cp")))
        """,
    "trainer_cp_evaluation": """
        def all_reduce_sum(value, group):
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
            return value

        def evaluate(self, loss_sum, tokens):
            pair = all_reduce_sum(torch.tensor([loss_sum, tokens], dtype=torch.float64), self.group("cp"))
        """,
    "clip": """
        def global_grad_norm(parameters, pp_group=None):
            squared = torch.zeros((), dtype=torch.float32)
            for grads in groups.values():
                norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
                squared = squared + norm.float().cpu() ** 2
            norm = squared.sqrt()
            if pp_group is not None:
                squared = norm ** 2
                dist.all_reduce(squared, group=pp_group)
        """,
    "clip_cpu_only": """
        def global_grad_norm(parameters, pp_group=None, device=None):
            squared = torch.zeros((), dtype=torch.float32, device=device)
            for grads in groups.values():
                norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
                squared = squared + norm.float().cpu() ** 2
            dist.all_reduce(squared, group=pp_group)
        """,
    "watchdog_stragglers": """
        def step_time_extremes(seconds, group=None):
            times = torch.zeros(dist.get_world_size(group), dtype=torch.float64)
            dist.all_gather_into_tensor(times, torch.tensor([seconds], dtype=torch.float64), group=group)
        """,
    "grpo": """
        def all_reduce(values, op=None, group=None):
            t = torch.tensor(values, dtype=torch.float64)
            dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=group)
            return t.tolist()
        """,
    "explicit_cpu": """
        def f(x, group):
            y = x.to("cpu")
            dist.broadcast(y, group=group, group_src=0)
        """,
}


def _check(code: str) -> list[str]:
    return check_sources({"old.py": textwrap.dedent(code)})


def test_checker_catches_each_fault_issue_18_found():
    for name, code in OLD_CODE.items():
        assert _check(code), f"the checker does not see the CPU tensor in {name}"


def test_checker_accepts_tensors_on_the_device():
    fixed = """
        def all_reduce_sum(value, group):
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
            return value

        def step(self, grads, value, device, group):
            total = torch.tensor(value, dtype=torch.float64, device=self.device)
            all_reduce_sum(total, group)
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=group)
            times = torch.zeros(4, device=device)
            dist.all_gather_into_tensor(times, torch.tensor([1.0], device=device).to(torch.float64), group=group)
            local = self.weight.grad.to_local()
            dist.all_reduce(local)
            buffer = torch.empty_like(local)
            dist.recv(buffer, group_src=0)
            dist.send(torch.zeros(2).cpu(), 1)  # collective-device: a gloo-only group (test of the opt-out)
        """
    assert _check(fixed) == []


def test_checker_follows_wrappers_across_functions():
    """A helper that passes its argument on to a collective is checked at its call sites, through chains."""
    code = """
        def inner(value, group):
            dist.all_reduce(value, group=group)

        def outer(self, x, group):
            inner(x, group)

        def caller(self):
            self.outer(torch.ones(3), None)
        """
    problems = _check(code)
    assert len(problems) == 1 and "caller" in problems[0] and "torch.ones" in problems[0]
