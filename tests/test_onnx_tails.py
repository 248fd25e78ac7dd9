"""The fit of an ONNX trace's tail across lengths (models/flare/models/onnx/tails.py): what it
models (integers exact in the lengths F and T, fills and ramps) and what it refuses."""
import numpy as np
import pytest

from flare.models.onnx.tails import Lin, NoFit, Solver, _make_array, _pattern_array, fit, monomials, subst


def test_integers_that_follow_one_length_are_affine_in_it():
    solver = Solver([monomials(172, None), monomials(181, None), monomials(200, None)])
    p = fit([{"shape": [1, 192, f], "axis": 2, "pads": (0, 3)} for f in (172, 181, 200)], solver)
    assert p == {"shape": [1, 192, Lin((0, 1))], "axis": 2, "pads": (0, 3)}
    assert subst(p, monomials(250, None)) == {"shape": [1, 192, 250], "axis": 2, "pads": (0, 3)}
    upsampled = fit([(1, 1, f * 256 - 3) for f in (172, 181, 200)], solver)
    assert subst(upsampled, monomials(10, None)) == (1, 1, 2557)


def test_two_lengths_fit_with_their_product():
    pairs = [(97, 48), (239, 112), (191, 96), (185, 112), (254, 128)]
    solver = Solver([monomials(f, t) for f, t in pairs])
    p = fit([[1, f, t, f * t, 2 * f + t - 1] for f, t in pairs], solver)
    assert subst(p, monomials(100, 64)) == [1, 100, 64, 6400, 263]


def test_what_does_not_follow_the_lengths_is_refused():
    solver = Solver([monomials(f, None) for f in (172, 182, 190)])
    with pytest.raises(NoFit):
        fit([f // 2 for f in (172, 182, 190)], solver)  # 86, 91, 95: no integer slope
    with pytest.raises(NoFit):
        fit([min(f, 182) for f in (172, 182, 190)], solver)  # two points fit, the third does not
    with pytest.raises(NoFit):
        fit([1.0 / f for f in (172, 182, 190)], solver)
    with pytest.raises(NoFit):
        fit([True, False, True], solver)
    with pytest.raises(NoFit):
        fit(["same", "same", "other"], solver)
    with pytest.raises(NoFit):
        fit([[1, 2], [1, 2], [1, 2, 3]], solver)
    with pytest.raises(NoFit):
        fit([np.arange(3), np.arange(3), np.arange(4)], solver)
    with pytest.raises(NoFit):
        Solver([monomials(172, None), monomials(172, None)])  # one length does not determine a slope


def test_computed_constants_are_fills_or_ramps_or_nothing():
    assert _pattern_array(np.zeros((1, 1, 172), np.float32)) == ("fill", 0.0)
    ramp = _pattern_array(np.arange(172, dtype=np.int64).reshape(1, 172))
    assert ramp == ("ramp", 0, 1)
    np.testing.assert_array_equal(_make_array(ramp, (1, 5), np.dtype(np.int64)), [[0, 1, 2, 3, 4]])
    assert _pattern_array(np.array([0.0, 1.0, 3.0], np.float32)) is None


def test_a_compiled_pattern_gives_what_subst_gives():
    from flare.models.onnx.tails import compiled

    pattern = {"shape": [1, Lin((0, 1, 0, 0)), Lin((3, 0, 2, 1))], "axis": 2, "pads": (0, Lin((1, 2, 0, 0)))}
    for f, t in [(10, 3), (7, 96)]:
        assert compiled(pattern)(monomials(f, t)) == subst(pattern, monomials(f, t))
    assert compiled((1, Lin((0, 1))))(monomials(5, None)) == (1, 5)
