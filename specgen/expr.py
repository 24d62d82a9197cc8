"""The expression form of a pointwise stage: a small, closed grammar over `x`.

    expr ::= number | "x" | param | "-" expr | "+" expr | expr ("+"|"-"|"*"|"/") expr
           | expr "**" number | expr (">"|">="|"<"|"<=") expr | func "(" expr {"," expr} ")" | "(" expr ")"

`param` is any other identifier: a learnable per-channel parameter of that name. A comparison
is 1 where it holds and 0 elsewhere (one operator: no chains such as 0 < x < 1);
`where(c, a, b)` is a where c is not 0, else b (torch.where(x > 0, x, 0.2 * x) is
`where(x > 0, x, 0.2 * x)`).
The text is parsed with Python's `ast` (never evaluated) and every node is checked
against the grammar; the checked tree is then printed as CUDA C or walked with torch.
"""

from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass

from specgen.literals import FLOAT32_MAX, c_float, quote

IDENTIFIER = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,62}$")
MAX_LENGTH = 512
# Nesting depth of the parsed tree. 256 admits every flat chain the length allows (x+x+...: 256
# terms); the tree is walked recursively (checked, printed, unparsed), and 511 nested unary minus
# signs overflowed Python's stack.
MAX_DEPTH = 256

# name -> (arity, CUDA spelling as a format string over {0}, {1}, ..., torch reference). A function
# that is also a pointwise op is checked against its row of specgen.ops (`expr_function`):
# ops.expr_function_mismatches() lists any difference in arity, CUDA or PyTorch value.
FUNCTIONS: dict[str, tuple[int, str, str]] = {
    "abs": (1, "fabsf({0})", "abs"),
    "exp": (1, "expf({0})", "exp"),
    "log": (1, "logf({0})", "log"),
    "log1p": (1, "log1pf({0})", "log1p"),
    "expm1": (1, "expm1f({0})", "expm1"),
    "sqrt": (1, "sqrtf({0})", "sqrt"),
    "tanh": (1, "tanhf({0})", "tanh"),
    "erf": (1, "erff({0})", "erf"),
    "sigmoid": (1, "__fdividef(1.0f, 1.0f + expf(-({0})))", "sigmoid"),
    "relu": (1, "fmaxf({0}, 0.0f)", "relu"),
    # PyTorch's softplus at its defaults (beta 1, threshold 20): the identity above 20
    "softplus": (1, "(({0}) > 20.0f ? ({0}) : log1pf(expf({0})))", "softplus"),
    # the value of its argument, with no gradient through it (the backward's recomputation detaches it)
    "detach": (1, "({0})", "detach"),
    "min": (2, "fminf({0}, {1})", "minimum"),
    "max": (2, "fmaxf({0}, {1})", "maximum"),
    "clamp": (3, "fminf(fmaxf({0}, {1}), {2})", "clamp"),
    "where": (3, "(({0}) != 0.0f ? ({1}) : ({2}))", "where"),
}
# Comparisons: 1 where they hold, else 0 (C spelling; torch function)
_COMPARISONS = {ast.Gt: (">", "gt"), ast.GtE: (">=", "ge"), ast.Lt: ("<", "lt"), ast.LtE: ("<=", "le")}
RESERVED = {"x", *FUNCTIONS}


class ExprError(ValueError):
    """An expression outside the grammar; the message says where and what was expected."""


@dataclass(frozen=True)
class Expr:
    """A checked expression: its canonical text and the per-channel parameters it names."""

    text: str
    params: tuple[str, ...]

    @property
    def tree(self) -> ast.expr:
        return ast.parse(self.text, mode="eval").body

    def to_cuda(self, value: str, param_value: dict[str, str]) -> str:
        """C expression with `x` spelled `value` and each parameter spelled `param_value[name]`."""
        return _cuda(self.tree, value, param_value)

    def to_torch(self, x, params: dict):
        """Evaluate on tensor `x` with torch, `params[name]` broadcastable to `x`."""
        return self.torch_function()(x, params)

    def torch_function(self):
        """The expression as nested closures of torch calls (no tree walk at call time, so
        torch.compile traces it)."""
        fn = _compiled.get(self.text)
        if fn is None:
            fn = _compiled[self.text] = _closure(self.tree)
        return fn


_parsed: dict[str, Expr] = {}


def parse_cached(text: str) -> Expr:
    """parse(), memoized by text (ops call this on every use)."""
    hit = _parsed.get(text)
    if hit is None:
        hit = _parsed[text] = parse(text)
    return hit


def parse(text: str) -> Expr:
    if not isinstance(text, str):
        raise ExprError(f"expected a string expression, got {type(text).__name__}")
    if len(text) > MAX_LENGTH:
        raise ExprError(f"expression is {len(text)} characters long; at most {MAX_LENGTH} are allowed")
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, RecursionError, MemoryError, ValueError) as err:
        raise ExprError(f"cannot parse {quote(text)}: {getattr(err, 'msg', err)}") from None
    depth = _depth(tree)
    if depth > MAX_DEPTH:
        raise ExprError(f"expression {quote(text)} is nested {depth} levels deep; at most {MAX_DEPTH} are allowed")
    params: list[str] = []
    _check(tree, params)
    if "x" not in {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}:
        raise ExprError(f"expression {quote(text)} does not use x")
    return Expr(text=ast.unparse(tree), params=tuple(dict.fromkeys(params)))


def _depth(tree: ast.AST) -> int:
    """The tree's depth, without recursion (the tree may be deeper than the checks allow)."""
    deepest, stack = 0, [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node) if isinstance(child, ast.expr))
    return deepest


def _check(node: ast.AST, params: list[str]) -> None:
    where = f"at column {getattr(node, 'col_offset', 0) + 1}"
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise ExprError(f"{where}: only numbers are allowed as literals, got {quote(node.value)}")
        try:
            finite = math.isfinite(node.value) and abs(node.value) <= FLOAT32_MAX
        except OverflowError:  # an int too large for a float
            finite = False
        if not finite:
            raise ExprError(f"{where}: literal {quote(node.value)} is not a finite float32")
    elif isinstance(node, ast.Name):
        if node.id in FUNCTIONS:
            raise ExprError(f"{where}: {node.id} is a function; call it as {node.id}(...)")
        if node.id != "x":
            if not IDENTIFIER.match(node.id):
                raise ExprError(f"{where}: parameter name {quote(node.id)} must match {IDENTIFIER.pattern}")
            params.append(node.id)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        _check(node.operand, params)
    elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        _check(node.left, params)
        _check(node.right, params)
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        _check(node.left, params)
        exponent = node.right
        if not (isinstance(exponent, ast.Constant) and type(exponent.value) is int and 1 <= exponent.value <= 4):
            raise ExprError(f"{where}: '**' takes a whole-number exponent from 1 to 4")
    elif isinstance(node, ast.Compare):
        if len(node.ops) != 1 or type(node.ops[0]) not in _COMPARISONS:
            raise ExprError(f"{where}: a comparison is one of > >= < <= between two expressions (no chains, no ==)")
        _check(node.left, params)
        _check(node.comparators[0], params)
    elif isinstance(node, ast.Call):
        name = node.func.id if isinstance(node.func, ast.Name) else None
        if name not in FUNCTIONS:
            raise ExprError(f"{where}: unknown function {quote(ast.unparse(node.func))}; known: {', '.join(sorted(FUNCTIONS))}")
        arity = FUNCTIONS[name][0]
        if node.keywords or len(node.args) != arity:
            raise ExprError(f"{where}: {name} takes {arity} positional argument(s)")
        for arg in node.args:
            _check(arg, params)
    else:
        raise ExprError(f"{where}: {quote(ast.unparse(node))} is outside the expression grammar")


_C_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


def _cuda(node: ast.expr, value: str, param_value: dict[str, str]) -> str:
    if isinstance(node, ast.Constant):
        return c_float(node.value)
    if isinstance(node, ast.Name):
        return value if node.id == "x" else param_value[node.id]
    if isinstance(node, ast.UnaryOp):
        inner = _cuda(node.operand, value, param_value)
        return f"(-{inner})" if isinstance(node.op, ast.USub) else inner
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        # The base is written once, as the argument of an immediately called lambda that
        # multiplies it out (t * t * t: the same products, in the same order, as torch's
        # reference): spelling the base out n times made nested powers grow exponentially.
        base = _cuda(node.left, value, param_value)
        n = node.right.value
        if n == 1:
            return f"({base})"
        return "([](const float t) { return " + " * ".join(["t"] * n) + "; }(" + base + "))"
    if isinstance(node, ast.BinOp):
        left = _cuda(node.left, value, param_value)
        right = _cuda(node.right, value, param_value)
        return f"({left} {_C_OPS[type(node.op)]} {right})"
    if isinstance(node, ast.Compare):
        left = _cuda(node.left, value, param_value)
        right = _cuda(node.comparators[0], value, param_value)
        return f"({left} {_COMPARISONS[type(node.ops[0])][0]} {right} ? 1.0f : 0.0f)"
    name = node.func.id
    inner = node.args[0] if len(node.args) == 1 else None
    if name == "tanh" and isinstance(inner, ast.Call) and inner.func.id == "softplus":
        return TANH_SOFTPLUS.replace("ARG", _cuda(inner.args[0], value, param_value))
    return FUNCTIONS[name][1].format(*(_cuda(a, value, param_value) for a in node.args))


# tanh(softplus(t)) (mish's factor, often written out): tanh(log1p(e)) = n / (n + 2) with e = exp(t),
# n = e (e + 2), one expf and a division for expf, log1pf and tanhf (as ops' mish). Nothing cancels:
# n / (n + 2) tends to e as t -> -inf; past softplus' threshold (20) it is tanh(t), 1.0f in float32.
TANH_SOFTPLUS = ("([](const float t) { const float e = expf(t), n = e * (e + 2.0f); "
                 "return t > 20.0f ? 1.0f : n / (n + 2.0f); }(ARG))")


_compiled: dict[str, object] = {}


def _closure(node: ast.expr):
    import torch

    if isinstance(node, ast.Constant):
        value = float(node.value)
        return lambda x, p: torch.full((), value, dtype=x.dtype, device=x.device)
    if isinstance(node, ast.Name):
        name = node.id
        return (lambda x, p: x) if name == "x" else (lambda x, p: p[name])
    if isinstance(node, ast.UnaryOp):
        inner = _closure(node.operand)
        return (lambda x, p: -inner(x, p)) if isinstance(node.op, ast.USub) else inner
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        base, n = _closure(node.left), node.right.value

        def power(x, p):
            b = base(x, p)
            result = b
            for _ in range(n - 1):
                result = result * b
            return result

        return power
    if isinstance(node, ast.BinOp):
        left, right = _closure(node.left), _closure(node.right)
        fn = {ast.Add: torch.add, ast.Sub: torch.sub, ast.Mult: torch.mul, ast.Div: torch.div}[type(node.op)]
        return lambda x, p: fn(left(x, p), right(x, p))
    if isinstance(node, ast.Compare):
        left, right = _closure(node.left), _closure(node.comparators[0])
        compare = getattr(torch, _COMPARISONS[type(node.ops[0])][1])

        def comparison(x, p):
            a = left(x, p)
            return compare(a, right(x, p)).to(a.dtype)

        return comparison
    args = [_closure(a) for a in node.args]
    name = FUNCTIONS[node.func.id][2]
    if name == "where":
        c, a, b = args
        return lambda x, p: torch.where(c(x, p) != 0, a(x, p), b(x, p))
    if name == "detach":
        (a,) = args
        return lambda x, p: a(x, p).detach()
    if name == "softplus":
        (a,) = args
        return lambda x, p: torch.nn.functional.softplus(a(x, p))
    if name == "clamp":
        a, lo, hi = args
        return lambda x, p: torch.minimum(torch.maximum(a(x, p), lo(x, p)), hi(x, p))
    fn = getattr(torch, name)
    return lambda x, p: fn(*(f(x, p) for f in args))
