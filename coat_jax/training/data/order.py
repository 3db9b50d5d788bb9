"""Packed windows over token streams and the order training reads them in.

Packing cuts a stream into non-overlapping windows of ``seq_len + 1`` tokens (inputs and shifted
targets share one window). The training order of one source is a permutation of its windows per
epoch drawn from ``(seed, epoch)``; a mixture of sources draws which source each position reads
from ``(seed, block)`` and each source keeps its own epochs. Either way the batch at any position
is a pure function of the seed and the position: resuming needs only the position, which the
checkpoint stores.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

# Added to the id of a document's first token in a window, where the model is to know the
# documents apart (``coat_jax.training.model.split_window``): above any vocabulary, below the
# sign bit that marks tokens that are no loss target.
DOCUMENT_START = 1 << 30

# Positions per block of a mixture's schedule: each block holds every source its share of
# positions (rounded), in an order drawn from the seed.
MIXTURE_BLOCK = 4096


def targets(windows):
    """Which labels of windows (``[..., T + 1]``, as :class:`PackedWindows` gives them; a NumPy
    or a JAX array) are loss targets: ``[..., T]`` booleans."""
    return windows[..., 1:] >= 0


def loss_tokens(windows: np.ndarray) -> int:
    """How many labels of windows are loss targets."""
    return int(np.count_nonzero(targets(windows)))


class PackedWindows:
    """Non-overlapping windows of ``seq_len + 1`` tokens over a token stream.

    With ``doc_starts`` (the offsets where documents start) a document's first token is given
    as ``id + DOCUMENT_START``; with ``loss`` (1 where a token is a loss target, 0 where not: a
    chat's non-assistant tokens) a token that is no target is then given as ``-(value + 1)``.
    So a window carries its documents and its loss mask in one int32 array
    (``coat_jax.training.model.split_window`` reads them back).
    """

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        split: str,
        loss: np.ndarray | None = None,
        doc_starts: np.ndarray | None = None,
    ):
        self.tokens = tokens
        self.loss = loss
        self.doc_starts = doc_starts
        self.seq_len = seq_len
        self.num_windows = (len(tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise ValueError(
                f"the {split} split has {len(tokens)} tokens, too few for one window of "
                f"data.seq_len={seq_len}; use a shorter seq_len or more data"
            )

    def gather(self, window_ids: np.ndarray) -> np.ndarray:
        starts = np.asarray(window_ids, dtype=np.int64) * self.seq_len
        index = starts[:, None] + np.arange(self.seq_len + 1)
        windows = np.asarray(self.tokens[index], dtype=np.int32)
        if self.doc_starts is not None:
            first = np.isin(index, self.doc_starts)
            windows = np.where(first, windows + DOCUMENT_START, windows)
        if self.loss is not None:
            windows = np.where(self.loss[index] != 0, windows, -windows - 1)
        return windows


class TrainOrder:
    """Shuffled window order; batch ``k`` of any run with this seed is the same windows.

    ``seed`` may be a sequence of integers (a mixture seeds each source with ``(seed, index)``).
    """

    def __init__(self, windows: PackedWindows, seed: int | Sequence[int]):
        self.windows = windows
        self.seed = seed
        self.num_windows = windows.num_windows
        self._epoch = -1
        self._perm = None

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            seeds = list(self.seed) if isinstance(self.seed, Sequence) else [self.seed]
            rng = np.random.default_rng([*seeds, epoch])
            self._perm = rng.permutation(self.windows.num_windows)
            self._epoch = epoch
        return self._perm

    def window_ids(self, positions: np.ndarray) -> np.ndarray:
        """The window each of the source's own read positions reads."""
        ids = np.empty(len(positions), dtype=np.int64)
        for i, p in enumerate(positions):
            epoch, j = divmod(int(p), self.windows.num_windows)
            ids[i] = self._permutation(epoch)[j]
        return ids

    def take(self, position: int, count: int, rows: np.ndarray | None = None) -> np.ndarray:
        """The ``count`` windows starting at sequence ``position``, as int32 ``[count, T + 1]``;
        with ``rows`` (indices into those ``count``) only those windows, ``[len(rows), T + 1]``."""
        positions = np.arange(position, position + count)
        return self.windows.gather(self.window_ids(positions if rows is None else positions[rows]))


def mixture_counts(weights: Sequence[float], block: int = MIXTURE_BLOCK) -> np.ndarray:
    """Positions of each source in a block: ``block`` split by weight, largest remainders first."""
    share = np.asarray(weights, dtype=np.float64) / np.sum(weights) * block
    counts = np.floor(share).astype(np.int64)
    rest = np.argsort(-(share - counts), kind="stable")[: block - counts.sum()]
    counts[rest] += 1
    return counts


class MixtureOrder:
    """Training positions spread over several sources in proportion to their weights.

    Every block of :data:`MIXTURE_BLOCK` positions holds each source's rounded share, shuffled
    by ``(seed, block)``; a source's ``k``-th read is its own :class:`TrainOrder`'s position
    ``k``, so each source runs through its epochs at its own pace.
    """

    def __init__(self, windows: Sequence[PackedWindows], weights: Sequence[float], seed: int):
        self.orders = [TrainOrder(w, (seed, i + 1)) for i, w in enumerate(windows)]
        self.counts = mixture_counts(weights)
        self.seed = seed
        self.num_windows = sum(w.num_windows for w in windows)
        self._block = -1
        self._layout = None

    def _block_layout(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """``(source, the source's read position)`` of each position of ``block``."""
        if block != self._block:
            rng = np.random.default_rng([self.seed, 0, block])
            sources = rng.permutation(np.repeat(np.arange(len(self.counts)), self.counts))
            reads = np.empty(len(sources), dtype=np.int64)
            for s, count in enumerate(self.counts):
                where = sources == s
                reads[where] = block * count + np.arange(count)
            self._block, self._layout = block, (sources, reads)
        return self._layout

    def sources(self, position: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """``(source, read position in that source)`` of positions ``position..+count``."""
        src = np.empty(count, dtype=np.int64)
        reads = np.empty(count, dtype=np.int64)
        for i in range(count):
            block, j = divmod(position + i, MIXTURE_BLOCK)
            layout = self._block_layout(block)
            src[i], reads[i] = layout[0][j], layout[1][j]
        return src, reads

    def take(self, position: int, count: int, rows: np.ndarray | None = None) -> np.ndarray:
        """The ``count`` windows starting at sequence ``position``, as int32 ``[count, T + 1]``;
        with ``rows`` (indices into those ``count``) only those windows, ``[len(rows), T + 1]``."""
        src, reads = self.sources(position, count)
        if rows is not None:
            src, reads = src[rows], reads[rows]
        seq_len = self.orders[0].windows.seq_len
        out = np.empty((len(src), seq_len + 1), dtype=np.int32)
        for s, order in enumerate(self.orders):
            mine = src == s
            if mine.any():
                out[mine] = order.windows.gather(order.window_ids(reads[mine]))
        return out


class InterleavedWindows:
    """The validation windows of several sources as one sequence, each source spread evenly."""

    def __init__(self, windows: Sequence[PackedWindows]):
        self.windows = list(windows)
        self.seq_len = self.windows[0].seq_len
        source = np.concatenate([np.full(w.num_windows, s) for s, w in enumerate(self.windows)])
        index = np.concatenate([np.arange(w.num_windows) for w in self.windows])
        key = np.concatenate([(np.arange(w.num_windows) + 0.5) / w.num_windows for w in windows])
        order = np.argsort(key, kind="stable")
        self._source, self._index = source[order], index[order]
        self.num_windows = len(order)

    def gather(self, window_ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(window_ids, dtype=np.int64)
        out = np.empty((len(ids), self.seq_len + 1), dtype=np.int32)
        for s, w in enumerate(self.windows):
            mine = self._source[ids] == s
            if mine.any():
                out[mine] = w.gather(self._index[ids][mine])
        return out


def validation_window_ids(windows: PackedWindows, batch_size: int, num_batches: int) -> Iterator:
    """The window ids of the first ``num_batches`` full batches of validation windows, in corpus
    order (``windows.gather`` reads them)."""
    available = windows.num_windows // batch_size
    if available < 1:
        raise ValueError(
            f"validation split has {windows.num_windows} windows, fewer than data.batch_size="
            f"{batch_size}; raise val_fraction or lower batch_size"
        )
    for b in range(min(num_batches, available)):
        yield np.arange(b * batch_size, (b + 1) * batch_size)
