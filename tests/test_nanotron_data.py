"""The launcher's token stream: synthetic tokens as the launcher drew them, local datasets from
nanotron's data section (text file, save_to_disk directory) tokenised and split between replicas,
and each bad data section as an error naming its field."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("nanotron")
datasets = pytest.importorskip("datasets")

from nanotron_configs import config_dict, load  # noqa: E402

from bagualu_plugin.adapters.tiny import tiny_tokenizer  # noqa: E402
from bagualu_plugin.config import RecipeError  # noqa: E402
from bagualu_plugin.integrations.nanotron import compat  # noqa: E402
from bagualu_plugin.integrations.nanotron.data import micro_batches  # noqa: E402

nt_config = compat.import_nanotron()

TEXT = [
    "The quick brown fox jumps over the lazy dog.", "", "Pack my box with five dozen liquor jugs!",
    "Sphinx of black quartz, judge my vow.", "How vexingly quick daft zebras jump!",
]
VOCAB = 128


def data_config(data=None, seq_len=8, micro_batch_size=2, accumulation=3, tokenizer=None) -> dict:
    model = {
        "init_method": {"std": 0.02},
        "model_config": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": VOCAB},
    }
    sections = {} if data is None else {"data": data}
    out = config_dict(model, seq_len=seq_len, micro_batch_size=micro_batch_size, accumulation=accumulation, train_steps=2, **sections)
    if tokenizer:
        out["tokenizer"] = {"tokenizer_name_or_path": tokenizer}
    return out


def dataset_section(where, **fields) -> dict:
    return {"dataset": {"hf_dataset_or_datasets": str(where), **fields}, "seed": 3}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A directory holding only the tiny tokenizer: all the stream reads of a checkpoint."""
    path = tmp_path_factory.mktemp("checkpoint")
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "docs.txt"
    path.write_text("\n".join(TEXT) + "\n")
    return path


def take(stream, n):
    return list(itertools.islice(stream, n))


def test_synthetic_stream_is_the_launchers_and_replicas_slice_it(tmp_path):
    config = load(tmp_path, data_config())
    g = torch.Generator().manual_seed(7)  # the launcher before this module: train.py's own draw
    old = [[torch.randint(0, VOCAB, (2, 8), generator=g) for _ in range(3)] for _ in range(4)]
    ours = take(micro_batches(config, "unused", VOCAB, 0, 1), 4)
    assert all(torch.equal(a, b) and a.dtype == torch.int64 for x, y in zip(old, ours) for a, b in zip(x, y))

    g = torch.Generator().manual_seed(7)
    drawn = [[torch.randint(0, VOCAB, (2, 8), generator=g) for _ in range(6)] for _ in range(2)]
    for r in range(2):
        got = take(micro_batches(config, "unused", VOCAB, r, 2), 2)
        assert all(torch.equal(a, b) for it, want in zip(got, drawn) for a, b in zip(it, want[3 * r : 3 * r + 3]))


def rows(it) -> list[tuple[int, ...]]:
    return [tuple(row.tolist()) for mb in it for row in mb]


def test_text_file_is_tokenised_split_between_replicas_and_reshuffled(tmp_path, checkpoint, text_file):
    config = load(tmp_path, data_config(dataset_section(text_file)))
    tokenizer = tiny_tokenizer()
    ids = tokenizer("<eos>".join(t for t in TEXT if t))["input_ids"]  # documents joined by eos
    n = len(ids) // 8  # sequences of 8 tokens, the tail dropped
    sequences = sorted(tuple(ids[8 * i : 8 * i + 8]) for i in range(n))
    assert n >= 12  # two replicas' first batches fit in one epoch

    (one,) = take(micro_batches(config, checkpoint, VOCAB, 0, 1), 1)
    assert all(mb.shape == (2, 8) and mb.dtype == torch.int64 for mb in one) and len(one) == 3
    first, second = (rows(take(micro_batches(config, checkpoint, VOCAB, r, 2), 1)[0]) for r in range(2))
    assert first == rows(one)  # replica 0 of 2 starts the order replica 0 of 1 sees
    assert set(first).isdisjoint(second) and set(first + second) <= set(sequences)
    text = "\n".join(t for t in TEXT if t)
    for row in first + second:
        assert tokenizer.decode(row, skip_special_tokens=False).replace("<eos>", "\n") in text

    # epochs follow each other, each a fresh shuffle holding every sequence once
    stream = [row for it in take(micro_batches(config, checkpoint, VOCAB, 0, 1), -(-3 * n // 6)) for row in rows(it)]
    epochs = [stream[e * n : (e + 1) * n] for e in range(3)]
    assert all(sorted(e) == sequences for e in epochs) and epochs[0] != epochs[1]


def test_save_to_disk_directory_and_dataset_dict(tmp_path, checkpoint):
    docs = [t for t in TEXT if t]
    plain, dd = tmp_path / "plain", tmp_path / "dict"
    datasets.Dataset.from_dict({"body": docs}).save_to_disk(str(plain))
    datasets.DatasetDict({"validation": datasets.Dataset.from_dict({"text": docs})}).save_to_disk(str(dd))
    tokenizer = tiny_tokenizer()
    for data in (dataset_section(plain, text_column_name="body"), dataset_section(dd, hf_dataset_splits="validation")):
        (it,) = take(micro_batches(load(tmp_path, data_config(data)), checkpoint, VOCAB, 0, 1), 1)
        assert [mb.shape for mb in it] == [(2, 8)] * 3
        text = "".join(tokenizer.decode(row, skip_special_tokens=True) for mb in it for row in mb)
        assert set(text) <= set("".join(docs))


@pytest.mark.parametrize(
    ("dataset", "field", "message"),
    [
        ({"hf_dataset_or_datasets": "stas/openwebtext-10k"}, "data.dataset.hf_dataset_or_datasets", "no local path"),
        ({"hf_dataset_or_datasets": {"a": 0.5, "b": 0.5}}, "data.dataset.hf_dataset_or_datasets", "dict of datasets"),
        ({"hf_dataset_or_datasets": "TEXT", "text_column_name": "content"}, "data.dataset.text_column_name", "no column 'content'"),
        ({"hf_dataset_or_datasets": "CSV"}, "data.dataset.hf_dataset_or_datasets", ".csv file"),
        ({"hf_dataset_or_datasets": "DIR"}, "data.dataset.hf_dataset_or_datasets", "not a directory written by save_to_disk"),
    ],
)
def test_bad_dataset_is_named(tmp_path, checkpoint, text_file, dataset, field, message):
    where = dataset["hf_dataset_or_datasets"]
    if where == "TEXT":
        where = str(text_file)
    elif where == "CSV":
        (tmp_path / "docs.csv").write_text("text\nhello\n")
        where = str(tmp_path / "docs.csv")
    elif where == "DIR":
        where = str(tmp_path)
    config = load(tmp_path, data_config({"dataset": {**dataset, "hf_dataset_or_datasets": where}, "seed": 3}))
    with pytest.raises(RecipeError) as exc:
        micro_batches(config, checkpoint, VOCAB, 0, 1)
    assert exc.value.problems[0][0] == field and message in str(exc.value)


def test_missing_split_tokenizer_and_vocab_overflow_are_named(tmp_path, checkpoint, text_file):
    dd = tmp_path / "dict"
    datasets.DatasetDict({"validation": datasets.Dataset.from_dict({"text": ["hello"]})}).save_to_disk(str(dd))
    with pytest.raises(RecipeError, match="split 'train' is not in") as exc:
        micro_batches(load(tmp_path, data_config(dataset_section(dd))), checkpoint, VOCAB, 0, 1)
    assert exc.value.problems[0][0] == "data.dataset.hf_dataset_splits"

    with pytest.raises(RecipeError, match="cannot load a tokenizer") as exc:
        micro_batches(load(tmp_path, data_config(dataset_section(text_file))), tmp_path, VOCAB, 0, 1)
    assert exc.value.problems[0][0] == "tokenizer.tokenizer_name_or_path"

    config = load(tmp_path, data_config(dataset_section(text_file), tokenizer=str(checkpoint)))  # named, not the checkpoint's
    with pytest.raises(RecipeError, match="gives token id 9[0-9], but the model's vocab_size is 50") as exc:
        micro_batches(config, tmp_path, 50, 0, 1)
    assert exc.value.problems[0][0] == "tokenizer.tokenizer_name_or_path"


def test_nanotron_main_data_stages_are_read_from_the_first_stage(tmp_path, checkpoint, text_file):
    """nanotron main's layout (`data_stages`), which PyPI 0.4's Config cannot load, as attributes."""
    stock = load(tmp_path, data_config())
    stage = SimpleNamespace(
        name="stable", start_training_step=1, data=SimpleNamespace(seed=None, dataset=SimpleNamespace(
            hf_dataset_or_datasets=str(tmp_path / "missing.txt"), hf_dataset_splits="train", text_column_name="text")))
    later = SimpleNamespace(name="anneal", start_training_step=10, data=SimpleNamespace(seed=None, dataset=None))
    config = SimpleNamespace(data_stages=[later, stage], tokens=stock.tokens, general=stock.general, tokenizer=stock.tokenizer)
    with pytest.raises(RecipeError) as exc:
        micro_batches(config, checkpoint, VOCAB, 0, 1)
    assert exc.value.problems[0][0] == "data_stages[1].data.dataset.hf_dataset_or_datasets"
    stage.data.dataset.hf_dataset_or_datasets = str(text_file)  # data.seed None: general.seed shuffles
    (it,) = take(micro_batches(config, checkpoint, VOCAB, 1, 2), 1)
    assert [mb.shape for mb in it] == [(2, 8)] * 3
