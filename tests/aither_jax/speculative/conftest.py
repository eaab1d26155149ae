"""The speculative tests' session fixtures (and `stand_in_draft` in tests/conftest.py)."""

import pytest

from models.registry import load_model
from tests.aither_jax.speculative.common import STAND_IN
from tests.conftest import MODEL, give_key_transform


@pytest.fixture(scope="session")
def stand_in_key_transform(tmp_path_factory):
    """Gives the stand-in target its real model's fitted key transform (for -pc formats)
    while the session lasts."""
    stand_in = load_model(MODEL, STAND_IN["dtype"], num_layers=STAND_IN["_num_layers"])
    with pytest.MonkeyPatch.context() as monkeypatch:
        give_key_transform(monkeypatch, stand_in, tmp_path_factory.mktemp("key-transform"))
        yield
