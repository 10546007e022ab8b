"""The greedy pick of the CPU graphs (csrc/models/argmax.cpp: chunked over all threads, vectorised) against
numpy's argmax and ggml's own single-threaded ggml_argmax."""
import numpy as np
import pytest

from pydflash import _core
from pydflash.errors import PydflashError

CHUNK = 8192  # the kernel's work item, to put ties and maxima on either side of its boundaries

# (rows, vocab): one-token decode and a 16-token verify over Qwen3.5's vocabulary, the trained pairs' 4096,
# sizes below one SIMD block, and sizes one over / at a chunk boundary
SHAPES = [(1, 248320), (16, 248320), (15, 4096), (1, 1), (2, 7), (1, 33), (3, CHUNK), (3, CHUNK + 1), (5, 3 * CHUNK - 5)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_random_logits_match_numpy_and_ggml_argmax(shape, n_threads):
    rng = np.random.default_rng(shape[1] * 10 + n_threads)
    logits = (rng.standard_normal(shape) * 4).astype(np.float32)
    expected = logits.argmax(axis=1)
    assert list(_core.argmax_rows(logits, n_threads)) == expected.tolist()
    assert list(_core.argmax_rows(logits, n_threads, stock=True)) == expected.tolist()


@pytest.mark.parametrize("n_threads", [1, 2])
def test_maximum_at_every_position_of_a_row(n_threads):
    # rows of a cheap all-equal background with one maximum that walks through every SIMD lane and chunk edge
    n = 2 * CHUNK + 40
    positions = list(range(0, 70)) + list(range(CHUNK - 40, CHUNK + 40)) + list(range(n - 70, n))
    logits = np.full((len(positions), n), -1.0, dtype=np.float32)
    logits[np.arange(len(positions)), positions] = 2.0
    assert list(_core.argmax_rows(logits, n_threads)) == positions


def test_ties_go_to_the_first_index_like_numpy():
    # ggml_argmax keeps the last of equal maxima; ours keeps the first, as numpy, torch and llama.cpp's greedy
    # sampler do: within one SIMD block, across blocks of one chunk, and across chunks
    n = 3 * CHUNK
    logits = np.zeros((4, n), dtype=np.float32)
    for row, tied in enumerate([[5, 6], [40, 1000], [CHUNK - 1, CHUNK], [100, CHUNK + 7, 2 * CHUNK + 3]]):
        logits[row, tied] = 7.5
    expected = logits.argmax(axis=1).tolist()
    assert expected == [5, 40, CHUNK - 1, 100]
    assert list(_core.argmax_rows(logits, 2)) == expected


def test_nan_and_infinite_logits_give_a_valid_index():
    n = 2 * CHUNK + 3
    logits = np.full((4, n), np.nan, dtype=np.float32)
    logits[0, 12345] = -5.0                       # one number among NaN: it wins
    logits[1, :] = -np.inf                        # all -inf: the first
    logits[2, :] = np.linspace(-1, 1, n)
    logits[2, 77] = np.inf                        # +inf beats every number
    got = list(_core.argmax_rows(logits, 2))      # row 3: all NaN, any index inside the row
    assert got[:3] == [12345, 0, 77]
    assert 0 <= got[3] < n


def test_bad_shapes_are_errors():
    with pytest.raises(ValueError, match="2-D"):
        _core.argmax_rows(np.zeros(8, dtype=np.float32), 2)
    with pytest.raises(PydflashError, match="rows"):
        _core.argmax_rows(np.zeros((0, 8), dtype=np.float32), 2)
