"""Document boundaries: packed windows flag each document's first token; with attention within
documents a packed window's logits are each document's alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax import attention
from coat_jax.training.config import load_config
from coat_jax.training.data import DOCUMENT_START, PackedWindows, within_documents
from coat_jax.training.model import model_def_for, split_window
from tests.tiny_runs import tiny_run

# Three documents of 7, 5 and 9 tokens packed into one stream; a window of 16 + 1 tokens
# starting at token 3 holds the end of the first, the second whole and the start of the third.
DOCS = [np.arange(7) + 10, np.arange(5) + 40, np.arange(9) + 70]
STREAM = np.concatenate(DOCS).astype(np.uint16)
STARTS = np.asarray([0, 7, 12])


def test_windows_flag_document_starts_and_split_window_reads_them():
    windows = PackedWindows(STREAM[3:], 16, "train", doc_starts=STARTS - 3)
    (window,) = windows.gather(np.asarray([0]))
    flagged = np.flatnonzero(window >= DOCUMENT_START)
    assert list(flagged) == [4, 9]
    cfg = load_config(None, ["data.document_positions=true"])
    model_def = model_def_for(cfg.model, cfg, within_documents=True)
    inputs, labels, segments, positions = split_window(model_def, jnp.asarray(window[None]))
    np.testing.assert_array_equal(inputs[0], STREAM[3:19])
    assert list(segments[0]) == [0] * 4 + [1] * 5 + [2] * 7
    assert list(positions[0]) == [0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize(
    "across, chat, within", [(None, False, False), (None, True, True), (False, False, True)]
)
def test_attention_within_documents_defaults_to_chat_data(across, chat, within):
    cfg = load_config(
        None, [f"data.attention_across_documents={'null' if across is None else 'false'}"]
    )
    assert within_documents(cfg, chat) == within


def test_cudnn_attention_refuses_segment_ids():
    q = jnp.zeros((1, 4, 2, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="masked on XLA's attention only.*'cudnn'"):
        attention.attend(
            q, q, q, is_causal=True, implementation="cudnn", segment_ids=jnp.zeros((1, 4), int)
        )


@pytest.mark.parametrize("precision, fp8_attention", [("bf16", False), ("coat", True)])
def test_a_packed_windows_logits_are_each_documents_alone(precision, fp8_attention):
    cfg = load_config(
        None,
        [
            *tiny_run(layers=1, seq_len=16, batch_size=1),
            f"precision.mode={precision}",
            f"precision.fp8_attention={str(fp8_attention).lower()}",
            "precision.compute_dtype=float32",
            "data.document_positions=true",
        ],
    )
    model_def = model_def_for(cfg.model, cfg, within_documents=True)
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda a: jnp.asarray(0.3 * rng.standard_normal(a.shape), a.dtype),
        model_def.abstract_params,
    )
    window = PackedWindows(STREAM[3:], 16, "train", doc_starts=STARTS - 3).gather(np.zeros(1, int))

    @jax.jit
    def packed_logits(params, window):
        model = model_def.bind(params)
        inputs, _, segments, positions = split_window(model_def, window)
        return model.logits(model.hidden_states(inputs, positions, segments))

    # Each piece alone, padded at its end to the window's length (causal: the padding changes
    # none of the piece's logits), and the window unmasked, in one call.
    pieces = [STREAM[3:7], STREAM[7:12], STREAM[12:19]]
    rows = np.zeros((4, 16), np.int32)
    for i, piece in enumerate(pieces):
        rows[i, : len(piece)] = piece
    rows[3] = STREAM[3:19]
    alone = np.asarray(jax.jit(model_def.apply)(params, jnp.asarray(rows)))
    want = np.concatenate([alone[i, : len(p)] for i, p in enumerate(pieces)])
    got = np.asarray(packed_logits(params, jnp.asarray(window)))[0]
    if precision == "bf16":
        np.testing.assert_allclose(got, want, atol=1e-5)
    else:
        # The FP8 per-tensor scales see the whole window, not one document: within the
        # quantization's error, and far from attending across the documents.
        err = np.abs(got - want)[4:].max()
        assert err < 0.2 * np.abs(alone[3] - want)[4:].max()
