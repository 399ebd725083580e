import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_loaded():
    from models.loading import tiny_model

    return tiny_model()


@pytest.fixture(scope="session")
def tokenizer():
    from models.loading import load_tokenizer

    return load_tokenizer()
