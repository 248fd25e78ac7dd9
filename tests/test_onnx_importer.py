"""The ONNX importer on small models built here: results against onnxruntime, host steps,
plan caching, `flare run/describe MODEL.onnx`, and malformed files (exit 2, one line)."""
from __future__ import annotations

import os

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from flare.core import cli  # noqa: E402
from flare.core.plugin_manager import get_plugin_manager  # noqa: E402
from flare.models.onnx import plugin as onnx_plugin  # noqa: E402
from flare.models.onnx.errors import OnnxError, UnsupportedOpError  # noqa: E402
from flare.models.onnx.loader import load_model  # noqa: E402
from flare.models.onnx.runner import OnnxRunner  # noqa: E402

RNG = np.random.default_rng(0)


@pytest.fixture(scope="module", autouse=True)
def registered():
    """The plugin as its entry point registers it (also when this checkout is not installed)."""
    pm = get_plugin_manager()
    added = not pm.pm.is_registered(onnx_plugin)
    if added:
        pm.register(onnx_plugin, name="flare.models.onnx.plugin")
    yield
    if added:
        pm.pm.unregister(onnx_plugin)
        pm._backends = pm._models = pm._commands = None


def save(model, path) -> str:
    onnx.save(model, str(path))
    return str(path)


def mlp_model():
    """Gemm -> Relu -> Reshape by a computed Shape -> Softmax -> ReduceMean, opset 18."""
    w = RNG.standard_normal((8, 6)).astype(np.float32)
    b = RNG.standard_normal(8).astype(np.float32)
    nodes = [
        helper.make_node("Gemm", ["x", "w", "b"], ["h"], transB=1),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
        helper.make_node("Concat", ["n1", "two", "four"], ["target"], axis=0),
        helper.make_node("Unsqueeze", ["n", "zero1"], ["n1"]),
        helper.make_node("Reshape", ["r", "target"], ["r3"]),
        helper.make_node("Softmax", ["r3"], ["p"], axis=1),
        helper.make_node("ReduceMean", ["p", "axes"], ["y"], keepdims=0),
    ]
    nodes = [nodes[0], nodes[1], nodes[2], nodes[3], nodes[5], nodes[4], nodes[6], nodes[7], nodes[8]]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b"),
             numpy_helper.from_array(np.array(0, np.int64), "zero"),
             numpy_helper.from_array(np.array([0], np.int64), "zero1"),
             numpy_helper.from_array(np.array([2], np.int64), "two"),
             numpy_helper.from_array(np.array([4], np.int64), "four"),
             numpy_helper.from_array(np.array([2], np.int64), "axes")]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 6])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def nonzero_model():
    """NonZero (output length depends on the data) feeding a Gather and a cast: a host step."""
    nodes = [helper.make_node("Greater", ["x", "thr"], ["m"]),
             helper.make_node("NonZero", ["m"], ["idx2"]),
             helper.make_node("Squeeze", ["idx2", "zero1"], ["idx"]),
             helper.make_node("Gather", ["x", "idx"], ["picked"], axis=0),
             helper.make_node("Mul", ["picked", "picked"], ["y"])]
    inits = [numpy_helper.from_array(np.array(0.0, np.float32), "thr"),
             numpy_helper.from_array(np.array([0], np.int64), "zero1")]
    g = helper.make_graph(nodes, "nz", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["k"])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def ort_run(model, feeds):
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def test_mlp_matches_onnxruntime_and_reuses_its_plan(backend, tmp_path):
    model = mlp_model()
    path = save(model, tmp_path / "mlp.onnx")
    with backend.session(*([] if backend.name == "cpu" else ["cpu"])) as sess:
        runner = OnnxRunner(load_model(path), sess)
        for batch in (3, 5, 3):
            x = RNG.standard_normal((batch, 6)).astype(np.float32)
            got = runner.run({"x": x})["y"]
            want = ort_run(model, {"x": x})[0]
            # f32 GEMM of length 6, softmax over 2 and a mean over 4: a few ulp
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert runner.stats["prepared"] == 2  # one plan per input shape; batch 3 again reuses its plan
        assert runner.stats["host_steps"] == 0  # the Shape -> Gather -> Reshape chain folded at import
        runner.release()


def pad_conv_model(shared: bool):
    """Pow(x, 2) -> a zero Pad of the length axis -> 1-D Conv (VITS's FFN); `shared`: the padded
    value is also an output, so the Pad must still run."""
    w = RNG.standard_normal((4, 3, 3)).astype(np.float32)
    b = RNG.standard_normal(4).astype(np.float32)
    nodes = [helper.make_node("Pow", ["x", "two"], ["sq"]),
             helper.make_node("Pad", ["sq", "pads"], ["padded"]),
             helper.make_node("Conv", ["padded", "w", "b"], ["y"], kernel_shape=[3], pads=[1, 0])]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b"),
             numpy_helper.from_array(np.array(2.0, np.float32), "two"),
             numpy_helper.from_array(np.array([0, 0, 2, 0, 0, 1], np.int64), "pads")]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, "m"])]
    if shared:
        outs.append(helper.make_tensor_value_info("padded", TensorProto.FLOAT, [1, 3, "p"]))
    g = helper.make_graph(nodes, "padconv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, "n"])],
                          outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 15)])


@pytest.mark.parametrize("shared", [False, True], ids=["pad-folded", "pad-also-read"])
def test_zero_pad_joins_its_conv_and_square_is_a_multiply(backend, tmp_path, shared):
    model = pad_conv_model(shared)
    path = save(model, tmp_path / "padconv.onnx")
    x = RNG.standard_normal((1, 3, 11)).astype(np.float32)
    with backend.session(*([] if backend.name == "cpu" else ["cpu"])) as sess:
        runner = OnnxRunner(load_model(path), sess)
        got = runner.run({"x": x})
        want = ort_run(model, {"x": x})
        # a 9-term f32 dot product per output: a few ulp (x ** 2 is x * x exactly on both)
        np.testing.assert_allclose(got["y"], want[0], rtol=1e-5, atol=1e-5)
        if shared:
            np.testing.assert_array_equal(got["padded"], want[1])
        ops = [t.op for pg in runner.prepared_graphs() for t in pg.plans.current["main"].graph.nodes]
        assert "pow" not in ops and "mul" in ops
        # the conv pads as it reads; a Pad nothing else reads is not run (a one-axis Pad is a concat)
        assert ("pad" in ops or "concat" in ops) == shared
        runner.release()


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge"])
def test_one_axis_pad_modes_match_onnxruntime(backend, tmp_path, mode):
    """A Pad of one axis (a concatenation with constant pieces when constant, else the pad op)."""
    nodes = [helper.make_node("Pad", ["x", "pads", "value"], ["y"], mode=mode)]
    inits = [numpy_helper.from_array(np.array([0, 0, 2, 0, 0, 3], np.int64), "pads"),
             numpy_helper.from_array(np.array(1.5, np.float32), "value")]
    g = helper.make_graph(nodes, "pad1", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, "n"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, "m"])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 15)])
    path = save(model, tmp_path / "pad1.onnx")
    x = RNG.standard_normal((1, 3, 7)).astype(np.float32)
    with backend.session(*([] if backend.name == "cpu" else ["cpu"])) as sess:
        runner = OnnxRunner(load_model(path), sess)
        np.testing.assert_array_equal(runner.run({"x": x})["y"], ort_run(model, {"x": x})[0])  # copies: exact
        runner.release()


@pytest.mark.parametrize("from_file", [True, False], ids=["initializer", "computed"])
def test_product_by_a_constant_matrix_is_a_linear_layer(backend, tmp_path, from_file):
    """A [1, 2, M, K] @ B [1, 1, K, N] constant (VITS's relative-position attention): one
    product by B transposed, the layout backends pre-pack (`transpose_b`)."""
    b = RNG.standard_normal((1, 1, 6, 5)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["a", "b" if from_file else "bb"], ["y"])]
    if not from_file:  # computed from the input's shape: a constant of the trace, not of the file
        nodes[:0] = [helper.make_node("Shape", ["a"], ["s"]),
                     helper.make_node("Slice", ["s", "zero", "one"], ["s0"]),
                     helper.make_node("Cast", ["s0"], ["s0f"], to=TensorProto.FLOAT),
                     helper.make_node("Mul", ["b", "s0f"], ["bb"])]
    inits = [numpy_helper.from_array(b, "b"), numpy_helper.from_array(np.array([0], np.int64), "zero"),
             numpy_helper.from_array(np.array([1], np.int64), "one")]
    g = helper.make_graph(nodes, "mm", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, 2, "m", 6])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, "m", 5])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 15)])
    path = save(model, tmp_path / "mm.onnx")
    with backend.session(*([] if backend.name == "cpu" else ["cpu"])) as sess:
        runner = OnnxRunner(load_model(path), sess)
        for m in (3, 4):
            a = RNG.standard_normal((1, 2, m, 6)).astype(np.float32)
            # 6-term f32 dot products: a few ulp
            np.testing.assert_allclose(runner.run({"a": a})["y"], ort_run(model, {"a": a})[0], rtol=1e-5, atol=1e-5)
        nodes = [t for pg in runner.prepared_graphs() for t in pg.plans.current["main"].graph.nodes if t.op == "matmul"]
        assert nodes and all(t.params["transpose_b"] and t.srcs[1].shape == (5, 6) for t in nodes)
        runner.release()


def uniform_constants_model():
    """VITS's flow without a speaker: x + zeros(shape(x)), that times exp(zeros) (ones), and
    x * (zeros + 3) (a uniform constant that is no neutral element)."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("ConstantOfShape", ["s"], ["zeros"],
                              value=numpy_helper.from_array(np.array([0.0], np.float32))),
             helper.make_node("Add", ["x", "zeros"], ["a"]),
             helper.make_node("Exp", ["zeros"], ["ones"]),
             helper.make_node("Mul", ["ones", "a"], ["m"]),
             helper.make_node("Add", ["zeros", "three"], ["threes"]),
             helper.make_node("Mul", ["m", "threes"], ["y"])]
    inits = [numpy_helper.from_array(np.array(3.0, np.float32), "three")]
    g = helper.make_graph(nodes, "uniform", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, "n"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, "n"])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 15)])


def test_uniform_constants_are_neither_uploaded_nor_added(backend, tmp_path):
    model = uniform_constants_model()
    path = save(model, tmp_path / "uniform.onnx")
    with backend.session(*([] if backend.name == "cpu" else ["cpu"])) as sess:
        runner = OnnxRunner(load_model(path), sess)
        for n in (50, 70):
            x = RNG.standard_normal((1, 4, n)).astype(np.float32)
            np.testing.assert_array_equal(runner.run({"x": x})["y"], ort_run(model, {"x": x})[0])  # x * 3 exactly
        for pg in runner.prepared_graphs():
            g = pg.plans.current["main"].graph
            assert [t.op for t in g.nodes] == ["mul"]  # + 0 and * 1 are gone, * 3 broadcasts one element
            assert all(t.data.size == 1 for t in g.tensors if t.role == "weight")
        runner.release()


def test_data_dependent_shape_splits_the_graph_at_a_host_step(backend, tmp_path):
    model = nonzero_model()
    path = save(model, tmp_path / "nz.onnx")
    with backend.session(*([] if backend.name == "cpu" else ["cpu"])) as sess:
        runner = OnnxRunner(load_model(path), sess)
        for x in (np.array([1.0, -2.0, 3.0, 0.5], np.float32), np.array([-1.0, 2.0], np.float32)):
            got = runner.run({"x": x})["y"]
            np.testing.assert_array_equal(got, ort_run(model, {"x": x})[0])
        assert runner.stats["host_steps"] >= 2
        assert len(runner.last_segments) == 2  # Greater before NonZero, Gather/Mul after it
        runner.release()


def test_unsupported_op_is_named_with_its_node(tmp_path):
    g = helper.make_graph([helper.make_node("Einsum", ["x"], ["y"], name="the_einsum", equation="ij->ji")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])])
    path = save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "einsum.onnx")
    with pytest.raises(UnsupportedOpError, match=r"Einsum \(node 'the_einsum'\)"):
        OnnxRunner(load_model(path), None)


def test_a_wide_computed_value_is_refused_where_an_op_cannot_take_it(tmp_path):
    """Rank-5 values pass same-shape elementwise ops; Softmax of one is refused naming node and value."""
    shape = [1, 2, 3, 2, 2]
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["r"], name="relu"),
                           helper.make_node("Add", ["r", "x"], ["s"], name="add"),
                           helper.make_node("Softmax", ["s"], ["y"], name="the_softmax", axis=-1)], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)])
    path = save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "wide.onnx")
    from flare.core.session import Session

    with Session(["cpu"]) as sess:
        runner = OnnxRunner(load_model(path), sess)
        try:
            with pytest.raises(OnnxError, match=r"node 'the_softmax' \(Softmax\): input 's' has rank 5"):
                # its own generator: RNG's draws are what later tests' inputs are
                runner.run({"x": np.random.default_rng(5).standard_normal(shape).astype(np.float32)})
        finally:
            runner.release()


def test_cli_run_writes_outputs_and_describe_reports_segments(tmp_path, capsys):
    path = save(nonzero_model(), tmp_path / "nz.onnx")
    x = np.array([1.0, -2.0, 3.0], np.float32)
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "out"
    assert cli.main(["run", path, "--input", f"x={tmp_path / 'x.npy'}", "-o", str(out), "--json"]) == 0
    np.testing.assert_array_equal(np.load(out / "y.npy"), np.array([1.0, 9.0], np.float32))
    capsys.readouterr()
    (tmp_path / "in.json").write_text('{"x": [2.0, -1.0]}')
    assert cli.main(["run", path, "--inputs", str(tmp_path / "in.json")]) == 0
    assert "y: float32 (1,)" in capsys.readouterr().out
    mlp = save(mlp_model(), tmp_path / "mlp.onnx")
    assert cli.main(["describe", mlp, "--option", "x=[4,6]"]) == 0
    text = capsys.readouterr().out
    assert "opset 18" in text and "segment 0" in text and "Gemm 1" in text


def _error_line(capsys, argv) -> str:
    code = cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("error:"), err
    return err[0]


def test_malformed_files_exit_2_with_one_line_naming_what(tmp_path, capsys):
    good = mlp_model()
    path = save(good, tmp_path / "m.onnx")
    blob = open(path, "rb").read()
    (tmp_path / "trunc.onnx").write_bytes(blob[: len(blob) // 2])
    assert "trunc.onnx" in _error_line(capsys, ["run", str(tmp_path / "trunc.onnx")])

    old = onnx.ModelProto()
    old.CopyFrom(good)
    old.ir_version = 2
    assert "IR version 2" in _error_line(capsys, ["run", save(old, tmp_path / "ir.onnx")])

    missing = onnx.ModelProto()
    missing.CopyFrom(good)
    missing.graph.node[1].input[0] = "nowhere"
    missing.graph.node[1].name = "relu_node"
    line = _error_line(capsys, ["run", save(missing, tmp_path / "missing.onnx")])
    assert "relu_node" in line and "nowhere" in line

    short = onnx.ModelProto()
    short.CopyFrom(good)
    short.graph.initializer[0].raw_data = short.graph.initializer[0].raw_data[:20]
    assert "'w'" in _error_line(capsys, ["run", save(short, tmp_path / "short.onnx")])

    ext = onnx.ModelProto()
    ext.CopyFrom(good)
    t = ext.graph.initializer[0]
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    entry = t.external_data.add()
    entry.key, entry.value = "location", "../secret.bin"
    (tmp_path.parent / "secret.bin").write_bytes(b"\0" * 4096)
    line = _error_line(capsys, ["run", save(ext, tmp_path / "ext.onnx")])
    assert "'w'" in line and "outside the model's folder" in line
    assert not (tmp_path / "out").exists()


def test_unsupported_op_on_the_command_line(tmp_path, capsys):
    g = helper.make_graph([helper.make_node("Einsum", ["x"], ["y"], name="the_einsum", equation="ij->ji")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])])
    path = save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "einsum.onnx")
    line = _error_line(capsys, ["run", path])
    assert "Einsum (node 'the_einsum')" in line and "UnsupportedOpError" in line


def test_input_errors_name_the_input(tmp_path, capsys):
    path = save(mlp_model(), tmp_path / "m.onnx")
    assert "'x'" in _error_line(capsys, ["run", path])  # symbolic batch: must be given
    np.save(tmp_path / "bad.npy", np.zeros((2, 6), np.float64))
    assert "float64" in _error_line(capsys, ["run", path, "--input", f"x={tmp_path / 'bad.npy'}"])


def test_bench_workload_compares_flare_with_onnxruntime(tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    save(mlp_model(), tmp_path / "mlp.onnx")
    (tmp_path / "in.json").write_text('{"x": ' + str(RNG.standard_normal((4, 6)).round(3).tolist()) + "}")
    for name, extra in (("a", 'peer = "onnxruntime"\n'), ("b", 'backends = ["cpu"]\n')):
        (tmp_path / f"{name}.toml").write_text(f'name = "{name}"\nmodel = "onnx"\n{extra}\n[options]\n'
                                               f'file = "mlp.onnx"\ninputs = "in.json"\n')
    code = cli.main(["bench", str(tmp_path / "a.toml"), str(tmp_path / "b.toml"), "--blocks", "1", "--requests", "2",
                     "--warmup", "0", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    text = " ".join(out.split())  # bitwise-equal outputs print "identical", else "within tolerance"
    assert "outputs within tolerance" in text or "outputs identical" in text, out
    assert "DIFFERENT" not in text


def test_release_returns_every_buffer_and_threads_take_turns(tmp_path):
    """Released runners leave nothing on the ledger; one runner shared by threads gives each
    caller the sequential result (its lock serialises traces; the Session is shared)."""
    import threading

    from flare.core.ledger import LEDGER
    from flare.core.session import Session

    path = save(mlp_model(), tmp_path / "mlp.onnx")
    xs = [RNG.standard_normal((b, 6)).astype(np.float32) for b in (2, 3, 2, 5, 3, 2)]
    with Session(["cpu"]) as sess:
        before = LEDGER.snapshot().count("cpu:0")
        runner = OnnxRunner(load_model(path), sess)
        want = [runner.run({"x": x})["y"] for x in xs]
        got: dict[int, np.ndarray] = {}

        def work(i):
            got[i] = runner.run({"x": xs[i]})["y"]

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, w in enumerate(want):
            np.testing.assert_array_equal(got[i], w)
        assert LEDGER.snapshot().count("cpu:0") > before
        runner.release()
        runner.release()  # idempotent
        assert LEDGER.snapshot().count("cpu:0") == before
