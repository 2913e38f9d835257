"""The launcher's token stream: synthetic tokens, or a local dataset named by nanotron's own data
section, as each data-parallel replica's micro-batches of every iteration (`bagualu_plugin.data`
does the reading, packing and dealing; this module reads nanotron's sections and names their
fields in errors).

- No data section (or `dataset: null`): uniform ids in [0, vocab_size) seeded by `general.seed`.
- A dataset: PyPI nanotron 0.4's `data.dataset`, or on nanotron main the first stage of
  `data_stages` (the one active at step 1). `hf_dataset_or_datasets` must be a local path (a
  `save_to_disk` directory, or a `.txt` / `.json` / `.jsonl` file): the launcher runs offline
  and every rank reads it, so hub names and nanotron's dict/list mixtures are refused.
  `text_column_name` is tokenised with the config's tokenizer (or the checkpoint's) into sequences
  of `sequence_length` tokens, shuffled with `data.seed` (`general.seed` when unset).

Labels are the inputs: HF causal LMs shift them themselves.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ... import data
from ...config import RecipeError
from .config import Config

_SOURCE = "nanotron config"


def micro_batches(config: Config, checkpoint: str | Path, vocab_size: int, replica: int, replicas: int) -> Iterator[list[torch.Tensor]]:
    """Forever, one list per iteration: this replica's `tokens.batch_accumulation_per_replica`
    micro-batches, int64 CPU tensors of shape [micro_batch_size, sequence_length]; the launcher
    takes `tokens.train_steps` of them. Dataset and tokenizer problems raise `RecipeError` naming
    the field here, when called, not at the first batch."""
    tokens = config.tokens
    m, shape = tokens.batch_accumulation_per_replica, (tokens.micro_batch_size, tokens.sequence_length)
    args, prefix = _data_args(config)
    if args is None or args.dataset is None:
        return data.synthetic(config.general.seed, vocab_size, shape, m, replica, replicas)
    dataset, prefix = args.dataset, f"{prefix}.dataset"
    fields = {
        "path": f"{prefix}.hf_dataset_or_datasets",
        "split": f"{prefix}.hf_dataset_splits",
        "column": f"{prefix}.text_column_name",
        "tokenizer": "tokenizer.tokenizer_name_or_path",
    }
    where = getattr(dataset, "hf_dataset_or_datasets", None)
    if where is None:
        msg = f"{type(dataset).__name__} is not supported: give a PretrainDatasetsArgs with hf_dataset_or_datasets"
        raise RecipeError(_SOURCE, [(prefix, msg)])
    if not isinstance(where, str):
        raise RecipeError(_SOURCE, [(fields["path"], f"{type(where).__name__} of datasets is not supported: give one local path")])
    split = dataset.hf_dataset_splits
    if split is not None and not isinstance(split, str):
        raise RecipeError(_SOURCE, [(fields["split"], f"{split!r}: give one split name")])
    try:
        texts = data.load_texts(where, split, dataset.text_column_name or "text")
        tokenizer = data.load_tokenizer(getattr(config.tokenizer, "tokenizer_name_or_path", None) or checkpoint)
        sequences = data.pack(texts, tokenizer, tokens.sequence_length, vocab_size)
    except data.DataError as exc:
        raise RecipeError(_SOURCE, [(fields[exc.what], str(exc))]) from None
    seed = config.general.seed if args.seed is None else args.seed
    return data.batches(sequences, seed, shape[0], m, replica, replicas)


def _data_args(config: Config) -> tuple[Any, str]:
    """nanotron's `DataArgs` in force at step 1 and its field path: main's `data_stages` (the stage
    starting first) or 0.4's `data`; (None, "data") without either."""
    stages = getattr(config, "data_stages", None)
    if stages:
        first = min(range(len(stages)), key=lambda i: stages[i].start_training_step)
        return stages[first].data, f"data_stages[{first}].data"
    return getattr(config, "data", None), "data"
