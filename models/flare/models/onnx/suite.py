"""ONNX's backend test suite, as pytest and the scoreboard script run it.

`build(backend_cls)` makes an `onnx.backend.test.BackendTest` over any ONNX
backend (Flare's, or `onnxruntime.backend` for the comparison) and `items()`
lists its CPU tests by category; `run_item` runs one exactly as the suite's
own unittest runner would (its comparison, its tolerances). Exclusions live in
one file, `backend_test_exclusions.txt`, one regular expression and a reason
per line.
"""
from __future__ import annotations

import re
import unittest
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EXCLUSIONS_FILE = Path(__file__).with_name("backend_test_exclusions.txt")
CATEGORIES = {"NodeModel": "node", "SimpleModel": "simple", "PyTorchConvertedModel": "pytorch-converted",
              "PyTorchOperatorModel": "pytorch-operator", "RealModel": "real"}
# the bounded subset run on non-CPU backends in CI (lavapipe is slow): common ops, no _expanded variants
DEVICE_SUBSET = re.compile(r"^test_(add|sub|mul|div|relu|sigmoid|tanh|exp|sqrt|neg|matmul_2d|gemm_default|softmax_axis|"
                           r"layer_normalization_2d|reduce_mean_default|reduce_sum_default|transpose_default|concat_2d|"
                           r"reshape_reduced|gather_0|slice$|conv_with_strides_padding|maxpool_2d_default|"
                           r"averagepool_2d_default|batchnorm_example|where_example|equal$|clip$|erf|cast_FLOAT_to_INT)")


@dataclass(frozen=True)
class Item:
    category: str      # the suite's TestCase class name (NodeModel, SimpleModel, ...)
    method: str        # test_abs_cpu
    fp32_class: bool   # inputs and outputs float32/int64/int32/bool, default domain (node tests only)

    @property
    def name(self) -> str:
        return self.method[: -len("_cpu")] if self.method.endswith("_cpu") else self.method

    @property
    def kind(self) -> str:
        return CATEGORIES.get(self.category, self.category)


def build(backend_cls: Any) -> Any:
    """A BackendTest over `backend_cls` (loads ~2,000 test cases: a few seconds)."""
    import warnings

    from onnx.backend.test import BackendTest

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the suite's data generators warn about their own edge cases
        return BackendTest(backend_cls, __name__)


def items(backend_test: Any) -> list[Item]:
    out = []
    for category, tests in backend_test._test_items.items():
        for method, item in tests.items():
            if method.endswith("_cpu"):
                out.append(Item(category, method, _fp32_class(item)))
    return sorted(out, key=lambda i: (i.category, i.method))


def _fp32_class(item: Any) -> bool:
    """Node tests whose graph inputs and outputs are float32/int64/int32/bool, default domain."""
    from onnx import TensorProto

    func = getattr(item.func, "__wrapped__", item.func)
    closure = dict(zip(func.__code__.co_freevars, (c.cell_contents for c in func.__closure__ or ())))
    case = closure.get("model_test")
    model = getattr(case, "model", None)
    if model is None:
        return False
    ok = {TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32, TensorProto.BOOL}
    g = model.graph
    values = list(g.input) + list(g.output)
    return all(v.type.HasField("tensor_type") and v.type.tensor_type.elem_type in ok for v in values) \
        and all(n.domain in ("", "ai.onnx") for n in g.node)


def run_item(backend_test: Any, item: Item) -> None:
    """Run one test as unittest would; raises on failure, unittest.SkipTest on skip."""
    cases = backend_test.__dict__.get("_flare_test_cases")
    if cases is None:  # the property builds fresh classes on every access: once is enough
        cases = backend_test._flare_test_cases = backend_test.test_cases
    case_cls = cases[f"OnnxBackend{item.category}Test"]
    getattr(case_cls(item.method), item.method)()


def load_exclusions(path: Path = EXCLUSIONS_FILE) -> list[tuple[re.Pattern, str]]:
    """(pattern, reason) per line `REGEX  # reason`; a line without a reason is an error."""
    rules = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        pattern, sep, reason = line.partition(" # ")
        if not sep or not reason.strip():
            raise ValueError(f"{path.name}:{number}: an exclusion needs ' # reason'")
        rules.append((re.compile(pattern.strip()), reason.strip()))
    return rules


def excluded(name: str, rules: list[tuple[re.Pattern, str]]) -> str | None:
    """The reason `name` is excluded, or None."""
    for pattern, reason in rules:
        if pattern.search(name):
            return reason
    return None


def outcome(backend_test: Any, item: Item) -> tuple[str, str]:
    """('passed'|'failed'|'skipped', detail) of one test."""
    try:
        run_item(backend_test, item)
    except unittest.SkipTest as exc:
        return "skipped", str(exc)
    except Exception as exc:  # a failing test of the suite, whatever it raised
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return "failed", f"{type(exc).__name__}: {first}"[:300]
    return "passed", ""


EXCLUSIONS_HEADER = (
    "# ONNX backend test suite exclusions for Flare: one regular expression per line, ' # ' and the reason.\n"
    "# Written by `python scripts/onnx_scoreboard.py --backend cpu --write-exclusions` from the tests that fail\n"
    "# on the CPU; the pytest matrix (tests/test_onnx_backend_suite.py) skips these with their reason and\n"
    "# requires every other test to pass. Rerun it when tests start to pass.\n")
REAL_MODELS = r"^test_(bvlc_alexnet|densenet121|inception_v1|inception_v2|resnet50|shufflenet|squeezenet|vgg19|zfnet512)$"


def exclusion_reason(detail: str) -> str:
    """Why a test fails, in words a reader of the exclusions file can act on (one per cause)."""
    m = re.search(r"unsupported ONNX op\(s\): (.*)", detail)
    if m:
        ops = sorted({op.split(" (node")[0].strip() for op in m.group(1).split("), ") if op.strip()})
        return f"no lowering for {', '.join(ops)}"
    if "dtype object" in detail:
        return "strings: not a Flare dtype"
    m = re.search(r"dtype (\w+) has no Flare equivalent|cast to (\w+) is not supported", detail)
    if m:
        return f"dtype {m.group(1) or m.group(2)}: neither a Flare dtype nor carried by one (values.CARRIER)"
    if re.search(r"\d-D spatial input \(\d+, \d+, \d+, \d+, \d+\)|3-D ConvTranspose", detail):
        return "3-D convolution/pooling (rank-5 tensors)"
    if "rank" in detail and ("<= 4" in detail or "needs rank" in detail):
        return "tensors of rank > 4 (Flare's limit) beyond reshape/expand/elementwise"
    if "zero-size" in detail:
        return "zero-size tensors"
    if re.search(r"sequence|optional|'list' object|declares 0 \(\[\]\)", detail, re.I):
        return "optional / sequence values (tensors only)"
    if detail.startswith("AssertionError"):
        return "results differ beyond the suite's tolerance (random ops, float64 data past float32's range, or a lowering gap)"
    m = re.search(r"\((\w+)\): (.*)", detail)
    if m:
        return f"{m.group(1)}: {re.sub(r'[0-9]+', 'N', m.group(2))[:120]}"
    return f"error {detail.split(':')[0]}"


def write_exclusions(failures: list[tuple[str, str]], path: Path = EXCLUSIONS_FILE, per_line: int = 12) -> None:
    """Rewrite the exclusions file: the failing tests grouped by exclusion_reason, `per_line` names a line
    (written to a temporary file, then renamed: never half-written)."""
    real = re.compile(REAL_MODELS)
    groups: dict[str, list[str]] = {}
    for name, detail in failures:
        if not real.search(name):
            groups.setdefault(exclusion_reason(detail), []).append(name)
    lines = [EXCLUSIONS_HEADER.rstrip("\n"), f"{REAL_MODELS} # the 'real' models download their weights (no network in CI)"]
    for reason, names in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        names = sorted(names)
        for i in range(0, len(names), per_line):
            lines.append(f"^({'|'.join(re.escape(n) for n in names[i:i + per_line])})$ # {reason.replace(' # ', ' ')}")
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)
