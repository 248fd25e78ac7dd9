"""The ONNX graph of all-MiniLM-L6-v2 (models/flare/models/minilm/onnx_export.py), run by onnxruntime,
gives Flare's embeddings within 1e-5: the bench's onnxruntime peer computes the same model."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from flare.models.minilm import onnx_export  # noqa: E402
from flare.models.minilm.runner import MiniLM  # noqa: E402
from flare.models.minilm.tokenize import encode, pad_batch  # noqa: E402
from flare.core.session import Session  # noqa: E402

SENTENCES = ["The weather is lovely today.", "It's so sunny outside!", "He drove to the stadium.",
             "A much longer sentence, so that the batch has padding in the shorter rows of it."]


def test_onnx_embeddings_equal_flare():
    tokens = encode(SENTENCES)
    batch = pad_batch(tokens)
    ort = onnx_export.session(threads=1)
    got = onnx_export.embed(ort, batch.ids, [len(t) for t in tokens])
    with Session(["cpu"]) as sess, MiniLM(sess) as model:
        want = model.embed_tokens(tokens)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_onnx_file_is_cached():
    assert onnx_export.cached_path() == onnx_export.cached_path()
    assert onnx_export.cached_path().stat().st_size > 80e6  # weights inside
