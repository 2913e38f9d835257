"""Local training text as token batches: the nanotron launcher's and the fine-tuning example's.

`load_texts` reads a local dataset (a `datasets` `save_to_disk` directory, or a `.txt` file of one
document per line, or `.json` / `.jsonl`), never a hub name: training runs offline. `pack`
tokenises the documents, joins them with the tokenizer's eos id where it has one and cuts the
stream into sequences (the tail is dropped). `batches` deals them out: every rank computes the same
shuffled order from the seed alone, each of `replicas` data replicas takes its contiguous, disjoint
share of every step's batch, and a run longer than the data starts another shuffled epoch (so a
step may span two). `synthetic` is the seeded uniform-token stream of runs without data.

Problems raise `DataError`, whose `what` says which input is wrong ("path", "split", "column",
"tokenizer"), so a caller names its own field or flag.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

import torch

_LOADERS = {".txt": "text", ".json": "json", ".jsonl": "json"}  # file suffix -> datasets builder
_HINT = "a local path: a datasets save_to_disk directory, or a .txt, .json or .jsonl file"


class DataError(ValueError):
    def __init__(self, what: Literal["path", "split", "column", "tokenizer"], message: str):
        super().__init__(message)
        self.what = what


def load_texts(where: str | Path, split: str | None = None, column: str = "text") -> Sequence[str]:
    """The `column` of the local dataset at `where` (a DatasetDict's `split`, default "train")."""
    path = Path(where)
    if not path.exists():
        raise DataError("path", f"{str(where)!r} is no local path (hub datasets are not downloaded): give {_HINT}")
    import datasets  # here, not at the top: runs without data do not pay its import

    if path.is_dir():
        try:
            loaded = datasets.load_from_disk(str(path))
        except FileNotFoundError:
            raise DataError("path", f"{str(where)!r} is not a directory written by save_to_disk") from None
        if isinstance(loaded, datasets.DatasetDict):
            split = split or "train"
            if split not in loaded:
                raise DataError("split", f"split {split!r} is not in {str(where)!r} (splits: {', '.join(loaded)})")
            loaded = loaded[split]
    elif path.suffix in _LOADERS:
        loaded = datasets.load_dataset(_LOADERS[path.suffix], data_files=str(path), split="train")
    else:
        raise DataError("path", f"{str(where)!r} is a {path.suffix or 'suffix-less'} file: give {_HINT}")
    if column not in loaded.column_names:
        raise DataError("column", f"no column {column!r} in {str(where)!r} (columns: {', '.join(loaded.column_names)})")
    return loaded[column]


def load_tokenizer(name: str | Path):
    """`AutoTokenizer.from_pretrained(name)` offline."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(name), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise DataError("tokenizer", f"cannot load a tokenizer from {str(name)!r} offline ({exc})") from None


def pack(texts: Sequence[str], tokenizer, seq_len: int, vocab_size: int) -> torch.Tensor:
    """The documents as [n, seq_len] int64 token ids, in order; empty documents are skipped."""
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    ids: list[int] = []
    for start in range(0, len(texts), 1000):
        chunk = [t for t in texts[start : start + 1000] if t]
        for doc in tokenizer(chunk, add_special_tokens=False)["input_ids"]:
            ids += (eos if ids else []) + doc
    top = max(ids, default=-1)
    if top >= vocab_size:
        msg = f"the tokenizer gives token id {top}, but the model's vocab_size is {vocab_size}: ids must be < {vocab_size}"
        raise DataError("tokenizer", msg)
    n = len(ids) // seq_len
    if n == 0:
        raise DataError("path", f"{len(ids)} tokens, fewer than one sequence of {seq_len}")
    return torch.tensor(ids[: n * seq_len], dtype=torch.int64).view(n, seq_len)


def batches(sequences: torch.Tensor, seed: int, mbs: int, m: int, replica: int, replicas: int) -> Iterator[list[torch.Tensor]]:
    """Forever, per step: this replica's `m` micro-batches of `mbs` sequences, reshuffled each epoch."""
    _check_replica(replica, replicas)
    return _dealt(sequences, seed, mbs, m, replica, replicas)


def _dealt(sequences: torch.Tensor, seed: int, mbs: int, m: int, replica: int, replicas: int) -> Iterator[list[torch.Tensor]]:
    g, share = torch.Generator().manual_seed(seed), m * mbs
    order = torch.empty(0, dtype=torch.int64)  # sequence indices not yet consumed, in order
    while True:
        while len(order) < replicas * share:  # the next epoch's shuffle
            order = torch.cat([order, torch.randperm(len(sequences), generator=g)])
        batch, order = order[: replicas * share], order[replicas * share :]
        mine = sequences[batch[replica * share : (replica + 1) * share]]
        # each micro-batch its own storage, as a device copy's is: views of the step's batch would
        # put the whole batch in every micro-batch's saved tensors (the embedding's and the loss's ids)
        yield [ids.clone() for ids in mine.view(m, mbs, -1)]


def synthetic(seed: int, vocab_size: int, shape: tuple[int, int], m: int, replica: int, replicas: int) -> Iterator[list[torch.Tensor]]:
    """Forever, per step: this replica's `m` micro-batches of uniform ids, one generator for all."""
    _check_replica(replica, replicas)
    return _drawn(seed, vocab_size, shape, m, replica, replicas)


def _drawn(seed: int, vocab_size: int, shape: tuple[int, int], m: int, replica: int, replicas: int) -> Iterator[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    while True:
        drawn = [torch.randint(0, vocab_size, shape, generator=g) for _ in range(replicas * m)]
        yield drawn[replica * m : (replica + 1) * m]


def _check_replica(replica: int, replicas: int) -> None:
    """Here, where the stream is asked for: the generators above start only at their first batch."""
    if not 0 <= replica < replicas:
        raise ValueError(f"replica {replica} must be in [0, {replicas})")
