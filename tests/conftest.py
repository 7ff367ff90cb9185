"""Shared test settings. The fixtures under tests/fixtures are copies of ../shared/fixtures so the suite
runs from a lone clone of the project."""

from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
GPT2_FIXTURE = FIXTURES / "openai-gpt2-tiny"
GPT1_FIXTURE = FIXTURES / "openai-gpt1-tiny"


@pytest.fixture
def gpt2_fixture_dir() -> Path:
    return GPT2_FIXTURE


@pytest.fixture
def gpt1_fixture_dir() -> Path:
    return GPT1_FIXTURE
