"""A job's own tokens (``profile.tokens``): a ``.npy`` array of token ids the profiled trials and the launch
scripts draw their batches from, in place of uniform random ids.

Memory and time of a dense model do not depend on which ids it reads; an expert-parallel rank's received rows
do (they follow the router's choices on the batch: docs/moe.md, "Measuring the routing"), so a MoE job profiled
on its own data measures the routing it will train with. The array (any integer dtype, any shape, read
flattened and memory-mapped) is a sample of the user's tokenized data; each sequence is a window at a random
offset, one new window per call, from a generator the batch function seeds (a rank's and a run's own stream).

``check_tokens`` reads only the file's header and its ids' range with numpy (the config loader's check);
``token_windows`` needs torch (the worker's and the launch scripts' batch functions).
"""

from __future__ import annotations

from typing import Any


def check_tokens(path: str, vocab_size: int, seq_len: int) -> str | None:
    """Why ``path`` cannot feed a model of ``vocab_size`` ids at ``seq_len`` (one line), or None: a ``.npy``
    file of integer ids, at least ``seq_len + 1`` of them, each in [0, vocab_size)."""
    import numpy as np

    if not path.endswith(".npy"):
        return f"expected a .npy file of token ids (numpy.save), got {path!r}"
    try:
        with open(path, "rb") as fh:
            if fh.read(6) != b"\x93NUMPY":  # the .npy magic (numpy.lib.format.MAGIC_PREFIX)
                return f"{path} is not a .npy file (numpy.save writes one)"
        ids = np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        return f"file not found: {path}"
    except (OSError, ValueError) as err:
        return f"cannot read {path} as a .npy array: {str(err).splitlines()[0][:120]}"
    if not np.issubdtype(ids.dtype, np.integer):
        return f"{path} holds {ids.dtype} values; token ids are integers"
    if ids.size < seq_len + 1:
        return f"{path} holds {ids.size} token ids; a sequence of training.seq_len {seq_len} needs {seq_len + 1}"
    flat = ids.reshape(-1)
    low, high = int(flat.min()), int(flat.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        return f"{path} holds token id {bad}, outside the model's vocabulary [0, {vocab_size})"
    return None


def token_windows(path: str, vocab_size: int) -> Any:
    """A function ``draw(micro_batch_size, length, generator) -> LongTensor [micro_batch_size, length]`` of windows
    of ``path``'s ids at offsets drawn from ``generator`` (a torch.Generator); the file is checked once, here
    (``check_tokens``: ValueError with its one line)."""
    import numpy as np
    import torch

    why = check_tokens(path, vocab_size, 0)
    if why:
        raise ValueError(why)
    ids = np.load(path, mmap_mode="r", allow_pickle=False).reshape(-1)

    def draw(micro_batch_size: int, length: int, generator: Any) -> Any:
        if ids.size < length:
            raise ValueError(f"{path} holds {ids.size} token ids; a sequence of {length} needs more")
        starts = torch.randint(0, ids.size - length + 1, (micro_batch_size,), generator=generator).tolist()
        return torch.from_numpy(np.stack([np.asarray(ids[s:s + length], dtype=np.int64) for s in starts]))

    return draw
