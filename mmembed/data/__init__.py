"""Rows -> samples: the readers for both ms-swift row forms, media binding, dataset specs
(local files and folders, hub dataset ids).

Validate a file without training::

    from mmembed.data import read_file
    samples = read_file("train.jsonl")   # raises DataError naming file, line and field
"""

from .dataset import EmbeddingDataset, LoadResult, load_samples
from .formats import iter_raw_rows
from .hub import DatasetHubOptions
from .labels import LabelRule
from .reader import read_file
from .rows import parse_row
from .sample import DataError, Item, Sample
from .specs import HubDataset, SpecError, parse_spec, split_dataset

__all__ = [
    "DataError",
    "EmbeddingDataset",
    "HubDataset",
    "DatasetHubOptions",
    "Item",
    "LabelRule",
    "LoadResult",
    "Sample",
    "SpecError",
    "iter_raw_rows",
    "load_samples",
    "parse_row",
    "parse_spec",
    "read_file",
    "split_dataset",
]
