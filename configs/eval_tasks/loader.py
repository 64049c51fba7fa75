"""The local tasks' documents (stdlib_mc.yaml, stdlib_gen.yaml: `custom_dataset: !function loader.<name>`):
the jsonl files beside this file, read without `datasets.load_dataset` (no hub, no cache, any working
directory). lm-eval calls them with the task's metadata (the model args), which they ignore."""
import json
import os

import datasets

HERE = os.path.dirname(os.path.abspath(__file__))


def _read(name: str) -> datasets.DatasetDict:
    with open(os.path.join(HERE, name), encoding="utf-8") as f:
        return datasets.DatasetDict({"test": datasets.Dataset.from_list([json.loads(line) for line in f if line.strip()])})


def stdlib_mc(**_metadata) -> datasets.DatasetDict:
    return _read("stdlib_mc.jsonl")


def stdlib_gen(**_metadata) -> datasets.DatasetDict:
    return _read("stdlib_gen.jsonl")
