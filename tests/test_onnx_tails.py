"""The fit of an ONNX trace's tail across lengths (models/flare/models/onnx/tails.py): what it
models (integers affine in F, fills and ramps) and what it refuses."""
import numpy as np
import pytest

from flare.models.onnx.tails import Lin, NoFit, _make_array, _pattern_array, fit, subst


def test_integers_that_follow_the_length_are_affine_in_it():
    p = fit({"shape": [1, 192, 172], "axis": 2, "pads": (0, 3)}, {"shape": [1, 192, 181], "axis": 2, "pads": (0, 3)},
            172, 181)
    assert p == {"shape": [1, 192, Lin(1, 0)], "axis": 2, "pads": (0, 3)}
    assert subst(p, 200) == {"shape": [1, 192, 200], "axis": 2, "pads": (0, 3)}
    upsampled = fit((1, 1, 172 * 256 - 3), (1, 1, 181 * 256 - 3), 172, 181)
    assert subst(upsampled, 10) == (1, 1, 2557)


def test_what_is_not_affine_or_differs_otherwise_is_refused():
    with pytest.raises(NoFit):
        fit(172 // 2, 182 // 2, 172, 182)  # 86 / 91: a step of 5 over 10 is no integer slope
    with pytest.raises(NoFit):
        fit(1.0 / 172, 1.0 / 181, 172, 181)
    with pytest.raises(NoFit):
        fit(True, False, 172, 181)
    with pytest.raises(NoFit):
        fit("same", "other", 172, 181)
    with pytest.raises(NoFit):
        fit([1, 2], [1, 2, 3], 172, 181)
    assert fit(np.arange(3), np.arange(3), 1, 2) is not None
    with pytest.raises(NoFit):
        fit(np.arange(3), np.arange(4), 1, 2)


def test_computed_constants_are_fills_or_ramps_or_nothing():
    assert _pattern_array(np.zeros((1, 1, 172), np.float32)) == ("fill", 0.0)
    ramp = _pattern_array(np.arange(172, dtype=np.int64).reshape(1, 172))
    assert ramp == ("ramp", 0, 1)
    np.testing.assert_array_equal(_make_array(ramp, (1, 5), np.dtype(np.int64)), [[0, 1, 2, 3, 4]])
    assert _pattern_array(np.array([0.0, 1.0, 3.0], np.float32)) is None
