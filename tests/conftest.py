import gc
import os

# Before torch loads (as the CLI does): OpenMP threads that spin at every barrier cost a
# test of the tiny models more than the work itself, and subprocesses (torchrun ranks, CLI
# runs) that spin beside them stall each other on a 2-core machine (an IF-Guide test
# took 62 s with spinning threads and 4 s without, under load).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The tests' models are tiny: one thread each is faster than two that synchronise at
# every operator. Thread-dependent paths set their threads themselves (curvature/test_eigh.py).
torch.set_num_threads(1)

from tiny import tiny_llama, tiny_tokenizer  # noqa: E402

# The reason of the local `needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
# reason="needs CUDA")` markers that some test files still define; a test carrying one
# is treated as marked `gpu` so that `pytest -m gpu` selects it too.
NEEDS_CUDA_REASON = "needs CUDA"


def _needs_cuda(item) -> bool:
    return item.get_closest_marker("gpu") is not None or any(
        m.kwargs.get("reason") == NEEDS_CUDA_REASON for m in item.iter_markers("skipif"))


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` (``@pytest.mark.gpu``: they need a CUDA device) are
    skipped where CUDA is unavailable; ``pytest -m gpu`` runs only them."""
    skip = pytest.mark.skip(reason="marked gpu: needs a CUDA device")
    for item in items:
        if _needs_cuda(item):
            if item.get_closest_marker("gpu") is None:
                item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)


@pytest.fixture(scope="module", autouse=True)
def _frozen_heap():
    """At each test module's start, move what exists (torch, transformers, the packages
    earlier tests imported, long-lived fixtures) out of the garbage collector's sight: a
    full collection walks every tracked object, and the fine-tunes (accelerate's
    ``release_memory``), kronfluence and the evaluation protocols call ``gc.collect()`` at
    each step (0.7 s each over the whole heap, half the CPU time of an evaluation test).
    What the tests create afterwards is still collected."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory):
    """One torchrun launch of two CPU ranks for test_distributed.py and test_sharding.py
    (:func:`torchrun.launch_two_ranks`): the directory of its inputs and outputs."""
    from torchrun import launch_two_ranks
    return launch_two_ranks(tmp_path_factory.mktemp("two-ranks"))


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


def write_inputs(tmp_path, pool_examples, pair_examples):
    """The pool and target pairs as JSON Lines files in ``tmp_path``: (pool, targets)."""
    import json
    pool = tmp_path / "pool.jsonl"
    pool.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p, "response": r}) + "\n"
                            for i, (p, r) in enumerate(pool_examples)))
    targets = tmp_path / "targets.jsonl"
    targets.write_text("".join(json.dumps({"id": f"q{i}", "prompt": q, "chosen": c, "rejected": r}) + "\n"
                               for i, (q, c, r) in enumerate(pair_examples)))
    return pool, targets


@pytest.fixture
def encoded_pool(tok, pool_examples):
    from prism_select.data.tokenize import encode
    return [encode(tok, p, r) for p, r in pool_examples]


@pytest.fixture
def encoded_pairs(tok, pair_examples):
    from prism_select.data.tokenize import encode
    chosen = [encode(tok, q, c) for q, c, _ in pair_examples]
    rejected = [encode(tok, q, r) for q, _, r in pair_examples]
    return chosen, rejected

