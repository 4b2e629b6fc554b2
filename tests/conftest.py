import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from tiny import tiny_llama, tiny_tokenizer  # noqa: E402


@pytest.fixture
def tok():
    return tiny_tokenizer()


@pytest.fixture
def model(tok):
    return tiny_llama(len(tok))


def linear_modules(model):
    return {n: m for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and ".layers." in n}


@pytest.fixture
def modules(model):
    return linear_modules(model)


POOL = [
    ("What is 2+3?", "2+3=5. The answer is 5."),
    ("What is 4+4?", "4+4=9. The answer is 9."),
    ("Name a colour.", "Blue."),
    ("What is 7-2?", "7-2=5. The answer is 5."),
    ("Say hi.", "Hi there!"),
    ("What is 3*3?", "3*3=6. The answer is 6."),
    ("Spell cat.", "c-a-t"),
    ("What is 10/2?", "10/2=5. So 5."),
]

PAIRS = [
    ("What is 1+1?", "1+1=3. The answer is 3.", "1+1=2. The answer is 2."),
    ("What is 5+2?", "5+2=8. The answer is 8.", "5+2=7. The answer is 7."),
    ("What is 6-1?", "6-1=4.", "6-1=5."),
]


@pytest.fixture
def pool_examples():
    return POOL


@pytest.fixture
def pair_examples():
    return PAIRS
