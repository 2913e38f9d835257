"""The launcher's token stream: synthetic tokens, or a local dataset named by nanotron's own data
section, as each data-parallel replica's micro-batches of every iteration.

Every rank computes the whole global batch order from the seed alone (no communication, no
sampler state to keep in step); replica `r` of `R` takes its contiguous, disjoint share of it.

- No data section (or `dataset: null`): uniform ids in [0, vocab_size) from one generator seeded by
  `general.seed`; each iteration draws `R x batch_accumulation_per_replica` micro-batches and
  replica `r` takes its slice, so one replica reproduces the launcher's original stream.
- A dataset: PyPI nanotron 0.4's `data.dataset`, or on nanotron main the first stage of
  `data_stages` (the one active at step 1). `hf_dataset_or_datasets` must be a local path (a
  `save_to_disk` directory, or a `.txt` / `.json` / `.jsonl` file): the launcher runs offline
  and every rank reads it, so hub names and nanotron's dict/list mixtures are refused.
  `text_column_name` is tokenised with the config's tokenizer (or the checkpoint's), documents are
  joined by the tokenizer's eos id where it has one, and the stream is cut into sequences of
  `sequence_length` tokens (the tail is dropped). Sequences are shuffled with `data.seed`
  (`general.seed` when unset); a run that needs more sequences than the dataset has continues with
  a fresh shuffle for every further epoch, so an iteration may span two epochs.

Labels are the inputs: HF causal LMs shift them themselves.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ...config import RecipeError
from .config import Config

_SOURCE = "nanotron config"
_LOADERS = {".txt": "text", ".json": "json", ".jsonl": "json"}  # file suffix -> datasets builder


def micro_batches(config: Config, checkpoint: str | Path, vocab_size: int, replica: int, replicas: int) -> Iterator[list[torch.Tensor]]:
    """Forever, one list per iteration: this replica's `tokens.batch_accumulation_per_replica`
    micro-batches, int64 CPU tensors of shape [micro_batch_size, sequence_length]; the launcher
    takes `tokens.train_steps` of them. Dataset and tokenizer problems raise `RecipeError` naming
    the field here, when called, not at the first batch."""
    if not 0 <= replica < replicas:
        raise ValueError(f"replica {replica} must be in [0, {replicas})")
    tokens = config.tokens
    m, shape = tokens.batch_accumulation_per_replica, (tokens.micro_batch_size, tokens.sequence_length)
    data, prefix = _data_args(config)
    if data is None or data.dataset is None:
        return _synthetic(config.general.seed, vocab_size, shape, m, replica, replicas)
    sequences = _sequences(config, data.dataset, f"{prefix}.dataset", checkpoint, vocab_size)
    seed = config.general.seed if data.seed is None else data.seed
    return _shuffled(sequences, seed, shape[0], m, replica, replicas)


def _synthetic(seed: int, vocab_size: int, shape: tuple[int, int], m: int, replica: int, replicas: int) -> Iterator[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    while True:
        drawn = [torch.randint(0, vocab_size, shape, generator=g) for _ in range(replicas * m)]
        yield drawn[replica * m : (replica + 1) * m]


def _shuffled(sequences: torch.Tensor, seed: int, mbs: int, m: int, replica: int, replicas: int) -> Iterator[list[torch.Tensor]]:
    g, share = torch.Generator().manual_seed(seed), m * mbs
    order = torch.empty(0, dtype=torch.int64)  # sequence indices not yet consumed, in order
    while True:
        while len(order) < replicas * share:  # the next epoch's shuffle
            order = torch.cat([order, torch.randperm(len(sequences), generator=g)])
        batch, order = order[: replicas * share], order[replicas * share :]
        mine = sequences[batch[replica * share : (replica + 1) * share]]
        yield list(mine.view(m, mbs, -1))


def _data_args(config: Config) -> tuple[Any, str]:
    """nanotron's `DataArgs` in force at step 1 and its field path: main's `data_stages` (the stage
    starting first) or 0.4's `data`; (None, "data") without either."""
    stages = getattr(config, "data_stages", None)
    if stages:
        first = min(range(len(stages)), key=lambda i: stages[i].start_training_step)
        return stages[first].data, f"data_stages[{first}].data"
    return getattr(config, "data", None), "data"


def _sequences(config: Config, dataset: Any, prefix: str, checkpoint: str | Path, vocab_size: int) -> torch.Tensor:
    """The dataset's documents as [n, sequence_length] token ids, in the dataset's order."""
    texts = _texts(dataset, prefix)
    name = getattr(config.tokenizer, "tokenizer_name_or_path", None) or str(checkpoint)
    field = "tokenizer.tokenizer_name_or_path"
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise RecipeError(_SOURCE, [(field, f"cannot load a tokenizer from {name!r} offline ({exc})")]) from None
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    ids: list[int] = []
    for start in range(0, len(texts), 1000):
        chunk = [t for t in texts[start : start + 1000] if t]  # an empty line is no document
        for doc in tokenizer(chunk, add_special_tokens=False)["input_ids"]:
            ids += (eos if ids else []) + doc
    top = max(ids, default=-1)
    if top >= vocab_size:
        msg = f"tokenizer {name!r} gives token id {top}, but the checkpoint's vocab_size is {vocab_size}: ids must be < {vocab_size}"
        raise RecipeError(_SOURCE, [(field, msg)])
    seq = config.tokens.sequence_length
    n = len(ids) // seq
    if n == 0:
        msg = f"{len(ids)} tokens, fewer than one sequence of tokens.sequence_length={seq}"
        raise RecipeError(_SOURCE, [(f"{prefix}.hf_dataset_or_datasets", msg)])
    return torch.tensor(ids[: n * seq], dtype=torch.int64).view(n, seq)


def _texts(dataset: Any, prefix: str) -> Any:
    """The text column of the local dataset that nanotron's `PretrainDatasetsArgs` names."""
    path_field = f"{prefix}.hf_dataset_or_datasets"
    where = getattr(dataset, "hf_dataset_or_datasets", None)
    if where is None:
        msg = f"{type(dataset).__name__} is not supported: give a PretrainDatasetsArgs with hf_dataset_or_datasets"
        raise RecipeError(_SOURCE, [(prefix, msg)])
    hint = "a local path: a datasets save_to_disk directory, or a .txt, .json or .jsonl file"
    if not isinstance(where, str):
        raise RecipeError(_SOURCE, [(path_field, f"{type(where).__name__} of datasets is not supported: give {hint}")])
    path = Path(where)
    if not path.exists():
        raise RecipeError(_SOURCE, [(path_field, f"{where!r} is no local path (hub datasets are not downloaded): give {hint}")])
    import datasets  # here, not at the top: synthetic runs do not pay its import

    if path.is_dir():
        try:
            loaded = datasets.load_from_disk(str(path))
        except FileNotFoundError:
            raise RecipeError(_SOURCE, [(path_field, f"{where!r} is not a directory written by save_to_disk")]) from None
        if isinstance(loaded, datasets.DatasetDict):
            split = dataset.hf_dataset_splits or "train"
            if not isinstance(split, str) or split not in loaded:
                msg = f"split {split!r} is not in {where!r} (splits: {', '.join(loaded)})"
                raise RecipeError(_SOURCE, [(f"{prefix}.hf_dataset_splits", msg)])
            loaded = loaded[split]
    elif path.suffix in _LOADERS:
        loaded = datasets.load_dataset(_LOADERS[path.suffix], data_files=str(path), split="train")
    else:
        raise RecipeError(_SOURCE, [(path_field, f"{where!r} is a {path.suffix or 'suffix-less'} file: give {hint}")])
    column = dataset.text_column_name or "text"
    if column not in loaded.column_names:
        msg = f"no column {column!r} in {where!r} (columns: {', '.join(loaded.column_names)})"
        raise RecipeError(_SOURCE, [(f"{prefix}.text_column_name", msg)])
    return loaded[column]
